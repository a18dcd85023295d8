/* SPDX-License-Identifier: MIT
 * ephost's ONNX Runtime plugin EP library: the two symbols ORT looks up, forwarded to functions that
 * ephost.ort sets from Python (ctypes). All EP logic is in Python; below them, the two reads and writes of a kernel
 * context that Compute makes every run, done here in one call each, and the common case of the bridged device's
 * allocator.
 * In a Python application ephost.ort.register sets them before it registers this library. In a host without
 * Python (a C, C++ or C# application), or one that registered the library with ORT directly, the first
 * CreateEpFactories starts Python here (the libpython this library was built against, embedded) or takes the
 * host's, and has ephost.ort.host set them: the registration name's target then comes from the TOML file that
 * $EPHOST_CONFIG names. Where that fails, CreateEpFactories returns an error status saying why. */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* types and signatures only: every Python function is looked up at run time (dlsym) */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#ifndef EPHOST_PYTHON_LIBRARY
#define EPHOST_PYTHON_LIBRARY "" /* set by setup.py: the shared libpython of the Python that built this library */
#endif
#ifndef EPHOST_SHIM_DIGEST
#define EPHOST_SHIM_DIGEST "" /* set by setup.py: this file's SHA-256 (app/ort/build.py checks it) */
#endif

EXPORT const char ephost_shim_digest[] = EPHOST_SHIM_DIGEST;
EXPORT const char ephost_python_library[] = EPHOST_PYTHON_LIBRARY;

typedef void *(*create_fn)(const char *name, const void *api_base, const void *logger, void **factories,
                           size_t max_factories, size_t *num_factories);
typedef void *(*release_fn)(void *factory);
typedef struct { const void *(*GetApi)(uint32_t version); const char *(*GetVersionString)(void); } api_base_t;
typedef void *(*create_status_fn)(int code, const char *msg); /* OrtApi index 0 in every version */

static volatile create_fn g_create;
static volatile release_fn g_release;

EXPORT void ephost_ort_set_callbacks(create_fn create, release_fn release) { g_create = create; g_release = release; }

static void *fail(const void *api_base, const char *message) {
  const create_status_fn *api = (const create_status_fn *)((const api_base_t *)api_base)->GetApi(1);
  return api ? api[0](1 /* ORT_FAIL */, message) : 0;
}

/* --- Python, where the host has none: embedded, started once ---------------------------------------------- */

static pthread_mutex_t g_python_lock = PTHREAD_MUTEX_INITIALIZER; /* guards starting Python and ephost.ort.host */
static char g_why[2048];                                          /* why the start failed, for ORT's status */
static int g_embedded;                                             /* this library started Python */
static int g_stop_at_exit;                                         /* on_exit_stop is registered */

typedef struct {
  int (*IsInitialized)(void);
  void (*InitPythonConfig)(PyConfig *);
  PyStatus (*SetBytesString)(PyConfig *, wchar_t **, const char *);
  PyStatus (*InitializeFromConfig)(const PyConfig *);
  void (*ConfigClear)(PyConfig *);
  int (*StatusException)(PyStatus);
  PyThreadState *(*SaveThread)(void);
  PyGILState_STATE (*GILEnsure)(void);
  void (*GILRelease)(PyGILState_STATE);
  PyObject *(*Import)(const char *);
  PyObject *(*CallMethod)(PyObject *, const char *, const char *, ...);
  const char *(*AsUTF8)(PyObject *);
  void (*DecRef)(PyObject *);
  void (*ErrPrint)(void);
} python_t;

static python_t py;

