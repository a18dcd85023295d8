/* An ONNX Runtime application in C, without Python: it loads ORT's shared library (from the onnxruntime wheel),
 * registers a plugin EP library under a name, selects that name's devices for a session and runs it. ORT's headers
 * are not on the machine: the few OrtApi functions it calls are declared here by their index in the OrtApi table
 * (facts of onnxruntime_c_api.h, frozen since the versions noted).
 *
 *   ort_host <libonnxruntime.so> <plugin library | -> <name> <model.onnx> <input> <output> <dims, e.g. 1,3,224,224>
 *
 * With "-" the session runs on ORT's CPU EP alone (no plugin). $ORT_HOST_CONFIG ("key=value;key=value") adds session
 * config entries. Then one command a line on stdin, one answer a line:
 *   run IN OUT    a run of the float32 tensor in file IN; its float output into OUT    -> "ok BYTES" | "error MESSAGE"
 *   loop IN       runs until one fails (3000 at most), "ok" after each              -> ... "error MESSAGE" | "done"
 *   time IN N     N timed runs                                                       -> "ns MEDIAN P10 P90"
 *   quit          unregister the plugin, release ORT's objects, exit                 -> "bye"
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void *S; /* OrtStatus*, NULL for success */
static void **api;

#define F(index, ret, ...) ((ret(*)(__VA_ARGS__))api[index])
#define GetErrorMessage F(2, const char *, S)
#define CreateEnv F(3, S, int, const char *, void **)
#define CreateSession F(7, S, void *, const char *, void *, void **)
#define Run F(9, S, void *, void *, const char *const *, void *const *, size_t, const char *const *, size_t, void **)
#define CreateSessionOptions F(10, S, void **)
#define CreateTensorWithDataAsOrtValue F(49, S, void *, void *, size_t, const int64_t *, size_t, int, void **)
#define GetTensorMutableData F(51, S, void *, void **)
#define GetTensorShapeElementCount F(64, S, void *, size_t *)
#define GetTensorTypeAndShape F(65, S, void *, void **)
#define CreateCpuMemoryInfo F(69, S, int, int, void **)
#define ReleaseEnv F(92, void, void *)
#define ReleaseStatus F(93, void, S)
#define ReleaseMemoryInfo F(94, void, void *)
#define ReleaseSession F(95, void, void *)
#define ReleaseValue F(96, void, void *)
#define ReleaseTensorTypeAndShapeInfo F(99, void, void *)
#define ReleaseSessionOptions F(100, void, void *)
#define AddSessionConfigEntry F(130, S, void *, const char *, const char *)           /* version 5 */
#define RegisterExecutionProviderLibrary F(301, S, void *, const char *, const char *) /* version 22 */
#define UnregisterExecutionProviderLibrary F(302, S, void *, const char *)
#define GetEpDevices F(303, S, void *, void *const **, size_t *)
#define SessionOptionsAppendExecutionProvider_V2 \
  F(304, S, void *, void *, void *const *, size_t, const char *const *, const char *const *, size_t)
#define EpDevice_EpName F(312, const char *, void *)

static char message[8192];

/* ORT's message for a failed call (the status released), or NULL for success. */
static const char *failed(S status) {
  if (!status) return 0;
  snprintf(message, sizeof message, "%s", GetErrorMessage(status));
  ReleaseStatus(status);
  for (char *c = message; *c; c++)
    if (*c == '\n') *c = ' ';
  return message;
}

static void die(const char *what, const char *why) {
  printf("fatal %s: %s\n", what, why);
  fflush(stdout);
  exit(2);
}

#define CHECK(what, call) do { const char *why = failed(call); if (why) die(what, why); } while (0)

static void *session, *memory;
static const char *input_name, *output_name;
static int64_t dims[8];
static size_t rank, elements;
static float *input;

static void read_input(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f || fread(input, sizeof(float), elements, f) != elements) die("reading", path);
  fclose(f);
}

