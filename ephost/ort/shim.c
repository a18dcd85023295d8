/* SPDX-License-Identifier: MIT
 * ephost's ONNX Runtime plugin EP library: the two symbols ORT looks up, forwarded to functions that
 * ephost.ort sets from Python (ctypes) before it registers this library. All EP logic is in Python.
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