static int look_up(void *lib) {
#define FIND(field, name) if (!(*(void **)&py.field = dlsym(lib, name))) return 0
  FIND(IsInitialized, "Py_IsInitialized"); FIND(InitPythonConfig, "PyConfig_InitPythonConfig");
  FIND(SetBytesString, "PyConfig_SetBytesString"); FIND(InitializeFromConfig, "Py_InitializeFromConfig");
  FIND(ConfigClear, "PyConfig_Clear"); FIND(StatusException, "PyStatus_Exception");
  FIND(SaveThread, "PyEval_SaveThread"); FIND(GILEnsure, "PyGILState_Ensure");
  FIND(GILRelease, "PyGILState_Release"); FIND(Import, "PyImport_ImportModule");
  FIND(CallMethod, "PyObject_CallMethod"); FIND(AsUTF8, "PyUnicode_AsUTF8"); FIND(DecRef, "Py_DecRef");
  FIND(ErrPrint, "PyErr_Print");
#undef FIND
  return 1;
}

/* The directory of this library's file. */
static int own_directory(char *out, size_t room) {
  Dl_info info;
  if (!dladdr((void *)&ephost_ort_set_callbacks, &info) || !info.dli_fname) return 0;
  char *real = realpath(info.dli_fname, 0);
  if (!real) return 0;
  char *slash = strrchr(real, '/');
  if (slash) *slash = 0;
  snprintf(out, room, "%s", real);
  free(real);
  return 1;
}

/* The interpreter whose environment holds this library: $EPHOST_PYTHON, else the bin/python of the virtual
 * environment above this file (its pyvenv.cfg), else none (the libpython's own prefix). */
static int interpreter(char *out, size_t room) {
  const char *explicit = getenv("EPHOST_PYTHON");
  if (explicit && *explicit) {
    snprintf(out, room, "%s", explicit);
    return 1;
  }
  char dir[3072], probe[3200];
  if (!own_directory(dir, sizeof dir)) return 0;
  for (char *slash; (slash = strrchr(dir, '/')) && slash != dir; *slash = 0) {
    snprintf(probe, sizeof probe, "%s/pyvenv.cfg", dir);
    if (access(probe, R_OK) == 0) {
      snprintf(out, room, "%s/bin/python3", dir);
      return 1;
    }
  }
  return 0;
}

static void on_exit_stop(void) {
  PyGILState_STATE state = py.GILEnsure();
  PyObject *host = py.Import("ephost.ort.host");
  PyObject *done = host ? py.CallMethod(host, "stop", 0) : 0;
  if (done) py.DecRef(done);
  else py.ErrPrint(); /* what failed goes to stderr: no Python error is left set in the host's thread */
  if (host) py.DecRef(host);
  py.GILRelease(state);
}

