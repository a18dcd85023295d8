/* A custom op library for ONNX Runtime that crashes on purpose, for tests: domain "test.crash", op "CrashOnce"
 * (float tensor in, the same tensor out). Its kernel raises SIGSEGV when the file CRASH_MARKER (a path given at
 * build time) exists, removing the file first: it crashes once per marker, so a restarted worker runs it.
 * With CRASH_IN_REGISTER defined, RegisterCustomOps itself crashes.
 *
 * ONNX Runtime's C API is used through its function table by position (OrtApi is append-only, so these
 * positions hold in every version): written against the ABI, no ONNX Runtime header is needed to build it. */
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef void *Status;                   /* OrtStatus*: NULL is success */
typedef Status (*Fn)();                 /* every OrtApi entry used here returns an OrtStatus* */
typedef struct { const void *(*GetApi)(uint32_t version); const char *(*GetVersionString)(void); } ApiBase;

enum {
  CreateCustomOpDomain = 26, CustomOpDomain_Add = 27, AddCustomOpDomain = 28, GetTensorMutableData = 51,
  GetDimensionsCount = 61, GetDimensions = 62, GetTensorShapeElementCount = 64, GetTensorTypeAndShape = 65,
  KernelContext_GetInput = 90, KernelContext_GetOutput = 91, ReleaseTensorTypeAndShapeInfo = 99,
};

static void *const *api; /* the OrtApi table */
#define CALL(index, ...) ((Fn)api[index])(__VA_ARGS__)

/* OrtCustomOp up to version 13's fields (ONNX Runtime reads some of them whatever the version says); the
 * fields later versions added are left NULL, which ONNX Runtime takes as "not given" for version 13. */
typedef struct CustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct CustomOp *, const void *api, const void *info);
  const char *(*GetName)(const struct CustomOp *);
  const char *(*GetExecutionProviderType)(const struct CustomOp *);
  int (*GetInputType)(const struct CustomOp *, size_t);
  size_t (*GetInputTypeCount)(const struct CustomOp *);
  int (*GetOutputType)(const struct CustomOp *, size_t);
  size_t (*GetOutputTypeCount)(const struct CustomOp *);
  void (*KernelCompute)(void *kernel, void *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const struct CustomOp *, size_t);  /* 0: required */
  int (*GetOutputCharacteristic)(const struct CustomOp *, size_t);
  int (*GetInputMemoryType)(const struct CustomOp *, size_t);      /* 0: OrtMemTypeDefault */
  int (*GetVariadicInputMinArity)(const struct CustomOp *);
  int (*GetVariadicInputHomogeneity)(const struct CustomOp *);
  int (*GetVariadicOutputMinArity)(const struct CustomOp *);
  int (*GetVariadicOutputHomogeneity)(const struct CustomOp *);
  void *later[16];                                                  /* fields of later versions: NULL */
} CustomOp;

static int kernel_state;
static void *create_kernel(const CustomOp *op, const void *a, const void *info) { return &kernel_state; }
static const char *name(const CustomOp *op) { return "CrashOnce"; }
static const char *provider(const CustomOp *op) { return NULL; } /* the CPU EP */
static int float_type(const CustomOp *op, size_t i) { return 1; } /* ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT */
static size_t one(const CustomOp *op) { return 1; }
static void destroy(void *kernel) {}
static int zero_at(const CustomOp *op, size_t i) { return 0; }
static int one_int(const CustomOp *op) { return 1; }

static void compute(void *kernel, void *context) {
  if (access(CRASH_MARKER, F_OK) == 0) {
    unlink(CRASH_MARKER);
    raise(SIGSEGV);
  }
  const void *input; void *output, *info; void *in_data, *out_data;
  size_t rank, count; int64_t dims[16];
  CALL(KernelContext_GetInput, context, (size_t)0, &input);
  CALL(GetTensorTypeAndShape, input, &info);
  CALL(GetDimensionsCount, info, &rank);
  if (rank > 16) rank = 16;
  CALL(GetDimensions, info, dims, rank);
  CALL(GetTensorShapeElementCount, info, &count);
  ((void (*)(void *))api[ReleaseTensorTypeAndShapeInfo])(info);
  CALL(KernelContext_GetOutput, context, (size_t)0, dims, rank, &output);
  CALL(GetTensorMutableData, (void *)input, &in_data);
  CALL(GetTensorMutableData, output, &out_data);
  memcpy(out_data, in_data, count * sizeof(float));
}

static CustomOp op = {13, create_kernel, name, provider, float_type, one, float_type, one, compute, destroy,
                      zero_at, zero_at, zero_at, one_int, one_int, one_int, one_int, {0}};

Status RegisterCustomOps(void *options, const ApiBase *base) {
#ifdef CRASH_IN_REGISTER
  raise(SIGSEGV);
#endif
  void *domain;
  Status status;
  api = base->GetApi(13);
  if ((status = CALL(CreateCustomOpDomain, "test.crash", &domain))) return status;
  if ((status = CALL(CustomOpDomain_Add, domain, &op))) return status;
  return CALL(AddCustomOpDomain, options, domain);
}