/* One run; its output tensor (the caller releases it), or NULL with `message` saying why. */
static void *run_once(void) {
  void *in = 0, *out = 0;
  CHECK("CreateTensorWithDataAsOrtValue", CreateTensorWithDataAsOrtValue(memory, input, elements * sizeof(float),
                                                                        dims, rank, 1 /* float */, &in));
  const char *why = failed(Run(session, 0, &input_name, &in, 1, &output_name, 1, &out));
  ReleaseValue(in);
  return why ? 0 : out;
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc != 8) die("usage", "ort_host LIBONNXRUNTIME PLUGIN|- NAME MODEL INPUT OUTPUT DIMS");
  setvbuf(stdout, 0, _IOLBF, 0);
  void *ort = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!ort) die("dlopen", dlerror());
  typedef struct { void **(*GetApi)(uint32_t); const char *(*GetVersionString)(void); } api_base_t;
  const api_base_t *(*get_base)(void) = (const api_base_t *(*)(void))dlsym(ort, "OrtGetApiBase");
  if (!get_base) die("OrtGetApiBase", dlerror());
  const api_base_t *base = get_base();
  const char *version = base->GetVersionString();
  api = base->GetApi((uint32_t)atoi(strchr(version, '.') + 1)); /* ORT's API version is its minor version */
  if (!api) die("GetApi", version);
  const char *plugin = strcmp(argv[2], "-") ? argv[2] : 0, *name = argv[3];
  input_name = argv[5];
  output_name = argv[6];
  elements = 1;
  for (char *d = strtok(argv[7], ","); d && rank < 8; d = strtok(0, ",")) elements *= (size_t)(dims[rank++] = atoll(d));
  input = calloc(elements, sizeof(float));

  void *env = 0, *options = 0;
  CHECK("CreateEnv", CreateEnv(3 /* ERROR */, "ort_host", &env));
  CHECK("CreateSessionOptions", CreateSessionOptions(&options));
  if (plugin) {
    CHECK("RegisterExecutionProviderLibrary", RegisterExecutionProviderLibrary(env, name, plugin));
    void *const *devices = 0;
    size_t n = 0, mine = 0;
    void *chosen[8];
    CHECK("GetEpDevices", GetEpDevices(env, &devices, &n));
    for (size_t i = 0; i < n && mine < 8; i++)
      if (!strcmp(EpDevice_EpName(devices[i]), name)) chosen[mine++] = devices[i];
    if (!mine) die("GetEpDevices", "no device of the plugin's name");
    printf("devices %zu\n", mine);
    CHECK("SessionOptionsAppendExecutionProvider_V2",
          SessionOptionsAppendExecutionProvider_V2(options, env, chosen, mine, 0, 0, 0));
    /* every node on the plugin's devices, or no session: the run is the plugin's, not ORT's CPU EP's */
    CHECK("AddSessionConfigEntry", AddSessionConfigEntry(options, "session.disable_cpu_ep_fallback", "1"));
  }
  const char *entries = getenv("ORT_HOST_CONFIG");
  if (entries && *entries) {
    char *copy = strdup(entries), *rest = copy;
    for (char *entry; (entry = strtok_r(rest, ";", &rest));) {
      char *eq = strchr(entry, '=');
      if (!eq) die("ORT_HOST_CONFIG", entry);
      *eq = 0;
      CHECK("AddSessionConfigEntry", AddSessionConfigEntry(options, entry, eq + 1));
    }
    free(copy);
  }
  CHECK("CreateSession", CreateSession(env, argv[4], options, &session));
  CHECK("CreateCpuMemoryInfo", CreateCpuMemoryInfo(0 /* arena */, 0 /* default */, &memory));
  printf("ready %s\n", version);

  char line[4096], a[2048], b[2048];
  long count;
  while (fgets(line, sizeof line, stdin)) {
    if (sscanf(line, "run %2047s %2047s", a, b) == 2) {
      read_input(a);
      void *out = run_once();
      if (!out) {
        printf("error %s\n", message);
        continue;
      }
      float *data = 0;
      void *info = 0;
      size_t n = 0;
      CHECK("GetTensorMutableData", GetTensorMutableData(out, (void **)&data));
      CHECK("GetTensorTypeAndShape", GetTensorTypeAndShape(out, &info));
      CHECK("GetTensorShapeElementCount", GetTensorShapeElementCount(info, &n));
      ReleaseTensorTypeAndShapeInfo(info);
      FILE *f = fopen(b, "wb");
      if (!f) die("writing", b);
      size_t written = fwrite(data, sizeof(float), n, f) * sizeof(float);
      fclose(f);
      ReleaseValue(out);
      printf("ok %zu\n", written);
    } else if (sscanf(line, "loop %2047s", a) == 1) {
      read_input(a);
      int done = 0;
      for (int i = 0; i < 3000 && !done; i++) {
        void *out = run_once();
        if (out) {
          ReleaseValue(out);
          printf("ok\n");
        } else {
          printf("error %s\n", message);
          done = 1;
        }
      }
      if (!done) printf("done\n");
    } else if (sscanf(line, "time %2047s %ld", a, &count) == 2 && count > 0) {
      read_input(a);
      int64_t *t = calloc((size_t)count, sizeof *t);
      for (long i = 0; i < count; i++) {
        int64_t start = now_ns();
        void *out = run_once();
        if (!out) die("run", message);
        ReleaseValue(out);
        t[i] = now_ns() - start;
      }
      qsort(t, (size_t)count, sizeof *t, by_value);
      printf("ns %lld %lld %lld\n", (long long)t[count / 2], (long long)t[count / 10], (long long)t[count * 9 / 10]);
      free(t);
    } else if (!strncmp(line, "quit", 4)) {
      break;
    } else {
      printf("error unknown command\n");
    }
  }
  ReleaseSession(session);
  ReleaseSessionOptions(options);
  ReleaseMemoryInfo(memory);
  if (plugin) CHECK("UnregisterExecutionProviderLibrary", UnregisterExecutionProviderLibrary(env, name));
  ReleaseEnv(env);
  printf("bye\n");
  return 0;
}