/* Python running in this process with ephost.ort's callbacks set; else 0, g_why saying why. */
static int start_python(void) {
  if (!py.IsInitialized) {
    void *lib = RTLD_DEFAULT;
    if (!dlsym(lib, "Py_IsInitialized")) { /* no Python in the host: embed the one this library was built for */
      const char *path = getenv("EPHOST_PYTHON_LIBRARY");
      if (!path || !*path) path = ephost_python_library;
      if (!*path) {
        snprintf(g_why, sizeof g_why, "ephost.ort: this process has no Python, and ephost was built by a Python "
                 "without a shared libpython to embed; set EPHOST_PYTHON_LIBRARY to one (libpython3.X.so)");
        return 0;
      }
      lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL); /* global: Python's extension modules link against it */
      if (!lib) {
        snprintf(g_why, sizeof g_why, "ephost.ort: loading Python (%s) failed: %s", path, dlerror());
        return 0;
      }
    }
    if (!look_up(lib)) {
      snprintf(g_why, sizeof g_why, "ephost.ort: the Python in this process lacks %s", dlerror());
      return 0;
    }
  }
  if (!py.IsInitialized()) {
    PyConfig config;
    char executable[4096];
    py.InitPythonConfig(&config);
    config.install_signal_handlers = 0; /* the host's signals stay the host's */
    config.parse_argv = 0;
    PyStatus status = {0}; /* _PyStatus_TYPE_OK */
    if (interpreter(executable, sizeof executable))
      status = py.SetBytesString(&config, &config.executable, executable); /* its venv, and the workers' Python */
    if (!py.StatusException(status)) status = py.InitializeFromConfig(&config);
    py.ConfigClear(&config);
    if (py.StatusException(status)) {
      snprintf(g_why, sizeof g_why, "ephost.ort: starting Python failed: %s",
               status.err_msg ? status.err_msg : "(no message)");
      return 0;
    }
    py.SaveThread(); /* the GIL goes to whichever thread of the host calls into ephost next */
    g_embedded = 1;
  }
  char dir[4096], path[4200];
  if (!own_directory(dir, sizeof dir)) {
    snprintf(g_why, sizeof g_why, "ephost.ort: the loader cannot say where this library is");
    return 0;
  }
  snprintf(path, sizeof path, "%s/libephost_ort.so", dir);
  PyGILState_STATE state = py.GILEnsure();
  PyObject *host = py.Import("ephost.ort.host");
  PyObject *result = host ? py.CallMethod(host, "start", "s", path) : 0;
  if (!result) {
    py.ErrPrint();
    snprintf(g_why, sizeof g_why, "ephost.ort: importing ephost.ort.host in Python failed (the traceback is on "
             "stderr): is ephost installed for %s? Set EPHOST_PYTHON to the python of its environment",
             g_embedded ? "the embedded Python" : "this process's Python");
  } else {
    const char *message = py.AsUTF8(result); /* '' where it started, else why not */
    if (!message) { /* a message UTF-8 cannot carry: its error to stderr, not left set */
      py.ErrPrint();
      snprintf(g_why, sizeof g_why, "ephost.ort: starting ephost.ort.host failed (the traceback is on stderr)");
    } else if (*message) {
      snprintf(g_why, sizeof g_why, "%s", message);
    }
    py.DecRef(result);
  }
  if (host) py.DecRef(host);
  py.GILRelease(state);
  if (g_create && g_embedded && !g_stop_at_exit) {
    g_stop_at_exit = 1;
    atexit(on_exit_stop); /* ends the workers; Python itself is left running (the host's threads may be in it) */
  }
  return g_create != 0;
}

EXPORT void *CreateEpFactories(const char *name, const void *api_base, const void *logger, void **factories,
                               size_t max_factories, size_t *num_factories) {
  create_fn create = g_create;
  if (!create) {
    pthread_mutex_lock(&g_python_lock);
    if (!g_create) start_python();
    create = g_create;
    pthread_mutex_unlock(&g_python_lock);
  }
  if (create) return create(name, api_base, logger, factories, max_factories, num_factories);
  *num_factories = 0;
  return fail(api_base, g_why[0] ? g_why : "ephost.ort: Python did not set the library's callbacks");
}

EXPORT void *ReleaseEpFactory(void *factory) {
  release_fn release = g_release;
  return release ? release(factory) : 0;
}

/* Put in place of every callback at interpreter exit: returns NULL (success, no object) for any signature. */
EXPORT void *ephost_ort_null(void) { return 0; }

/* A kernel context's tensors, read and made in one call each way: through ctypes each OrtApi call is a trip
 * through Python, and one tensor's type, shape and data are six of them. ephost.ort passes the OrtApi
 * functions (abi.py holds their table indices); this file knows only their C signatures. */
#define EPHOST_DIMS 8

typedef void *(*count_fn)(const void *context, size_t *out);
typedef void *(*input_fn)(const void *context, size_t index, const void **out);
typedef void *(*output_fn)(void *context, size_t index, const int64_t *dims, size_t rank, void **out);
typedef void *(*type_shape_fn)(const void *value, void **out);
typedef void *(*element_type_fn)(const void *info, int *out);
typedef void *(*dims_count_fn)(const void *info, size_t *out);
typedef void *(*dims_fn)(const void *info, int64_t *dims, size_t rank);
typedef void (*release_info_fn)(void *info);
typedef void *(*data_fn)(const void *value, void **out);

