/* CPU build of the kdtree kernels (libkdtree_cpu.so): host pointers, single-threaded, batch-invariant.
 * Every row is a fixed-order computation (kd_common.h: lane k % 16, fixed pairwise combine), so a row's
 * result never depends on T. Hot loops have an AVX2 clone (same operations, same order: no FMA, see
 * -ffp-contract=off in the Makefile), picked at load time. */
#include <stdlib.h>
#include <string.h>

#include "kd_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KD_CLONES
#endif

const char *kd_backend(void) { return "cpu"; }
int kd_device_count(void) { return 1; }

int kd_malloc(void **ptr, size_t bytes) {
  if (!ptr) return kd_fail(KD_EINVAL, "kd_malloc: ptr is NULL");
  *ptr = malloc(bytes ? bytes : 1);
  return *ptr ? KD_OK : kd_fail(KD_ENOMEM, "kd_malloc: out of memory (%zu bytes)", bytes);
}
int kd_free(void *ptr) {
  free(ptr);
  return KD_OK;
}
int kd_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream) {
  (void)stream;
  memcpy(dst, src, bytes);
  return KD_OK;
}
int kd_memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream) {
  (void)stream;
  memcpy(dst, src, bytes);
  return KD_OK;
}
int kd_synchronize(void *stream) {
  (void)stream;
  return KD_OK;
}

#define KD_CHECK_PTR(name, p) \
  if (!(p)) return kd_fail(KD_EINVAL, "%s: %s is NULL", name, #p)

/* ---- linear ------------------------------------------------------------------------------------------ */
KD_CLONES static float kd_dot_f32(const float *a, const float *b, int64_t n) {
  float acc[KD_LANES] = {0};
  int64_t k = 0;
  for (; k + KD_LANES <= n; k += KD_LANES)
    for (int j = 0; j < KD_LANES; j++) acc[j] += a[k + j] * b[k + j];
  for (int j = 0; k < n; k++, j++) acc[j] += a[k] * b[k];
  return kd_lanes_sum(acc);
}

int kd_linear_f32(const float *x, const float *w, float *out, int64_t T, int64_t n_in, int64_t n_out,
                  void *stream) {
  (void)stream;
  kd_clear_error();
  if (T < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "kd_linear_f32: negative size");
  if (T == 0 || n_out == 0) return KD_OK;
  KD_CHECK_PTR("kd_linear_f32", x);
  KD_CHECK_PTR("kd_linear_f32", w);
  KD_CHECK_PTR("kd_linear_f32", out);
  for (int64_t o = 0; o < n_out; o++) /* weight row stays in cache across the T rows */
    for (int64_t t = 0; t < T; t++) out[t * n_out + o] = kd_dot_f32(w + o * n_in, x + t * n_in, n_in);
  return KD_OK;
}

/* One output of W4A16: identical products and order to kd_dot_f32 on the dequantized row. */
KD_CLONES static float kd_dot_w4(const uint32_t *wr, const float *sr, const float *x, int64_t n_in,
                                 int64_t words_per_group) {
  float acc[KD_LANES] = {0};
  int64_t full = n_in / 8, w = 0;
  for (; w < full; w++) {
    uint32_t u = wr[w];
    float s = sr[w / words_per_group];
    float *a = acc + ((w & 1) << 3); /* k = 8w + j -> lane k % 16 */
    const float *xk = x + 8 * w;
    for (int j = 0; j < 8; j++) a[j] += kd_int4_weight(u, j, s) * xk[j];
  }
  if (w * 8 < n_in) { /* partial last word: elements past n_in are padding */
    uint32_t u = wr[w];
    float s = sr[w / words_per_group];
    float *a = acc + ((w & 1) << 3);
    for (int j = 0; 8 * w + j < n_in; j++) a[j] += kd_int4_weight(u, j, s) * x[8 * w + j];
  }
  return kd_lanes_sum(acc);
}

int kd_linear_w4a16(const float *x, const int32_t *packed, const float *scales, float *out, int64_t T,
                    int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  (void)stream;
  kd_clear_error();
  if (T < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "kd_linear_w4a16: negative size");
  if (group <= 0 || group % 8 != 0)
    return kd_fail(KD_EINVAL, "kd_linear_w4a16: group=%lld must be a positive multiple of 8", (long long)group);
  if (T == 0 || n_out == 0) return KD_OK;
  KD_CHECK_PTR("kd_linear_w4a16", x);
  KD_CHECK_PTR("kd_linear_w4a16", packed);
  KD_CHECK_PTR("kd_linear_w4a16", scales);
  KD_CHECK_PTR("kd_linear_w4a16", out);
  int64_t n_words = (n_in + 7) / 8, n_groups = (n_in + group - 1) / group;
  for (int64_t o = 0; o < n_out; o++)
    for (int64_t t = 0; t < T; t++)
      out[t * n_out + o] = kd_dot_w4((const uint32_t *)packed + o * n_words, scales + o * n_groups, x + t * n_in,
                                     n_in, group / 8);
  return KD_OK;
}

int kd_linear_w4a16_half(const void *x, int act_dtype, const int32_t *packed, const float *scales, float *out,
                         int64_t T, int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  (void)x, (void)act_dtype, (void)packed, (void)scales, (void)out, (void)T, (void)n_in, (void)n_out,
      (void)group, (void)stream;
  return kd_fail(KD_EINVAL, "kd_linear_w4a16_half: fp16/bf16 activations are CUDA-only; use kd_linear_w4a16 "
                            "with float32 activations on cpu");
}

/* ---- rms_norm, silu_mul -------------------------------------------------------------------------------- */
KD_CLONES int kd_rms_norm(const float *x, const float *w, float *out, int64_t T, int64_t D, float eps,
                          void *stream) {
  (void)stream;
  kd_clear_error();
  if (T < 0 || D <= 0) return kd_fail(KD_EINVAL, "kd_rms_norm: bad size T=%lld D=%lld", (long long)T, (long long)D);
  if (T == 0) return KD_OK;
  KD_CHECK_PTR("kd_rms_norm", x);
  KD_CHECK_PTR("kd_rms_norm", w);
  KD_CHECK_PTR("kd_rms_norm", out);
  for (int64_t t = 0; t < T; t++) {
    const float *r = x + t * D;
    float inv = kd_rms_inv(kd_dot_f32(r, r, D), D, eps);
    for (int64_t d = 0; d < D; d++) out[t * D + d] = r[d] * inv * w[d];
  }
  return KD_OK;
}

int kd_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t I, void *stream) {
  (void)stream;
  kd_clear_error();
  if (T < 0 || I < 0) return kd_fail(KD_EINVAL, "kd_silu_mul: negative size");
  if (T == 0 || I == 0) return KD_OK;
  KD_CHECK_PTR("kd_silu_mul", gate);
  KD_CHECK_PTR("kd_silu_mul", up);
  KD_CHECK_PTR("kd_silu_mul", out);
  for (int64_t i = 0; i < T * I; i++) out[i] = kd_silu_mul1(gate[i], up[i]);
  return KD_OK;
}

