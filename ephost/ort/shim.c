/* SPDX-License-Identifier: MIT
 * ephost's ONNX Runtime plugin EP library: the two symbols ORT looks up, forwarded to functions that
 * ephost.ort sets from Python (ctypes) before it registers this library. All EP logic is in Python; below them,
 * the two reads and writes of a kernel context that Compute makes every run, done here in one call each.
 * Until they are set (or after they are cleared at interpreter exit) CreateEpFactories fails with a status
 * and ReleaseEpFactory does nothing. */
#include <stddef.h>
#include <stdint.h>

typedef void *(*create_fn)(const char *name, const void *api_base, const void *logger, void **factories,
                           size_t max_factories, size_t *num_factories);
typedef void *(*release_fn)(void *factory);
typedef struct { const void *(*GetApi)(uint32_t version); const char *(*GetVersionString)(void); } api_base_t;
typedef void *(*create_status_fn)(int code, const char *msg); /* OrtApi index 0 in every version */

static volatile create_fn g_create;
static volatile release_fn g_release;

void ephost_ort_set_callbacks(create_fn create, release_fn release) { g_create = create; g_release = release; }

void *CreateEpFactories(const char *name, const void *api_base, const void *logger, void **factories,
                        size_t max_factories, size_t *num_factories) {
  create_fn create = g_create;
  if (create) return create(name, api_base, logger, factories, max_factories, num_factories);
  *num_factories = 0;
  const create_status_fn *api = (const create_status_fn *)((const api_base_t *)api_base)->GetApi(1);
  return api ? api[0](1 /* ORT_FAIL */, "ephost.ort: register this library with ephost.ort.register()") : 0;
}

void *ReleaseEpFactory(void *factory) {
  release_fn release = g_release;
  return release ? release(factory) : 0;
}

/* Put in place of every callback at interpreter exit: returns NULL (success, no object) for any signature. */
void *ephost_ort_null(void) { return 0; }

/* A kernel context's tensors, read and made in one call each way: through ctypes an OrtApi call costs about a
 * microsecond of Python, and one tensor's type, shape and data are six of them. ephost.ort passes the OrtApi
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

typedef struct {
  const void *value; void *data; int32_t elem; int32_t rank; int64_t dims[EPHOST_DIMS];
} ephost_tensor_t;

/* The context's inputs into out[0 .. capacity); *count says how many it has. An input ORT gave none for reads as
 * rank -2, one of more than EPHOST_DIMS dimensions as rank -1 (its value set: the caller reads it itself). ORT's
 * status where a call failed, else NULL. */
void *ephost_ort_inputs(const ephost_kernel_api_t *api, const void *context, ephost_tensor_t *out,
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
    t->data = 0;
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

/* Output `index` of the context, made with these dimensions: its OrtValue, and where its data lies. */
void *ephost_ort_output(const ephost_kernel_api_t *api, void *context, size_t index, const int64_t *dims,
                        size_t rank, void **value, void **data) {
  void *status = api->output(context, index, dims, rank, value);
  return status ? status : api->data(*value, data);
}