typedef struct {
  count_fn input_count; input_fn input; output_fn output; type_shape_fn type_and_shape;
  element_type_fn element_type; dims_count_fn dims_count; dims_fn dims; release_info_fn release_info; data_fn data;
} ephost_kernel_api_t;

/* One tensor. Its first members, up to `value`, name a view of its data (app/ort/kernel_io.py keys its views by their
 * bytes): the dimensions past its rank are zero. */
typedef struct {
  void *data; int32_t elem; int32_t rank; int64_t dims[EPHOST_DIMS]; const void *value;
} ephost_tensor_t;

/* The context's inputs into out[0 .. capacity); *count says how many it has. An input ORT gave none for reads as
 * rank -2, one of more than EPHOST_DIMS dimensions as rank -1 (its value set: the caller reads it itself). ORT's
 * status where a call failed, else NULL. */
EXPORT void *ephost_ort_inputs(const ephost_kernel_api_t *api, const void *context, ephost_tensor_t *out,
                        size_t capacity, size_t *count) {
  void *status = api->input_count(context, count);
  if (status) return status;
  size_t n = *count < capacity ? *count : capacity;
  for (size_t i = 0; i < n; i++) {
    ephost_tensor_t *t = &out[i];
    const void *value = 0;
    void *info = 0;
    int elem = 0;
    size_t rank = 0;
    memset(t, 0, sizeof *t);
    if ((status = api->input(context, i, &value))) return status;
    t->value = value;
    if (!value) {
      t->rank = -2;
      continue;
    }
    if ((status = api->type_and_shape(value, &info))) return status;
    status = api->element_type(info, &elem);
    if (!status) status = api->dims_count(info, &rank);
    if (!status && rank && rank <= EPHOST_DIMS) status = api->dims(info, t->dims, rank);
    api->release_info(info);
    if (status) return status;
    t->elem = elem;
    t->rank = rank <= EPHOST_DIMS ? (int32_t)rank : -1;
    if ((status = api->data(value, &t->data))) return status;
  }
  return 0;
}

/* Output `index` of the context, made with these dimensions, into *out as an input is read: its OrtValue, where its
 * data lies, its ONNX element type (what the caller's bytes are checked against before they are copied in) and
 * the dimensions (rank -1, none of them, where there are more than EPHOST_DIMS). */
EXPORT void *ephost_ort_output(const ephost_kernel_api_t *api, void *context, size_t index, const int64_t *dims,
                        size_t rank, ephost_tensor_t *out) {
  void *info = 0, *value = 0;
  int type = 0;
  memset(out, 0, sizeof *out);
  void *status = api->output(context, index, dims, rank, &value);
  if (status) return status;
  out->value = value;
  if ((status = api->data(value, &out->data))) return status;
  if ((status = api->type_and_shape(value, &info))) return status;
  status = api->element_type(info, &type);
  api->release_info(info);
  out->elem = type;
  if (rank <= EPHOST_DIMS) {
    memcpy(out->dims, dims, rank * sizeof *dims);
    out->rank = (int32_t)rank;
  } else {
    out->rank = -1;
  }
  return status;
}

/* The bridged device's allocator (app/ort/memory.py), its common case here: ORT allocates each bridged
 * partition's outputs in the device memory and frees them after the run, two calls into Python a run each
 * (through ctypes' trampolines: a large part of a small Compute). A pool keeps the blocks Python made in the worker's
 * memory: a block ORT frees waits idle here and is handed back for the next allocation of its size, Python asked
 * only for what the pool does not hold (a new size, a partition's output offered in place, private memory).
 * The pool begins with an OrtAllocator (filled from Python), so ORT calls these with the pool itself. */