/* ---- tree-verify MLA-absorb attention ------------------------------------------------------------------ */
KD_CLONES static void kd_axpy(float *y, float a, const float *x, int64_t n) {
  for (int64_t d = 0; d < n; d++) y[d] += a * x[d];
}

int kd_mla_attention(const float *q, const float *kv, const uint64_t *visibility, float *out, int64_t T,
                     int64_t H, int64_t L, int64_t R, int64_t n_prefix, float scale, void *stream) {
  (void)stream;
  kd_clear_error();
  if (T < 0 || H < 0 || L < 0 || R < 0 || n_prefix < 0) return kd_fail(KD_EINVAL, "kd_mla_attention: negative size");
  if (T == 0 || H == 0) return KD_OK;
  KD_CHECK_PTR("kd_mla_attention", q);
  KD_CHECK_PTR("kd_mla_attention", kv);
  KD_CHECK_PTR("kd_mla_attention", out);
  int64_t S = n_prefix + T, E = L + R, words = (T + 63) / 64;
  int64_t *keys = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
  float *p = (float *)malloc(sizeof(float) * (size_t)S);
  if (!keys || !p) {
    free(keys);
    free(p);
    return kd_fail(KD_ENOMEM, "kd_mla_attention: out of memory (S=%lld)", (long long)S);
  }
  for (int64_t t = 0; t < T; t++) {
    /* this query's visible keys, ascending position: the whole cache, then its visible block rows */
    int64_t n = 0;
    for (int64_t j = 0; j < n_prefix; j++) keys[n++] = j;
    for (int64_t k = 0; k < T; k++)
      if (visibility ? kd_visible(visibility + t * words, k) : k <= t) keys[n++] = n_prefix + k;
    for (int64_t h = 0; h < H; h++) {
      const float *qh = q + (t * H + h) * E;
      float *o = out + (t * H + h) * L;
      memset(o, 0, sizeof(float) * (size_t)L);
      if (n == 0) continue;
      float m = -INFINITY, sum = 0.0f;
      for (int64_t i = 0; i < n; i++) {
        p[i] = kd_dot_f32(qh, kv + keys[i] * E, E) * scale;
        if (p[i] > m) m = p[i];
      }
      for (int64_t i = 0; i < n; i++) {
        p[i] = expf(p[i] - m);
        sum += p[i];
      }
      for (int64_t i = 0; i < n; i++) kd_axpy(o, p[i] / sum, kv + keys[i] * E, L);
    }
  }
  free(keys);
  free(p);
  return KD_OK;
}
