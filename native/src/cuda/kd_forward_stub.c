/* The whole-model forward entry points of kdtree.h in the CUDA build (libkdtree_cuda.so): not implemented there
 * yet (its forward is its own issue); each returns KD_EINVAL with a message saying so, never crashes. */
#include "kd_common.h"

#define KD_NOT_YET(fn) kd_fail(KD_EINVAL, "%s: not implemented in the CUDA build yet; use backend=cpu", fn)

int kd_model_create(const kd_model_desc *desc, kd_model **out) {
  (void)desc;
  if (out) *out = NULL;
  return KD_NOT_YET("kd_model_create");
}
int kd_model_destroy(kd_model *m) { return m ? KD_NOT_YET("kd_model_destroy") : KD_OK; }
int kd_model_forward(kd_model *m, const kd_forward_args *a) {
  (void)m, (void)a;
  return KD_NOT_YET("kd_model_forward");
}
int kd_cache_alloc(kd_model *m, int64_t max_len, int64_t *slot) {
  (void)m, (void)max_len, (void)slot;
  return KD_NOT_YET("kd_cache_alloc");
}
int kd_cache_free(kd_model *m, int64_t slot) {
  (void)m, (void)slot;
  return KD_NOT_YET("kd_cache_free");
}
int kd_cache_length(kd_model *m, int64_t slot, int64_t *length) {
  (void)m, (void)slot, (void)length;
  return KD_NOT_YET("kd_cache_length");
}
int kd_cache_truncate(kd_model *m, int64_t slot, int64_t n) {
  (void)m, (void)slot, (void)n;
  return KD_NOT_YET("kd_cache_truncate");
}
int kd_cache_keep(kd_model *m, int64_t slot, int64_t start, const int64_t *rows, int64_t n) {
  (void)m, (void)slot, (void)start, (void)rows, (void)n;
  return KD_NOT_YET("kd_cache_keep");
}
int kd_cache_rows(kd_model *m, int64_t slot, int64_t layer, float **rows) {
  (void)m, (void)slot, (void)layer, (void)rows;
  return KD_NOT_YET("kd_cache_rows");
}
int kd_drafter_create(const kd_drafter_desc *desc, kd_drafter **out) {
  (void)desc;
  if (out) *out = NULL;
  return KD_NOT_YET("kd_drafter_create");
}
int kd_drafter_destroy(kd_drafter *d) { return d ? KD_NOT_YET("kd_drafter_destroy") : KD_OK; }
int kd_drafter_cache_alloc(kd_drafter *d, int64_t max_len, int64_t *slot) {
  (void)d, (void)max_len, (void)slot;
  return KD_NOT_YET("kd_drafter_cache_alloc");
}
int kd_drafter_cache_free(kd_drafter *d, int64_t slot) {
  (void)d, (void)slot;
  return KD_NOT_YET("kd_drafter_cache_free");
}
int kd_drafter_cache_length(kd_drafter *d, int64_t slot, int64_t *length) {
  (void)d, (void)slot, (void)length;
  return KD_NOT_YET("kd_drafter_cache_length");
}
int kd_drafter_cache_truncate(kd_drafter *d, int64_t slot, int64_t n) {
  (void)d, (void)slot, (void)n;
  return KD_NOT_YET("kd_drafter_cache_truncate");
}
int kd_drafter_extend(kd_drafter *d, int64_t n_seqs, const int64_t *slots, const int64_t *row_start,
                      const float *feats) {
  (void)d, (void)n_seqs, (void)slots, (void)row_start, (void)feats;
  return KD_NOT_YET("kd_drafter_extend");
}
int kd_drafter_draft(kd_drafter *d, int64_t n_seqs, const int64_t *slots, const int32_t *bonus, float *logits) {
  (void)d, (void)n_seqs, (void)slots, (void)bonus, (void)logits;
  return KD_NOT_YET("kd_drafter_draft");
}