#define EPHOST_POOL 64
enum { SLOT_EMPTY, SLOT_IDLE, SLOT_HANDED };
EXPORT const size_t ephost_pool_slots = EPHOST_POOL; /* read by app/ort/pool.py: the room ephost_pool_drain fills */

typedef void *(*pool_alloc_fn)(void *self, size_t size);
typedef void (*pool_free_fn)(void *self, void *p);

typedef struct {
  uint32_t version; /* OrtAllocator's members, as onnxruntime_c_api.h lays them out */
  void *alloc, *free, *info, *reserve, *get_stats, *alloc_on_stream;
  pool_alloc_fn python_alloc; /* what the pool does not hold goes to Python's */
  pool_free_fn python_free;
  pthread_mutex_t lock;
  size_t idle_bytes, idle_limit;
  struct { void *p; size_t size; int state; } slots[EPHOST_POOL];
} ephost_pool_t;

/* The pool whose next Alloc on this thread Python answers (a partition's output it offers ORT in place). */
static __thread const ephost_pool_t *g_offered;

/* A pool, never freed: ORT may hold its allocator past the registration (a small object per registration). */
EXPORT ephost_pool_t *ephost_pool_new(pool_alloc_fn python_alloc, pool_free_fn python_free, size_t idle_limit) {
  ephost_pool_t *pool = calloc(1, sizeof *pool);
  if (!pool) return 0;
  pool->python_alloc = python_alloc;
  pool->python_free = python_free;
  pool->idle_limit = idle_limit;
  pthread_mutex_init(&pool->lock, 0);
  return pool;
}

EXPORT void *ephost_pool_alloc(void *self, size_t size) {
  ephost_pool_t *pool = self;
  if (g_offered != pool) {
    pthread_mutex_lock(&pool->lock);
    for (int i = 0; i < EPHOST_POOL; i++) {
      if (pool->slots[i].state == SLOT_IDLE && pool->slots[i].size == size) {
        pool->slots[i].state = SLOT_HANDED;
        pool->idle_bytes -= size;
        void *p = pool->slots[i].p;
        pthread_mutex_unlock(&pool->lock);
        return p;
      }
    }
    pthread_mutex_unlock(&pool->lock);
  }
  return pool->python_alloc(self, size);
}

EXPORT void *ephost_pool_alloc_on_stream(void *self, size_t size, void *stream) {
  (void)stream;
  return ephost_pool_alloc(self, size);
}

EXPORT void ephost_pool_free(void *self, void *p) {
  ephost_pool_t *pool = self;
  pthread_mutex_lock(&pool->lock);
  for (int i = 0; i < EPHOST_POOL; i++) {
    if (pool->slots[i].state == SLOT_HANDED && pool->slots[i].p == p) {
      if (pool->idle_bytes + pool->slots[i].size <= pool->idle_limit) {
        pool->slots[i].state = SLOT_IDLE;
        pool->idle_bytes += pool->slots[i].size;
        pthread_mutex_unlock(&pool->lock);
        return;
      }
      pool->slots[i].state = SLOT_EMPTY; /* no room to keep it idle: Python gives it back to the worker */
      break;
    }
  }
  pthread_mutex_unlock(&pool->lock);
  pool->python_free(self, p);
}

/* Python made block p of `size` bytes for an Alloc and lets the pool keep it from its Free on. Where no slot is
 * free, an idle block is let go for it: *evicted says which (Python frees it; NULL: none). 0 where not kept (every
 * slot's block is in use): its Free goes to Python. */
EXPORT int ephost_pool_track(void *self, void *p, size_t size, void **evicted) {
  ephost_pool_t *pool = self;
  int empty = -1, idle = -1;
  *evicted = 0;
  pthread_mutex_lock(&pool->lock);
  for (int i = 0; i < EPHOST_POOL && empty < 0; i++) {
    if (pool->slots[i].state == SLOT_EMPTY) empty = i;
    else if (pool->slots[i].state == SLOT_IDLE && idle < 0) idle = i;
  }
  if (empty < 0 && idle >= 0) {
    *evicted = pool->slots[idle].p;
    pool->idle_bytes -= pool->slots[idle].size;
    empty = idle;
  }
  if (empty >= 0) {
    pool->slots[empty].p = p;
    pool->slots[empty].size = size;
    pool->slots[empty].state = SLOT_HANDED;
  }
  pthread_mutex_unlock(&pool->lock);
  return empty >= 0;
}

/* Let go of every block: the idle ones' addresses into idle[] (at most EPHOST_POOL; Python frees them), their
 * count returned; those ORT holds are freed through Python from now on. */
EXPORT size_t ephost_pool_drain(void *self, void **idle) {
  ephost_pool_t *pool = self;
  size_t n = 0;
  pthread_mutex_lock(&pool->lock);
  for (int i = 0; i < EPHOST_POOL; i++) {
    if (pool->slots[i].state == SLOT_IDLE) idle[n++] = pool->slots[i].p;
    pool->slots[i].state = SLOT_EMPTY;
  }
  pool->idle_bytes = 0;
  pthread_mutex_unlock(&pool->lock);
  return n;
}

/* The bytes of the blocks the pool holds idle, and (*idle_blocks) how many. */
EXPORT size_t ephost_pool_idle_bytes(void *self, size_t *idle_blocks) {
  ephost_pool_t *pool = self;
  size_t n = 0, bytes;
  pthread_mutex_lock(&pool->lock);
  for (int i = 0; i < EPHOST_POOL; i++) n += pool->slots[i].state == SLOT_IDLE;
  bytes = pool->idle_bytes;
  pthread_mutex_unlock(&pool->lock);
  *idle_blocks = n;
  return bytes;
}

/* The next Alloc of `pool` on this thread goes to Python (NULL: none does). */
EXPORT void ephost_pool_offer(const ephost_pool_t *pool) { g_offered = pool; }

/* A copy of a tensor kept in the worker's memory (app/ort/resident.py) made equal to ORT's, or ORT's to it:
 * each 64-byte chunk of src that differs from dst's is copied; the bytes copied. Both are read whole (memory
 * speed); only what changed is written (a decoder step's new token in a KV cache). Most of the two is equal: it is
 * compared a block at a time by the C library's memcmp (vectorised, several times a loop's speed), and only a
 * block that differs is looked at chunk by chunk. */
#define EPHOST_SYNC_BLOCK 1024 /* a multiple of 64: the chunks lie where they would without blocks */
EXPORT size_t ephost_ort_sync(unsigned char *dst, const unsigned char *src, size_t nbytes) {
  size_t copied = 0;
  for (size_t start = 0; start < nbytes; start += EPHOST_SYNC_BLOCK) {
    size_t end = nbytes - start < EPHOST_SYNC_BLOCK ? nbytes : start + EPHOST_SYNC_BLOCK, i = start;
    if (!memcmp(dst + start, src + start, end - start)) continue;
    for (; i + 64 <= end; i += 64) {
      if (memcmp(dst + i, src + i, 64)) {
        memcpy(dst + i, src + i, 64);
        copied += 64;
      }
    }
    if (i < end && memcmp(dst + i, src + i, end - i)) {
      memcpy(dst + i, src + i, end - i);
      copied += end - i;
    }
  }
  return copied;
}

/* ephost_ort_sync of several (dst, src, nbytes) in one call, each one's bytes copied into its `copied`: a Compute's
 * kept copies are brought up to date together. */
typedef struct {
  unsigned char *dst; const unsigned char *src; size_t nbytes; size_t copied;
} ephost_sync_t;

EXPORT void ephost_ort_sync_many(ephost_sync_t *jobs, size_t count) {
  for (size_t i = 0; i < count; i++) jobs[i].copied = ephost_ort_sync(jobs[i].dst, jobs[i].src, jobs[i].nbytes);
}
