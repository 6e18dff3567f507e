/* CPU build of the kdtree kernels (libkdtree_cpu.so): host pointers, batch-invariant; large linears split their
 * outputs over OpenMP threads (each output still one thread's fixed-order dot).
 * Every row is a fixed-order computation (kd_common.h: lane k % 16, fixed pairwise combine), so a row's
 * result never depends on T. The dot products of the linears (and the attention's scores) are chains of fused
 * multiply-adds written in the source (fmaf, fmadd intrinsics); nothing else fuses (-ffp-contract=off in the
 * Makefile). Hot loops have AVX-512 and AVX2 versions (same operations, same order), picked at run time:
 * KDTREE_CPU_ISA=avx2 keeps the AVX2 ones on an AVX-512 host, KDTREE_CPU_GENERIC=1 forces the portable loops. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "kd_common.h"
#include "kd_cpu_internal.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KD_CLONES
#endif

const char *kd_backend(void) { return "cpu"; }
int kd_device_count(void) { return 1; }

/* backend.threads: the OpenMP threads of every parallel region, for whichever thread calls (a process-wide value:
 * omp_set_num_threads would set it for the calling thread only, and the server's forwards run on its engine
 * thread). 0 = OpenMP's own default (OMP_NUM_THREADS, else every core). */
static int kd_threads_set = 0;

int kd_set_threads(int n) {
  kd_clear_error();
  if (n < 0) return kd_fail(KD_EINVAL, "kd_set_threads: n=%d must be >= 0 (0 = the OpenMP default)", n);
  __atomic_store_n(&kd_threads_set, n, __ATOMIC_RELAXED);
  return KD_OK;
}

int kd_threads(void) {
  int n = __atomic_load_n(&kd_threads_set, __ATOMIC_RELAXED);
  return n > 0 ? n : omp_get_max_threads();
}

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


/* ---- linear ------------------------------------------------------------------------------------------ */
/* The dot product of every linear (and of the attention's scores): element k to lane k % 16 in ascending k, each
 * lane a chain of fused multiply-adds acc = fma(w_k, x_k, acc) (one rounding per product-sum), the lanes combined
 * by kd_lanes_sum. The portable loop; the AVX2 and AVX-512 kernels below run exactly these operations. */
KD_CLONES static float kd_dot_f32(const float *a, const float *b, int64_t n) {
  float acc[KD_LANES] = {0};
  int64_t k = 0;
  for (; k + KD_LANES <= n; k += KD_LANES)
    for (int j = 0; j < KD_LANES; j++) acc[j] = fmaf(a[k + j], b[k + j], acc[j]);
  for (int j = 0; k < n; k++, j++) acc[j] = fmaf(a[k], b[k], acc[j]);
  return kd_lanes_sum(acc);
}

/* sum of squares of a row (rms_norm): a plain multiply then add per lane, as numpy's reference */
KD_CLONES static float kd_sumsq(const float *a, int64_t n) {
  float acc[KD_LANES] = {0};
  int64_t k = 0;
  for (; k + KD_LANES <= n; k += KD_LANES)
    for (int j = 0; j < KD_LANES; j++) acc[j] += a[k + j] * a[k + j];
  for (int j = 0; k < n; k++, j++) acc[j] += a[k] * a[k];
  return kd_lanes_sum(acc);
}

/* BF16 bits -> float32, exact (bits << 16): the portable loop; kd_bf16_widen picks the AVX2 one */
static void kd_bf16_widen_generic(const uint16_t *s, float *d, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t b = (uint32_t)s[i] << 16;
    memcpy(d + i, &b, 4);
  }
}

/* A W4A16 weight's group scales [n_out, n_groups]: float32 (f), or BF16 bits (h) as compressed-tensors stores them --
 * half the bytes, widened exactly (bits << 16) where a group's scale is read, so both give the same weights. Exactly
 * one is set; kd_qs_row offsets whichever it is (a row, or a row's group). */
typedef struct {
  const float *f;
  const uint16_t *h;
} kd_qs;

__attribute__((unused)) static const kd_qs kd_qs_none = {NULL, NULL}; /* float32 and BF16 weights: no scales */

static inline kd_qs kd_qs_row(kd_qs s, int64_t off) {
  kd_qs r = {s.f ? s.f + off : NULL, s.h ? s.h + off : NULL};
  return r;
}

static inline float kd_qs_at(kd_qs s, int64_t g) {
  if (s.f) return s.f[g];
  uint32_t b = (uint32_t)s.h[g] << 16;
  float v;
  memcpy(&v, &b, 4);
  return v;
}

/* Dequantize one packed row: w[k] = q_k * scale_(k / group), exactly numpy's q.astype(float32) * scale. */
static void kd_dequant_row(const uint32_t *wr, kd_qs sr, float *w, int64_t n_in, int64_t words_per_group) {
  int64_t n_words = (n_in + 7) / 8, g = 0, left = words_per_group;
  for (int64_t wi = 0; wi < n_words; wi++) {
    const float s = kd_qs_at(sr, g);
    for (int j = 0; j < 8 && 8 * wi + j < n_in; j++) w[8 * wi + j] = kd_int4_weight(wr[wi], j, s);
    if (--left == 0) g++, left = words_per_group;
  }
}

/* One output of W4A16, fused: the same products (q * s) * x and the same lanes (k % 16) as kd_dot_f32 on the
 * dequantized row, so both paths agree bit for bit. The portable path; the AVX2 one is kd_w4_small_avx2. */
static float kd_dot_w4_generic(const uint32_t *wr, kd_qs sr, const float *x, int64_t n_in,
                               int64_t words_per_group) {
  float acc[KD_LANES] = {0};
  int64_t n_words = (n_in + 7) / 8, g = 0, left = words_per_group;
  for (int64_t wi = 0; wi < n_words; wi++) {
    float *a = acc + ((wi & 1) << 3); /* k = 8 wi + j -> lane k % 16 */
    const float s = kd_qs_at(sr, g);
    for (int j = 0; j < 8 && 8 * wi + j < n_in; j++) a[j] = fmaf(kd_int4_weight(wr[wi], j, s), x[8 * wi + j], a[j]);
    if (--left == 0) g++, left = words_per_group;
  }
  return kd_lanes_sum(acc);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* 8 dequantized weights of one word: (float)(nibble - 8) * scale, as kd_int4_weight. */
__attribute__((target("avx2,fma"))) static inline __m256 kd_w8_avx2(uint32_t u, float s) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  __m256i q = _mm256_sub_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)u), shifts),
                                                _mm256_set1_epi32(15)),
                               _mm256_set1_epi32(8));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s));
}

/* elements [0, n - n % 8) of kd_silu_mul_span; returns how many */
__attribute__((target("avx2,fma"))) static int64_t kd_silu_mul_avx2(const float *gate, const float *up, float *out,
                                                                int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g = _mm256_loadu_ps(gate + i);
    __m256 e = kd_expf8_avx2(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  return i;
}

/* elements [0, n - n % 8) of kd_exp_inplace; returns how many */
__attribute__((target("avx2,fma"))) static int64_t kd_exp_avx2(float *p, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, kd_expf8_avx2(_mm256_loadu_ps(p + i)));
  return i;
}
#endif

/* ---- multi-row dot kernels ------------------------------------------------------------------------------
 * A [rows x outputs] block of dot products, each one EXACTLY kd_dot_f32(w_o, x_t): element k to lane k % 16 in
 * ascending k (a fused multiply-add per element), the same tail, the same kd_lanes_sum. Blocking only decides
 * which dots run side by side (more independent add chains, one weight load for four rows), never a dot's
 * arithmetic, so a row's result stays independent of T (tests/native compare the AVX2 and portable paths). */

#if defined(__x86_64__) && defined(__GNUC__)
/* lanes 0..7 in lo, 8..15 in hi. The tail (n % 16 elements) goes to lanes 0.. as in kd_dot_f32, through masked
 * loads: a masked-off lane adds 0 * 0 = +0, which leaves it unchanged (an accumulator that starts at +0 is never
 * -0). kd_hsum is kd_lanes_sum's pairwise tree: [i] + [i+8], then [i] + [i+4], [i] + [i+2], [0] + [1]. */
__attribute__((target("avx2,fma"))) static inline __m256i kd_mask_avx2(int64_t r) { /* lanes < r (0..8) */
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

__attribute__((target("avx2,fma"))) static inline float kd_hsum_avx2(__m256 lo, __m256 hi) {
  __m256 v = _mm256_add_ps(lo, hi);
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

/* kd_hsum_avx2 of four dots at once -> [r0 r1 r2 r3]: the same pairs added at every level of the tree ([i] + [i+8],
 * [i] + [i+4], [i] + [i+2], [0] + [1]), only four dots side by side in one register instead of one each. */
__attribute__((target("avx2,fma"))) static inline __m128 kd_hsum4_avx2(__m256 l0, __m256 h0, __m256 l1, __m256 h1,
                                                                   __m256 l2, __m256 h2, __m256 l3, __m256 h3) {
  __m256 v0 = _mm256_add_ps(l0, h0), v1 = _mm256_add_ps(l1, h1), v2 = _mm256_add_ps(l2, h2),
         v3 = _mm256_add_ps(l3, h3);
  __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
  __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
  /* s01 = [v0: 0+4 1+5 2+6 3+7 | v1: ...], s23 likewise for v2, v3 */
  __m256 t = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  /* t = [v0: a b, v2: a b | v1: a b, v3: a b] with a = [0] + [2], b = [1] + [3] */
  __m256 g = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  /* g = [v0 v2 v0 v2 | v1 v3 v1 v3] */
  return _mm_unpacklo_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1));
}

/* acc += w[k..n) * x[k..n) into lanes 0.. (n - k < 16) */
#define KD_TAIL_AVX2(lo, hi, w, x, k, n)                                                              \
  do {                                                                                                \
    int64_t r_ = (n) - (k);                                                                           \
    if (r_ >= 8) {                                                                                    \
      lo = _mm256_fmadd_ps(_mm256_loadu_ps((w) + (k)), _mm256_loadu_ps((x) + (k)), lo);  \
      if (r_ > 8) {                                                                                   \
        __m256i m_ = kd_mask_avx2(r_ - 8);                                                            \
        hi = _mm256_fmadd_ps(_mm256_maskload_ps((w) + (k) + 8, m_), \
                                             _mm256_maskload_ps((x) + (k) + 8, m_), hi);                 \
      }                                                                                               \
    } else if (r_ > 0) {                                                                              \
      __m256i m_ = kd_mask_avx2(r_);                                                                  \
      lo = _mm256_fmadd_ps(_mm256_maskload_ps((w) + (k), m_), _mm256_maskload_ps((x) + (k), m_), lo); \
    }                                                                                                 \
  } while (0)

/* The weight-load step the dot kernels are generic over (bf = 0: float32 weights, 1: BF16 bits): 8 weights from
 * element k of row w, as float32. BF16 is widened exactly in the register (zero-extend, << 16), so a kernel
 * instantiated with bf = 1 adds exactly the products the bf = 0 one adds on the widened weights, in the same order. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 kd_wload_avx2(const void *w, int64_t k, const int bf) {
  if (bf)
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k))), 16));
  return _mm256_loadu_ps((const float *)w + k);
}

/* row o (stride ws elements) of a float32 / BF16 weight */
static inline const void *kd_wrow(const void *w, int64_t o, int64_t ws, const int bf) {
  return bf ? (const void *)((const uint16_t *)w + o * ws) : (const void *)((const float *)w + o * ws);
}

/* 8 BF16 -> float32 (exact), eight at a time; the tail one by one */
__attribute__((target("avx2,fma"))) static void kd_bf16_widen_avx2(const uint16_t *s, float *d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, kd_wload_avx2(s, i, 1));
  kd_bf16_widen_generic(s + i, d + i, n - i);
}

/* KD_TAIL_AVX2 of a float32 or BF16 row: a BF16 tail (< 16 elements) is widened into a float buffer first, then the
 * same masked loads run on it */
#define KD_WTAIL_AVX2(lo, hi, w, x, k, n, bf)                                                         \
  do {                                                                                                \
    if (bf) {                                                                                         \
      float t_[KD_LANES];                                                                             \
      int64_t r2_ = (n) - (k);                                                                        \
      if (r2_ > 0) {                                                                                  \
        kd_bf16_widen_generic((const uint16_t *)(w) + (k), t_, r2_);                                  \
        KD_TAIL_AVX2(lo, hi, t_, (x) + (k), 0, r2_);                                                  \
      }                                                                                               \
    } else {                                                                                          \
      KD_TAIL_AVX2(lo, hi, (const float *)(w), x, k, n);                                              \
    }                                                                                                 \
  } while (0)

__attribute__((target("avx2,fma"), always_inline)) static inline float kd_dot_avx2_t(const void *w, const float *x,
                                                                                 int64_t n, const int bf) {
  __m256 lo = _mm256_setzero_ps(), hi = lo;
  int64_t k = 0;
  for (; k + KD_LANES <= n; k += KD_LANES) {
    lo = _mm256_fmadd_ps(kd_wload_avx2(w, k, bf), _mm256_loadu_ps(x + k), lo);
    hi = _mm256_fmadd_ps(kd_wload_avx2(w, k + 8, bf), _mm256_loadu_ps(x + k + 8), hi);
  }
  KD_WTAIL_AVX2(lo, hi, w, x, k, n, bf);
  return kd_hsum_avx2(lo, hi);
}

__attribute__((target("avx2,fma"))) static float kd_dot_avx2(const float *w, const float *x, int64_t n) {
  return kd_dot_avx2_t(w, x, n, 0);
}
__attribute__((target("avx2,fma"))) static float kd_dot_bf16_avx2(const uint16_t *w, const float *x, int64_t n) {
  return kd_dot_avx2_t(w, x, n, 1);
}

/* one weight row against four x rows */
__attribute__((target("avx2,fma"))) static void kd_dot_1x4_avx2(const float *w, const float *x0, const float *x1,
                                                             const float *x2, const float *x3, int64_t n, float *r) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;
  int64_t k = 0;
  for (; k + KD_LANES <= n; k += KD_LANES) {
    __m256 wl = _mm256_loadu_ps(w + k), wh = _mm256_loadu_ps(w + k + 8);
    l0 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x0 + k), l0);
    h0 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x0 + k + 8), h0);
    l1 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x1 + k), l1);
    h1 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x1 + k + 8), h1);
    l2 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x2 + k), l2);
    h2 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x2 + k + 8), h2);
    l3 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x3 + k), l3);
    h3 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x3 + k + 8), h3);
  }
  KD_TAIL_AVX2(l0, h0, w, x0, k, n);
  KD_TAIL_AVX2(l1, h1, w, x1, k, n);
  KD_TAIL_AVX2(l2, h2, w, x2, k, n);
  KD_TAIL_AVX2(l3, h3, w, x3, k, n);
  r[0] = kd_hsum_avx2(l0, h0), r[1] = kd_hsum_avx2(l1, h1), r[2] = kd_hsum_avx2(l2, h2), r[3] = kd_hsum_avx2(l3, h3);
}

/* four weight rows (stride ws) against one x row; w float32 (bf = 0) or BF16 bits (bf = 1) */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_dot_4x1_avx2_t(const void *w, int64_t ws,
                                                                                    const float *x, int64_t n,
                                                                                    float *r, const int bf) {
  const void *w0 = w, *w1 = kd_wrow(w, 1, ws, bf), *w2 = kd_wrow(w, 2, ws, bf), *w3 = kd_wrow(w, 3, ws, bf);
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;
  int64_t k = 0;
  for (; k + KD_LANES <= n; k += KD_LANES) {
    __m256 xl = _mm256_loadu_ps(x + k), xh = _mm256_loadu_ps(x + k + 8);
    l0 = _mm256_fmadd_ps(kd_wload_avx2(w0, k, bf), xl, l0);
    h0 = _mm256_fmadd_ps(kd_wload_avx2(w0, k + 8, bf), xh, h0);
    l1 = _mm256_fmadd_ps(kd_wload_avx2(w1, k, bf), xl, l1);
    h1 = _mm256_fmadd_ps(kd_wload_avx2(w1, k + 8, bf), xh, h1);
    l2 = _mm256_fmadd_ps(kd_wload_avx2(w2, k, bf), xl, l2);
    h2 = _mm256_fmadd_ps(kd_wload_avx2(w2, k + 8, bf), xh, h2);
    l3 = _mm256_fmadd_ps(kd_wload_avx2(w3, k, bf), xl, l3);
    h3 = _mm256_fmadd_ps(kd_wload_avx2(w3, k + 8, bf), xh, h3);
  }
  KD_WTAIL_AVX2(l0, h0, w0, x, k, n, bf);
  KD_WTAIL_AVX2(l1, h1, w1, x, k, n, bf);
  KD_WTAIL_AVX2(l2, h2, w2, x, k, n, bf);
  KD_WTAIL_AVX2(l3, h3, w3, x, k, n, bf);
  _mm_storeu_ps(r, kd_hsum4_avx2(l0, h0, l1, h1, l2, h2, l3, h3));
}

__attribute__((target("avx2,fma"))) static void kd_dot_4x1_avx2(const float *w, int64_t ws, const float *x, int64_t n,
                                                             float *r) {
  kd_dot_4x1_avx2_t(w, ws, x, n, r, 0);
}
__attribute__((target("avx2,fma"))) static void kd_dot_4x1_bf16_avx2(const uint16_t *w, int64_t ws, const float *x,
                                                                  int64_t n, float *r) {
  kd_dot_4x1_avx2_t(w, ws, x, n, r, 1);
}

/* T = 1: out[o] = kd_dot_avx2(w row o, x), four weight rows per x load, the dots written straight to out. Small
 * matrices (the tiny model's, a decode step's dozens of calls) run without entering an OpenMP region: even one
 * with if(0) costs a GOMP_parallel call, about as much as a 64 x 128 GEMV. */
__attribute__((target("avx2,fma"))) static void kd_gemv_f32_avx2(const float *x, const float *w, float *out,
                                                              int64_t n_in, int64_t n_out, int parallel) {
  int64_t n4 = n_out / 4 * 4;
  if (parallel) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t o = 0; o < n4; o += 4) kd_dot_4x1_avx2(w + o * n_in, n_in, x, n_in, out + o);
  } else {
    for (int64_t o = 0; o < n4; o += 4) kd_dot_4x1_avx2(w + o * n_in, n_in, x, n_in, out + o);
  }
  for (int64_t o = n4; o < n_out; o++) out[o] = kd_dot_avx2(w + o * n_in, x, n_in);
}

#endif

/* dst[0..n) = the BF16 bits src widened to float32 (exact) */
void kd_bf16_widen(const uint16_t *src, float *dst, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) {
    kd_bf16_widen_avx2(src, dst, n);
    return;
  }
#endif
  kd_bf16_widen_generic(src, dst, n);
}

static float kd_dot(const float *w, const float *x, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) return kd_dot_avx2(w, x, n);
#endif
  return kd_dot_f32(w, x, n);
}

static void kd_dot_1x4(const float *w, const float *x, int64_t n, float *r) { /* x rows t..t+3, stride n */
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) {
    kd_dot_1x4_avx2(w, x, x + n, x + 2 * n, x + 3 * n, n, r);
    return;
  }
#endif
  for (int i = 0; i < 4; i++) r[i] = kd_dot_f32(w, x + i * n, n);
}

static void kd_dot_4x1(const float *w, int64_t ws, const float *x, int64_t n, float *r) { /* w rows, stride ws */
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) {
    kd_dot_4x1_avx2(w, ws, x, n, r);
    return;
  }
#endif
  for (int i = 0; i < 4; i++) r[i] = kd_dot_f32(w + i * ws, x, n);
}

/* ---- AVX2 short-row tiles and multi-row panels for T >= 2, and the fused W4A16 GEMV ------------------------ */
#if defined(__x86_64__) && defined(__GNUC__)
#define KD_KC 1024 /* rows up to this many floats take the direct tiles (whole dots in registers) */

/* Direct tiles for short rows (n_in <= KD_KC, the tiny model's and the drafter's matrices; T >= 2): an
 * [R rows x O outputs] tile computes whole dots in registers, from +0, and writes their kd_hsum -- no partial
 * buffer, no copies, weights read in place. Each dot is still exactly kd_dot_avx2's: lanes 0..7 (elements
 * k % 16 < 8) and lanes 8..15 are independent sums, so the tile runs them as two passes over k (first the low
 * eight lanes of every dot, then the high eight), each lane adding its products in ascending k, the tail as
 * KD_TAIL_AVX2, and combines them by kd_hsum_avx2(lo, hi). One accumulator per dot and pass: a 3 x 3 tile is
 * 9 accumulators + 3 weight vectors + 1 x vector + 1 product (no spill; a 4 x 3 tile spills an accumulator), and
 * 6 loads per 72 multiply-adds. */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_dtile_avx2(
    const int R, const int O, const float *x, int64_t xs, const float *w, int64_t ws, int64_t n, float *out,
    int64_t os) {
  __m256 a[3][3], lo[3][3];
  for (int p = 0; p < 2; p++) {
    const int64_t off = 8 * p;
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
      for (int o = 0; o < O; o++) a[r][o] = _mm256_setzero_ps();
    int64_t kb = 0;
    for (; kb + KD_LANES <= n; kb += KD_LANES) {
      __m256 wv[3];
#pragma GCC unroll 3
      for (int o = 0; o < O; o++) wv[o] = _mm256_loadu_ps(w + o * ws + kb + off);
#pragma GCC unroll 3
      for (int r = 0; r < R; r++) {
        __m256 xv = _mm256_loadu_ps(x + r * xs + kb + off);
#pragma GCC unroll 3
        for (int o = 0; o < O; o++) a[r][o] = _mm256_fmadd_ps(wv[o], xv, a[r][o]);
      }
    }
    int64_t rem = n - kb - off; /* this pass's elements of the n % 16 tail */
    if (rem > 0) {
      __m256i m = rem >= 8 ? _mm256_set1_epi32(-1) : kd_mask_avx2(rem);
      __m256 wv[3];
#pragma GCC unroll 3
      for (int o = 0; o < O; o++) wv[o] = _mm256_maskload_ps(w + o * ws + kb + off, m);
#pragma GCC unroll 3
      for (int r = 0; r < R; r++) {
        __m256 xv = _mm256_maskload_ps(x + r * xs + kb + off, m);
#pragma GCC unroll 3
        for (int o = 0; o < O; o++) a[r][o] = _mm256_fmadd_ps(wv[o], xv, a[r][o]);
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
      for (int o = 0; o < O; o++) {
        if (p == 0)
          lo[r][o] = a[r][o];
        else
          out[r * os + o] = kd_hsum_avx2(lo[r][o], a[r][o]);
      }
  }
}

#define KD_DTILE(R, O)                                                                                         \
  __attribute__((target("avx2,fma"))) static void kd_dtile_##R##x##O(const float *x, int64_t xs, const float *w,   \
                                                                   int64_t ws, int64_t n, float *out,          \
                                                                   int64_t os) {                               \
    kd_dtile_avx2(R, O, x, xs, w, ws, n, out, os);                                                            \
  }
KD_DTILE(3, 3) KD_DTILE(2, 3) KD_DTILE(1, 3)
KD_DTILE(3, 2) KD_DTILE(2, 2) KD_DTILE(1, 2)
KD_DTILE(3, 1) KD_DTILE(2, 1) KD_DTILE(1, 1)
typedef void (*kd_dtile_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t);
static const kd_dtile_fn kd_dtiles[3][3] = {{kd_dtile_1x1, kd_dtile_1x2, kd_dtile_1x3}, /* [R - 1][O - 1] */
                                            {kd_dtile_2x1, kd_dtile_2x2, kd_dtile_2x3},
                                            {kd_dtile_3x1, kd_dtile_3x2, kd_dtile_3x3}};

/* Multiply-adds from which a multi-row call splits its output tiles over the OpenMP threads: ~5 us of tile work,
 * several times a warm region's fork/join. A lone row (T = 1) never reaches it at the tiny model's sizes, so an
 * AR step stays single-threaded; a tree verify or a batched step of many requests uses every core. */
#define KD_PAR_MIN_MACS (1 << 16)

/* kd_cpu_internal.h; inside a region already, the pieces of an outer split stay serial */
int kd_par_worth(int64_t macs, int64_t units) {
  return macs >= KD_PAR_MIN_MACS && units >= 2 && !omp_in_parallel() && kd_threads() > 1;
}

/* output triple o3 of kd_linear_direct: every three rows of x against weight rows 3 o3 .. 3 o3 + 2 */
__attribute__((target("avx2,fma"))) static inline void kd_linear_direct_col(const float *x, int64_t xs, const float *w,
                                                                         int64_t ws, float *out, int64_t os, int64_t T,
                                                                         int64_t n, int64_t n_out, int64_t o) {
  int O = n_out - o < 3 ? (int)(n_out - o) : 3;
  for (int64_t t = 0; t < T; t += 3) {
    int R = T - t < 3 ? (int)(T - t) : 3;
    kd_dtiles[R - 1][O - 1](x + t * xs, xs, w + o * ws, ws, n, out + t * os + o, os);
  }
}

/* out[t * os + o] = dot(x row t (stride xs), w row o (stride ws)) over n <= KD_KC elements: triples of weight
 * rows (in L1) against every three rows of x. Large calls give each thread whole triples (static schedule): an
 * output is one thread's fixed-order dot either way, so the bits do not depend on the number of threads. */
__attribute__((target("avx2,fma"))) static void kd_linear_direct(const float *x, int64_t xs, const float *w, int64_t ws,
                                                              float *out, int64_t os, int64_t T, int64_t n,
                                                              int64_t n_out) {
  int64_t n3 = (n_out + 2) / 3;
  if (kd_par_worth(T * n * n_out, n3)) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t i = 0; i < n3; i++) kd_linear_direct_col(x, xs, w, ws, out, os, T, n, n_out, 3 * i);
    return;
  }
  for (int64_t i = 0; i < n3; i++) kd_linear_direct_col(x, xs, w, ws, out, os, T, n, n_out, 3 * i);
}

/* Elements [k0, k1) of one packed row -> w[0 .. k1 - k0), each kd_int4_weight (the exact dequantized value). */
__attribute__((target("avx2,fma"))) static void kd_dequant_slice_avx2(const uint32_t *wr, kd_qs sr, float *w,
                                                                  int64_t k0, int64_t k1, int64_t wpg) {
  int64_t wi = k0 / 8, g = wi / wpg, left = wpg - wi % wpg; /* k0 is a multiple of 16; one division per slice */
  for (; 8 * wi + 8 <= k1; wi++) {
    _mm256_storeu_ps(w + 8 * wi - k0, kd_w8_avx2(wr[wi], kd_qs_at(sr, g)));
    if (--left == 0) g++, left = wpg;
  }
  for (int j = 0; 8 * wi + j < k1; j++) w[8 * wi + j - k0] = kd_int4_weight(wr[wi], j, kd_qs_at(sr, g));
}

/* ---- AVX2 panels: one forward's T rows against each loaded weight block ------------------------------------
 * kd_linear_512's schedule with 8-lane registers. A dot's 16 lanes are two registers (lo: elements k % 16 < 8, hi:
 * the rest), and a tile holding both for 3 rows x 4 outputs would need 24 accumulators of the 16 registers, so each k
 * block runs as two passes, first the lo lanes of every dot of the tile, then the hi lanes: 12 accumulators, 3 x
 * rows and 4 weight rows per step. Each lane still adds its products in ascending k (its partial sum parked in P
 * between blocks and passes; the row's n % 16 tail as zeros, 0 * 0 + acc = acc as KD_TAIL_AVX2's masked lanes), and
 * kd_hsum_avx2 combines lo and hi at the end: kd_dot_f32's bits. So that each pass reads x contiguously, x is copied
 * once per call with every k block de-interleaved (its lo halves, then its hi halves); weights are read in panels of
 * KD_QO rows, k block by k block (KD_QKC elements: a float32 panel block is 8 KB, in L1 for the second pass and the
 * later row tiles), float32 in place (every other 32 bytes per pass), BF16 in place for a few rows (widened in the
 * register) or, like INT4 blocks, widened / dequantized once per block into the thread's buffer in the
 * de-interleaved order. Why this shape, on a Zen 3 host (AVX2, FMA roof 102 GFLOP/s per thread): the
 * former [2 rows x 3 outputs] tile of both halves kept 20 registers live (spilled) and ran the multi-row linears at
 * 40-50 GFLOP/s per thread; in a C harness with x from L2 the two-pass 3 x 4 tile ran at 81-85, 4 x 3 at 66-71, 2 x 6
 * at 67-70. Against it in the library (native/bench_ab.py, 2 threads, 2048 x 7168 / 7168 x 2048 / 18432 x 7168):
 * float32 T = 2 0.93-0.98x, T = 5-13 0.97-1.11x, T = 17-33 1.10-1.43x; BF16 T = 2 1.7-2.0x, T = 5-33 1.02-1.2x;
 * INT4 T = 2 0.88-0.93x, T = 5-33 0.98-1.64x. The next block's weight lines are prefetched into L2 spread evenly over
 * all of this block's tile passes (kd_qpf): against none, BF16 T = 9-17 1.11-1.27x, float32 T = 5-9 1.05-1.11x, T >= 13
 * even, float32 T <= 3 0.95-0.98x (so not there); all of one line per row per step in the first pass (T0) was 0.97x. */
#define KD_QO 4    /* weight rows per panel */
#define KD_QR 3    /* x rows per register tile */
#define KD_QBF_T 4  /* BF16 widened in the register up to this many rows of x, else once per block into the buffer */
#define KD_QKC 512 /* k block (elements): 1024 and 2048 measured 0.87-0.94x at T = 5-9, 0.97-1.07x at T = 17-33 */
/* the next block's weight lines a tile pass prefetches (into L2): line l (row l >> lsh, its (l & lmask)-th 64 bytes)
 * for l in [l0, l1), spread over the pass's steps; pf NULL: none */
typedef struct {
  const char *pf;
  int64_t prs, l0, l1, lmask;
  int lsh;
} kd_qpf;

/* R rows of x (stride xs, contiguous 8-element steps) x KD_QO weight rows (stride ws elements) over nc steps of one
 * half of a k block; MODE 0: weights contiguous (the de-interleaved buffer), 1: float32 in place, 2: BF16 in place
 * (a step every 16 elements); partial lanes in P (row r, output o: 8 floats at P + r * ps + o * 16) */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_qtile_avx2(
    const int R, const int MODE, const float *x, int64_t xs, const void *w, int64_t ws, int64_t nc, float *P,
    int64_t ps, const kd_qpf *pfp) {
  const kd_qpf pf = *pfp;
  const int64_t wstep = MODE ? 16 : 8;
  __m256 acc[KD_QR][KD_QO];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int o = 0; o < KD_QO; o++) acc[r][o] = _mm256_load_ps(P + r * ps + o * 16);
  for (int64_t c = 0; c < nc; c++) {
    for (int64_t l = pf.l0 + c; l < pf.l1; l += nc)
      _mm_prefetch(pf.pf + (l >> pf.lsh) * pf.prs + ((l & pf.lmask) << 6), _MM_HINT_T1);
    __m256 wv[KD_QO];
#pragma GCC unroll 4
    for (int o = 0; o < KD_QO; o++) wv[o] = kd_wload_avx2(kd_wrow(w, o, ws, MODE == 2), wstep * c, MODE == 2);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const __m256 xv = _mm256_load_ps(x + r * xs + 8 * c);
#pragma GCC unroll 4
      for (int o = 0; o < KD_QO; o++) acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int o = 0; o < KD_QO; o++) _mm256_store_ps(P + r * ps + o * 16, acc[r][o]);
}

#define KD_QTILE(R, M)                                                                                           \
  __attribute__((target("avx2,fma"))) static void kd_qtile_##R##M(const float *x, int64_t xs, const void *w,       \
                                                                  int64_t ws, int64_t nc, float *P, int64_t ps, \
                                                                  const kd_qpf *pf) { \
    kd_qtile_avx2(R, M, x, xs, w, ws, nc, P, ps, pf);                                                               \
  }
#define KD_QTILES(R) KD_QTILE(R, 0) KD_QTILE(R, 1) KD_QTILE(R, 2)
KD_QTILES(1) KD_QTILES(2) KD_QTILES(3)
typedef void (*kd_qtile_fn)(const float *, int64_t, const void *, int64_t, int64_t, float *, int64_t, const kd_qpf *);
static const kd_qtile_fn kd_qtiles[KD_QR][3] = { /* [R - 1][MODE] */
    {kd_qtile_10, kd_qtile_11, kd_qtile_12}, {kd_qtile_20, kd_qtile_21, kd_qtile_22},
    {kd_qtile_30, kd_qtile_31, kd_qtile_32}};

/* A linear's weights as the AVX2 panels and kd_linear_512 read them: float32 rows w, or BF16 rows w16, or INT4 rows
 * (packed qp [n_out, n_words], scales qs [n_out, n_groups], wpg words per group). */
typedef struct {
  const float *w;
  const uint16_t *w16;
  const uint32_t *qp;
  kd_qs qs;
  int64_t n_words, n_groups, wpg, n_in, n_out;
  int perm; /* INT4 in the GEMV's lane order (kd_linear_512 sets it): x copied permuted, blocks dequantized so */
} kd_wsrc;

/* bytes per weight row in memory (the prefetch stream) */
static int64_t kd_wsrc_row_bytes(const kd_wsrc *s) {
  return s->w ? s->n_in * 4 : s->w16 ? s->n_in * 2 : s->n_words * 4;
}

static const char *kd_wsrc_at(const kd_wsrc *s, int64_t o, int64_t k) { /* row o from element k (k % 8 == 0) */
  return s->w ? (const char *)(s->w + o * s->n_in + k)
         : s->w16 ? (const char *)(s->w16 + o * s->n_in + k)
                  : (const char *)(s->qp + o * s->n_words + k / 8);
}

/* elements [k0, k0 + n) of row o of s, de-interleaved into d: 8-element piece j (elements k0 + 8 j ..) to
 * d + (j % 2) * half + (j / 2) * 8, half = 8 ceil(n / 16); the pieces' missing elements are +0 */
__attribute__((target("avx2,fma"))) static void kd_qsplit_row(const kd_wsrc *s, int64_t o, int64_t k0, int64_t n,
                                                              float *d) {
  const int64_t half = (n + 15) / 16 * 8, np = (n + 7) / 8;
  if (n % 16 == 0) { /* whole chunks: the hot loops */
    if (s->qp) { /* word k / 8 holds 8 elements; its group's scale counted along, no division per word */
      const uint32_t *r = s->qp + o * s->n_words;
      const kd_qs sr = kd_qs_row(s->qs, o * s->n_groups);
      int64_t wi = k0 / 8, g = wi / s->wpg, left = s->wpg - wi % s->wpg;
      for (int64_t j = 0; j < np; j++, wi++) {
        _mm256_store_ps(d + (j % 2) * half + (j / 2) * 8, kd_w8_avx2(r[wi], kd_qs_at(sr, g)));
        if (--left == 0) g++, left = s->wpg;
      }
    } else if (s->w) {
      const float *r = s->w + o * s->n_in + k0;
      for (int64_t c = 0; c < n / 16; c++)
        _mm256_store_ps(d + 8 * c, _mm256_loadu_ps(r + 16 * c)),
            _mm256_store_ps(d + half + 8 * c, _mm256_loadu_ps(r + 16 * c + 8));
    } else {
      const uint16_t *r = s->w16 + o * s->n_in + k0;
      for (int64_t c = 0; c < n / 16; c++)
        _mm256_store_ps(d + 8 * c, kd_wload_avx2(r, 16 * c, 1)),
            _mm256_store_ps(d + half + 8 * c, kd_wload_avx2(r, 16 * c + 8, 1));
    }
    return;
  }
  for (int64_t j = 0; j < np; j++) {
    float *dst = d + (j % 2) * half + (j / 2) * 8;
    const int64_t k = k0 + 8 * j, m = n - 8 * j < 8 ? n - 8 * j : 8;
    if (s->w) {
      if (m == 8) _mm256_store_ps(dst, _mm256_loadu_ps(s->w + o * s->n_in + k));
      else for (int i = 0; i < 8; i++) dst[i] = i < m ? s->w[o * s->n_in + k + i] : 0.0f;
    } else if (s->w16) {
      if (m == 8) {
        _mm256_store_ps(dst, kd_wload_avx2(s->w16 + o * s->n_in, k, 1));
      } else {
        _mm256_store_ps(dst, _mm256_setzero_ps());
        kd_bf16_widen_generic(s->w16 + o * s->n_in + k, dst, m);
      }
    } else { /* INT4: word k / 8 holds these 8 elements (k % 8 == 0) */
      const kd_qs sr = kd_qs_row(s->qs, o * s->n_groups);
      const uint32_t wd = s->qp[o * s->n_words + k / 8];
      const float sc = kd_qs_at(sr, k / 8 / s->wpg);
      if (m == 8) _mm256_store_ps(dst, kd_w8_avx2(wd, sc));
      else for (int i = 0; i < 8; i++) dst[i] = i < m ? kd_int4_weight(wd, i, sc) : 0.0f;
    }
  }
  if (np % 2) _mm256_store_ps(d + half + (np / 2) * 8, _mm256_setzero_ps()); /* an odd last piece: its hi half */
}

/* panels [p0, p1) (outputs KD_QO p ..) of out [T, n_out] for all T rows of x (the de-interleaved copy, stride ldx):
 * for each k block of a panel, every row tile of x (from L2) against the panel's block (in L1 after the first tile's
 * pass). P: T x KD_QO x 16 and wb: KD_QO x KD_QKC floats of this thread. A last partial panel repeats its last row
 * (results not written). Float32 rows of whole chunks are read in place, BF16 ones too up to KD_QBF_T rows of x;
 * INT4 blocks, BF16 of more rows, rows with a tail and a last partial panel go through wb. The next block (this
 * panel's, else the next panel's first; none past this thread's range) is prefetched over this block's tile passes,
 * 1 / (2 G) of its lines each. */
__attribute__((target("avx2,fma"))) static void kd_qpanels_avx2(const kd_wsrc *s, const float *x, int64_t ldx,
                                                                float *out, int64_t T, int64_t p0, int64_t p1,
                                                                float *P, float *wb) {
  const int64_t n_in = s->n_in, n_out = s->n_out, G = (T + KD_QR - 1) / KD_QR, ps = KD_QO * 16;
  const int64_t rbytes = kd_wsrc_row_bytes(s);
  const int want_pf = !(s->w && T <= KD_QR); /* float32, one row tile: 0.95-0.98x with it */
  for (int64_t p = p0; p < p1; p++) {
    const int64_t o0 = p * KD_QO, no = n_out - o0 < KD_QO ? n_out - o0 : KD_QO;
    const int mode = no == KD_QO && n_in % 16 == 0 ? (s->w ? 1 : s->w16 && T <= KD_QBF_T ? 2 : 0) : 0;
    memset(P, 0, sizeof(float) * (size_t)(T * ps));
    for (int64_t k0 = 0; k0 < n_in; k0 += KD_QKC) {
      const int64_t n = n_in - k0 < KD_QKC ? n_in - k0 : KD_QKC, nc = (n + 15) / 16, half = 8 * nc;
      if (!mode)
        for (int64_t i = 0; i < KD_QO; i++) kd_qsplit_row(s, o0 + (i < no ? i : no - 1), k0, n, wb + i * KD_QKC);
      const int64_t nk = k0 + KD_QKC < n_in ? k0 + KD_QKC : 0, np0 = nk ? o0 : o0 + KD_QO;
      const char *pf = want_pf && np0 + KD_QO <= p1 * KD_QO && np0 + KD_QO <= n_out ? kd_wsrc_at(s, np0, nk) : NULL;
      const int64_t nn = n_in - nk < KD_QKC ? n_in - nk : KD_QKC, lpr = (nn * rbytes / n_in + 63) / 64;
      int lsh = 0;
      while (((int64_t)1 << lsh) < lpr) lsh++;
      const int64_t L = (int64_t)KD_QO << lsh, U = 2 * G;
      for (int64_t g = 0; g < G; g++) {
        const int64_t t = g * KD_QR;
        const int R = T - t < KD_QR ? (int)(T - t) : KD_QR;
        for (int h = 0; h < 2; h++) {
          const int64_t u = 2 * g + h;
          const kd_qpf q = {pf, rbytes, L * u / U, pf ? L * (u + 1) / U : 0, ((int64_t)1 << lsh) - 1, lsh};
          const void *wk = mode ? (const void *)kd_wsrc_at(s, o0, k0 + 8 * h) : (const void *)(wb + h * half);
          kd_qtiles[R - 1][mode](x + t * ldx + k0 + h * half, ldx, wk, mode ? n_in : KD_QKC, nc, P + t * ps + 8 * h,
                                 ps, &q);
        }
      }
    }
    for (int64_t t = 0; t < T; t++)
      for (int64_t o = 0; o < no; o++) {
        const float *q = P + t * ps + o * 16;
        out[t * n_out + o0 + o] = kd_hsum_avx2(_mm256_load_ps(q), _mm256_load_ps(q + 8));
      }
  }
}

/* out [T, n_out] = x [T, n_in] . w^T for T >= 2 on AVX2 (s: the weights). x is copied once, de-interleaved block by
 * block (kd_qsplit_row's order), to 64-byte aligned rows an odd number of cache lines apart (rows 4 KB apart would
 * share L1 sets). Each thread takes a contiguous range of panels: an output is one thread's fixed-order dot either
 * way, so the bits depend neither on T nor on the number of threads. */
__attribute__((target("avx2,fma"))) static int kd_linear_q(const kd_wsrc *s, const float *x, float *out, int64_t T,
                                                           int parallel) {
  const int64_t n_in = s->n_in, n_out = s->n_out, panels = (n_out + KD_QO - 1) / KD_QO;
  const int64_t ldx = (n_in + 15) / 16 * 16 / 32 * 32 + 48;
  float *xa = (float *)aligned_alloc(64, sizeof(float) * (size_t)(T * ldx));
  if (!xa) return kd_fail(KD_ENOMEM, "kd_linear: out of memory (T=%lld, in=%lld)", (long long)T, (long long)n_in);
  const kd_wsrc xs = {x, NULL, NULL, kd_qs_none, 0, 0, 1, n_in, T, 0};
  for (int64_t t = 0; t < T; t++)
    for (int64_t k0 = 0; k0 < n_in; k0 += KD_QKC)
      kd_qsplit_row(&xs, t, k0, n_in - k0 < KD_QKC ? n_in - k0 : KD_QKC, xa + t * ldx + k0);
  int nomem = 0;
#pragma omp parallel num_threads(kd_threads()) if (parallel || kd_par_worth(T * n_in * n_out, panels))
  {
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    float *P = (float *)aligned_alloc(64, sizeof(float) * (size_t)(T * KD_QO * 16));
    float *wb = (float *)aligned_alloc(64, sizeof(float) * KD_QO * KD_QKC);
    if (P && wb) {
      kd_qpanels_avx2(s, xa, ldx, out, T, panels * me / nt, panels * (me + 1) / nt, P, wb);
    } else {
#pragma omp atomic write
      nomem = 1;
    }
    free(P);
    free(wb);
  }
  free(xa);
  return nomem ? kd_fail(KD_ENOMEM, "kd_linear: out of memory (T=%lld)", (long long)T) : KD_OK;
}

/* T >= 2 rows of long rows on AVX2: float32 w, or BF16 w16, or INT4 rows q (packed [n_out, n_words], scales
 * [n_out, n_groups], wpg words per group) */
static int kd_linear_multirow(const float *x, const float *w, const uint16_t *w16, const uint32_t *qp, kd_qs qs,
                              int64_t n_words, int64_t n_groups, int64_t wpg, float *out, int64_t T, int64_t n_in,
                              int64_t n_out, int parallel) {
  kd_wsrc src = {w, w16, qp, qs, n_words, n_groups, wpg, n_in, n_out, 0};
  return kd_linear_q(&src, x, out, T, parallel);
}

/* ---- AVX-512 linear: one forward's T rows against each loaded weight block ----------------------------------
 * One zmm register holds the 16 lanes of a dot (lane k % 16), so each output is exactly kd_dot_f32's operations: a
 * fused multiply-add per 16-element chunk in ascending k, the row's n % 16 tail through masked loads (a masked-off
 * lane adds fma(0, 0, acc) = acc), kd_hsum512 = kd_lanes_sum's pairwise tree. The weights are read in panels of
 * KD_PO output rows, k block by k block (KD_PKC elements: the panel's block stays in L1), and every row tile of x
 * (KD_PR rows) is applied to a block while it is there: the weight bytes stream from memory once per call whatever
 * T is, the tiles' multiply-adds run from L1. Between k blocks a dot's 16 partial lanes wait in P. The next block's
 * weight lines are prefetched evenly over this block's iterations, so the stream keeps going while the tiles
 * compute. BF16 weights are widened exactly (in the register, or once per block for many rows); INT4 blocks are
 * dequantized exactly (kd_int4_weight) once per block for all rows. Float32 calls of 1-4 rows and BF16 calls whose x
 * fits L2 run the same dots without k blocks (kd_rows512: whole weight rows, in passes of 4 rows of x). */
#if defined(__x86_64__) && defined(__GNUC__)
#define KD_A512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
#define KD_PO 6    /* outputs per panel: 6 weight rows x 4 x rows = 24 accumulators + 6 weight registers + 1 x */
#define KD_PR 4    /* x rows per register tile */
#define KD_PKC 512 /* k block (elements): a panel's block is 12 KB of float32 in L1 */
#define KD_PF_BYTES 8192 /* weight bytes a panel keeps in flight ahead of its tiles (kd_panel512's prefetch distance) */

__attribute__((target(KD_A512), always_inline)) static inline float kd_hsum512(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

__attribute__((target(KD_A512), always_inline)) static inline __m512 kd_bf16x16_512(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* The next block's weight lines (row r, line j at pf + r * prs + j * 64, 1 << lsh lines per row): lines
 * [l0, l0 + npf) of them, spread over this tile's nc iterations. Prefetched into L2 (_MM_HINT_T1), not L1: a T0
 * prefetch holds one of the core's few L1 miss buffers until its line arrives, which capped one thread's stream at
 * ~18 GB/s on a Zen 4 host that streams ~33 GB/s per core (BF16 2048x7168, T = 1: 17.4 -> 23.7 GB/s on one thread,
 * 28.5 -> 33-35 on two; T >= 8 unchanged: compute-bound). The line reaches L1 from L2 when the tile loads it. */
typedef struct {
  const char *pf;
  int64_t prs, l0, npf;
  int lsh;
} kd_pf512;

/* acc[r][o] over one k block: x rows r (stride xs), weight rows o (stride ws), nc whole chunks then a masked tail
 * (tail: its lanes). FIRST: the partial lanes start at +0 (else from P); LAST: their kd_hsum512 goes to out
 * (out[r * os + o], the first no outputs; else back to P [R][KD_PO][16]). */
__attribute__((target(KD_A512), always_inline)) static inline void kd_tile512(
    const int R, const int FIRST, const int LAST, const int BF, const float *x, int64_t xs, const void *w, int64_t ws,
    int64_t nc, __mmask16 tail, float *P, float *out, int64_t os, int no, const kd_pf512 *pfp) {
  const float *wf = (const float *)w;
  const uint16_t *wh = (const uint16_t *)w;
  const kd_pf512 pf = *pfp;
  __m512 acc[KD_PR][KD_PO];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 6
    for (int o = 0; o < KD_PO; o++) acc[r][o] = FIRST ? _mm512_setzero_ps() : _mm512_load_ps(P + (r * KD_PO + o) * 16);
  const int64_t lmask = ((int64_t)1 << pf.lsh) - 1;
  for (int64_t c = 0; c < nc; c++) {
    for (int64_t l = pf.l0 + c; l < pf.l0 + pf.npf; l += nc)
      _mm_prefetch(pf.pf + (l >> pf.lsh) * pf.prs + ((l & lmask) << 6), _MM_HINT_T1);
    __m512 wv[KD_PO];
#pragma GCC unroll 6
    for (int o = 0; o < KD_PO; o++)
      wv[o] = BF ? kd_bf16x16_512(_mm256_loadu_si256((const __m256i *)(wh + o * ws + 16 * c)))
                 : _mm512_loadu_ps(wf + o * ws + 16 * c);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      __m512 xv = _mm512_loadu_ps(x + r * xs + 16 * c);
#pragma GCC unroll 6
      for (int o = 0; o < KD_PO; o++) acc[r][o] = _mm512_fmadd_ps(wv[o], xv, acc[r][o]);
    }
  }
  if (tail) {
    __m512 wv[KD_PO];
#pragma GCC unroll 6
    for (int o = 0; o < KD_PO; o++)
      wv[o] = BF ? kd_bf16x16_512(_mm256_maskz_loadu_epi16(tail, wh + o * ws + 16 * nc))
                 : _mm512_maskz_loadu_ps(tail, wf + o * ws + 16 * nc);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * xs + 16 * nc);
#pragma GCC unroll 6
      for (int o = 0; o < KD_PO; o++) acc[r][o] = _mm512_fmadd_ps(wv[o], xv, acc[r][o]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 6
    for (int o = 0; o < KD_PO; o++) {
      if (!LAST)
        _mm512_store_ps(P + (r * KD_PO + o) * 16, acc[r][o]);
      else if (o < no)
        out[r * os + o] = kd_hsum512(acc[r][o]);
    }
}

#define KD_TILE512(R, F, L, B)                                                                                   \
  __attribute__((target(KD_A512))) static void kd_tile512_##R##F##L##B(                                          \
      const float *x, int64_t xs, const void *w, int64_t ws, int64_t nc, __mmask16 tail, float *P, float *out,     \
      int64_t os, int no, const kd_pf512 *pf) {                                                                  \
    kd_tile512(R, F, L, B, x, xs, w, ws, nc, tail, P, out, os, no, pf);                                          \
  }
#define KD_TILES512(R)                                                                                           \
  KD_TILE512(R, 0, 0, 0) KD_TILE512(R, 0, 1, 0) KD_TILE512(R, 1, 0, 0) KD_TILE512(R, 1, 1, 0)                    \
  KD_TILE512(R, 0, 0, 1) KD_TILE512(R, 0, 1, 1) KD_TILE512(R, 1, 0, 1) KD_TILE512(R, 1, 1, 1)
KD_TILES512(1) KD_TILES512(2) KD_TILES512(3) KD_TILES512(4)
typedef void (*kd_tile512_fn)(const float *, int64_t, const void *, int64_t, int64_t, __mmask16, float *, float *,
                              int64_t, int, const kd_pf512 *);
#define KD_TILE512_ROW(R)                                                                                         \
  {{{kd_tile512_##R##000, kd_tile512_##R##001}, {kd_tile512_##R##010, kd_tile512_##R##011}},                      \
   {{kd_tile512_##R##100, kd_tile512_##R##101}, {kd_tile512_##R##110, kd_tile512_##R##111}}}
static const kd_tile512_fn kd_tiles512[KD_PR][2][2][2] = { /* [R - 1][FIRST][LAST][BF16 read in place] */
    KD_TILE512_ROW(1), KD_TILE512_ROW(2), KD_TILE512_ROW(3), KD_TILE512_ROW(4)};

/* The AVX-512 W4A16 kernels' lane order: register lane 2m holds logical lane m, 2m + 1 logical lane 8 + m (a chunk's
 * two words broadcast as a qword). kd_x_perm512: the whole 16-element chunks of T rows of x (stride n_in) copied in
 * that order to dst (stride ld, 64-byte aligned rows). */
__attribute__((target(KD_A512))) static void kd_x_perm512(const float *x, int64_t T, int64_t n_in, float *dst,
                                                          int64_t ld) {
  const __m512i fwd = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k + 16 <= n_in; k += 16)
      _mm512_store_ps(dst + t * ld + k, _mm512_permutexvar_ps(fwd, _mm512_loadu_ps(x + t * n_in + k)));
}

/* kd_dequant_slice_avx2 in the AVX-512 GEMV's lane order (whole chunks, even wpg; kd_wsrc.perm), 16 weights per
 * step: the chunk's 8 bytes broadcast as a qword, so register lane 2m holds word 0 (element m) and lane 2m + 1 word 1
 * (element 8 + m), one shift, and vpermps looks the nibble up in the group's table (q - 8) * scale -- the same floats
 * as kd_int4_weight, three vector ops per 16 weights where the 8-wide path takes ~20. One division per slice (one per
 * group sat on the loop's critical path). The rows of x are copied in the same order, so every register lane still
 * multiplies matching elements, and the sums are un-permuted before the horizontal sum (kd_panel512): each logical
 * lane adds the same products in the same order, the same bits. 2048 x 7168, 2 threads, T = 8: 2.19 -> 1.67 ms with
 * the prefetch distance below (T <= 8 now take kd_linear_w4_small512). */
__attribute__((target(KD_A512))) static void kd_dequant_perm_512(const uint32_t *wr, kd_qs sr, float *w, int64_t k0,
                                                                 int64_t k1, int64_t wpg) {
  const __m512i sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512 ramp = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t cpg = wpg / 2, c1 = k1 / 16;
  int64_t c = k0 / 16, g = c / cpg, ce = (g + 1) * cpg;
  for (; c < c1; g++, ce += cpg) {
    const __m512 tab = _mm512_mul_ps(ramp, _mm512_set1_ps(kd_qs_at(sr, g)));
    for (const int64_t e = ce < c1 ? ce : c1; c < e; c++) {
      int64_t q;
      memcpy(&q, wr + 2 * c, 8);
      _mm512_storeu_ps(w + 16 * c - k0, _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(q), sh), tab));
    }
  }
}

/* The row tiles of a call of T rows: full 4-row tiles, the rest last (9 = 4 + 4 + 1; a 4-row tile does 24
 * multiply-adds per 10 loads, and 3 x 3 measured 1.15-1.2x slower than 4 + 4 + 1 at T = 9), and the share of the next
 * block's prefetch lines each one issues: computed once per call, read by every panel and block. */
typedef struct {
  int R;
  int64_t t, l0, npf;
} kd_rowtile;

/* Outputs o0 .. o0 + no - 1 (no <= KD_PO) of out [T, n_out] for all T rows of x (stride ldx). Past the last output
 * the panel repeats it (its results are not written). wb: this thread's KD_PO x KD_PKC block, P: T x KD_PO x 16;
 * rt: the G row tiles; lsh: log2 of the prefetch lines per weight row of a block; o_end: this thread's last panel. */
__attribute__((target(KD_A512))) static void kd_panel512(const kd_wsrc *s, const float *x, int64_t ldx, float *out,
                                                         int64_t o0, int64_t o_end, const kd_rowtile *rt, int64_t G,
                                                         int lsh, float *P, float *wb) {
  const int64_t n_in = s->n_in, n_out = s->n_out;
  const int no = n_out - o0 < KD_PO ? (int)(n_out - o0) : KD_PO;
  int64_t rows[KD_PO];
  for (int i = 0; i < KD_PO; i++) rows[i] = o0 + (i < no ? i : no - 1);
  /* float32 and BF16 rows are read where they are, at stride n_in, BF16 widened in the register by every tile that
   * reads it (two vector ops per 16 weights beside the multiply-adds). Widening a block once into wb
   * and reading it back measured 1.1-1.2x slower at T = 5-9, and on a Zen 4 host 1.06-1.38x slower at T = 17-33
   * too (2048 x 7168, 2 threads, alternating; an earlier host had measured it ~10 % faster there, with weights
   * 16 bytes off their cache lines). INT4 blocks and a last partial panel go through wb. */
  const int in_place = (s->w || s->w16) && no == KD_PO, bf = in_place && !s->w;
  /* prefetch distance: enough blocks to keep ~KD_PF_BYTES of weights in flight (one DRAM latency at a core's stream
   * rate); at least the next block. A float32 panel block is 12 KB, BF16 6 KB, INT4 1.9 KB (with its scales): at
   * small T an INT4 block's tiles take less than a memory latency, and one block ahead left each block waiting */
  const int64_t nblk = (n_in + KD_PKC - 1) / KD_PKC;
  const int64_t pbb = KD_PO * ((n_in < KD_PKC ? n_in : KD_PKC) * kd_wsrc_row_bytes(s) / n_in);
  const int64_t ahead = pbb > 0 && KD_PF_BYTES / pbb > 1 ? KD_PF_BYTES / pbb : 1;
  for (int64_t k0 = 0; k0 < n_in; k0 += KD_PKC) {
    const int64_t n = n_in - k0 < KD_PKC ? n_in - k0 : KD_PKC, nc = n / 16;
    const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
    const void *wk = wb;
    int64_t ws = KD_PKC;
    if (in_place) {
      wk = bf ? (const void *)(s->w16 + o0 * n_in + k0) : (const void *)(s->w + o0 * n_in + k0), ws = n_in;
    } else {
      for (int i = 0; i < KD_PO; i++) {
        float *d = wb + i * KD_PKC;
        if (s->w) {
          memcpy(d, s->w + rows[i] * n_in + k0, sizeof(float) * (size_t)n);
        } else if (s->w16) {
          const uint16_t *r = s->w16 + rows[i] * n_in + k0;
          int64_t j = 0;
          for (; j + 16 <= n; j += 16) _mm512_store_ps(d + j, kd_bf16x16_512(_mm256_loadu_si256((const __m256i *)(r + j))));
          kd_bf16_widen_generic(r + j, d + j, n - j);
        } else {
          (s->perm ? kd_dequant_perm_512 : kd_dequant_slice_avx2)(s->qp + rows[i] * s->n_words,
                                                                  kd_qs_row(s->qs, rows[i] * s->n_groups), d, k0,
                                                                  k0 + n, s->wpg);
        }
      }
    }
    /* the block `ahead` blocks on (in this panel, else the next panels'; none past this thread's range): its weight
     * lines are prefetched over this block's tiles, its INT4 group scales now */
    int64_t bk = k0 / KD_PKC + ahead, np = o0;
    np += bk / nblk * KD_PO, bk %= nblk;
    const char *pf = np < o_end ? kd_wsrc_at(s, np, bk * KD_PKC) : NULL;
    if (pf && s->qp) {
      const int64_t g = bk * KD_PKC / (8 * s->wpg), last = (n_out < o_end ? n_out : o_end) - 1;
      for (int i = 0; i < KD_PO; i++) {
        const kd_qs q = kd_qs_row(s->qs, (np + i < last ? np + i : last) * s->n_groups + g);
        _mm_prefetch(q.f ? (const char *)q.f : (const char *)q.h, _MM_HINT_T0);
      }
    }
    const int F = k0 == 0, L = k0 + n == n_in && !s->perm; /* perm: the sums leave through P, below */
    for (int64_t g = 0; g < G; g++) {
      kd_pf512 pg = {pf, kd_wsrc_row_bytes(s), rt[g].l0, pf ? rt[g].npf : 0, lsh};
      kd_tiles512[rt[g].R - 1][F][L][bf](x + rt[g].t * ldx + k0, ldx, wk, ws, nc, tail, P + rt[g].t * KD_PO * 16,
                                     out + rt[g].t * n_out + o0, n_out, no, &pg);
    }
  }
  if (s->perm) { /* register lane j held logical lane (j even: j / 2, odd: 8 + j / 2): back in order, then summed */
    const __m512i inv = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const int64_t T = rt[G - 1].t + rt[G - 1].R;
    for (int64_t t = 0; t < T; t++)
      for (int o = 0; o < no; o++)
        out[t * n_out + o0 + o] = kd_hsum512(_mm512_permutexvar_ps(inv, _mm512_load_ps(P + (t * KD_PO + o) * 16)));
  }
}

/* Up to KD_PR rows of x (T = 1: a decode step; 2-4: a small batch, the verify rows routed to one expert), float32 or
 * BF16 weight rows read in place, whole 16-element chunks: panels of KD_PO weight rows, each (row of x, weight row)
 * pair's 16 lanes accumulated over the whole row in registers (the tile path's FMA sequence, its partial lanes parked
 * in P between k blocks: the same bits), then kd_hsum512. Each weight row is prefetched KD_ROWS_PF bytes ahead of its
 * reads, past its end into the same row of the next panel. Its own loop because such a call is bound by how many
 * lines one core keeps in flight, and the block tiles' extra instructions per chunk (the block-spread prefetch, the
 * block calls) took from that window: one thread, 2048 x 7168 float32, T = 1, the same call in a C harness streamed
 * 26.7 GB/s through the tiles and 30.6 in this form (`kd_roof_read`: 33-35). Panels [o0, o1), all full; x rows at
 * stride ldx. */
#define KD_ROWS_PF 2048
/* BF16: x bytes (T x n_in floats) up to which kd_rows512 also runs more than one row tile, one panel at a time in
 * passes of KD_PR rows (the panel's rows then come from L2, x's whole rows from L2 or L3): 1.09-1.19x the block
 * tiles for T = 5-33 (2048 x 7168 and 7168 x 2048, 2 threads, alternating). With x past L2 too (was 1 MB, one Zen 4
 * core's L2; the host's L3 32 MB): 1.08-1.18x at 1.1-7.4 MB of x (7168 x 18432 T = 17-100, 18432 x 7168 T = 40-200,
 * 7168 x 2048 T = 130-250; a k26_mini forward of 64 rows 1.11x, tiny_wide bf16 33 rows 1.06x, logits equal). Float32
 * rows lose that way (0.86-0.97x at T = 5-24) and keep the tiles beyond one row tile. */
#define KD_ROWS_X_MAX (1 << 23)
__attribute__((target(KD_A512), always_inline)) static inline void kd_rows512(const int R, const int BF,
                                                                             const kd_wsrc *s, const float *x,
                                                                             int64_t ldx, float *out, int64_t o0,
                                                                             int64_t o1, int64_t o_pf) {
  const int64_t n_in = s->n_in, n_out = s->n_out, nc = n_in / 16, rb = kd_wsrc_row_bytes(s), cb = BF ? 32 : 64;
  const int64_t step = BF ? 2 : 1; /* chunks per 64-byte line */
  for (int64_t o = o0; o < o1; o += KD_PO) {
    const char *w = BF ? (const char *)(s->w16 + o * n_in) : (const char *)(s->w + o * n_in);
    const char *nx = o + KD_PO < o_pf ? w + KD_PO * rb : NULL; /* the next panel's rows (none past o_pf) */
    __m512 acc[KD_PR][KD_PO];
#pragma GCC unroll 4
    for (int t = 0; t < R; t++)
#pragma GCC unroll 6
      for (int r = 0; r < KD_PO; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
      const int64_t at = c * cb + KD_ROWS_PF;
      if (o_pf > o && c % step == 0 && (at < rb || nx)) {
        const char *pf = at < rb ? w + at : nx + (at - rb);
#pragma GCC unroll 6
        for (int r = 0; r < KD_PO; r++) _mm_prefetch(pf + r * rb, _MM_HINT_T1);
      }
      __m512 wv[KD_PO];
#pragma GCC unroll 6
      for (int r = 0; r < KD_PO; r++) {
        const char *wr = w + r * rb + c * cb;
        wv[r] = BF ? kd_bf16x16_512(_mm256_loadu_si256((const __m256i *)wr)) : _mm512_loadu_ps((const float *)wr);
      }
#pragma GCC unroll 4
      for (int t = 0; t < R; t++) {
        const __m512 xv = _mm512_loadu_ps(x + t * ldx + 16 * c);
#pragma GCC unroll 6
        for (int r = 0; r < KD_PO; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; t++)
#pragma GCC unroll 6
      for (int r = 0; r < KD_PO; r++) out[t * n_out + o + r] = kd_hsum512(acc[t][r]);
  }
}
#define KD_ROWS512(R)                                                                                             \
  __attribute__((target(KD_A512))) static void kd_rows512_f32_##R(const kd_wsrc *s, const float *x, int64_t ldx,   \
                                                                 float *out, int64_t o0, int64_t o1, int64_t pf) { \
    kd_rows512(R, 0, s, x, ldx, out, o0, o1, pf);                                                                 \
  }                                                                                                               \
  __attribute__((target(KD_A512))) static void kd_rows512_bf16_##R(const kd_wsrc *s, const float *x, int64_t ldx,  \
                                                                  float *out, int64_t o0, int64_t o1, int64_t pf) {\
    kd_rows512(R, 1, s, x, ldx, out, o0, o1, pf);                                                                 \
  }
KD_ROWS512(1) KD_ROWS512(2) KD_ROWS512(3) KD_ROWS512(4)
typedef void (*kd_rows512_fn)(const kd_wsrc *, const float *, int64_t, float *, int64_t, int64_t, int64_t);
static const kd_rows512_fn kd_rows512_fns[2][KD_PR] = {
    {kd_rows512_f32_1, kd_rows512_f32_2, kd_rows512_f32_3, kd_rows512_f32_4},
    {kd_rows512_bf16_1, kd_rows512_bf16_2, kd_rows512_bf16_3, kd_rows512_bf16_4}};

/* BF16, one or two rows of x (R): two panels (KD_RW = 2 x KD_PO weight rows) per pass, one 64-byte line of each weight
 * row per step (a 512-bit load widened in its two halves: chunks c and c + 1), each row prefetched KD_ROWS_PF bytes
 * ahead (past its end into the next pass's row). Each row's lanes take the same multiply-adds in the same order as
 * kd_rows512 (the same bits). Why: a BF16 line carries two chunks, so each accumulator's chain per line is twice a
 * float32 line's, and with six rows in flight one thread streamed 22-24 GB/s where float32 rows stream 29-31; twelve
 * rows and whole-line loads streamed 26.5-28.7 (C harness, 18432 x 7168, one thread; a plain read 26-30). In the
 * library, one thread, alternating with six-row panels: T = 1 1.05-1.34x and T = 2 1.2-1.25x at n_in 512-18432,
 * except rows of exactly 4 KB (n_in 2048: 0.98x; padding the rows off 4 KB changed nothing in the harness, so not
 * their L1 sets: they keep six-row panels); T = 3-4 in six-row whole-line passes gained nothing (twelve rows would not
 * fit the registers). One row with n_in <= KD_ROW1_MAX takes kd_row1_bf16 instead (faster still). Rows [o0, o1):
 * whole passes (o1 - o0 a multiple of KD_RW, n_in % 16 == 0); o_pf as in kd_rows512. */
#define KD_RW (2 * KD_PO)
__attribute__((target(KD_A512), always_inline)) static inline void kd_rowsw512(const int R, const kd_wsrc *s,
                                                                              const float *x, int64_t ldx, float *out,
                                                                              int64_t o0, int64_t o1, int64_t o_pf) {
  enum { W = KD_RW };
  const int64_t n_in = s->n_in, n_out = s->n_out, nc = n_in / 16, rb = n_in * 2;
  for (int64_t o = o0; o < o1; o += W) {
    const char *w = (const char *)(s->w16 + o * n_in);
    const char *nx = o + W < o_pf ? w + W * rb : NULL; /* the next pass's rows (none past o_pf) */
    __m512 acc[2][W];
#pragma GCC unroll 2
    for (int t = 0; t < R; t++)
#pragma GCC unroll 12
      for (int r = 0; r < W; r++) acc[t][r] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= nc; c += 2) {
      const int64_t at = c * 32 + KD_ROWS_PF;
      if (at < rb || nx) {
        const char *pf = at < rb ? w + at : nx + (at - rb);
#pragma GCC unroll 12
        for (int r = 0; r < W; r++) _mm_prefetch(pf + r * rb, _MM_HINT_T1);
      }
#pragma GCC unroll 12
      for (int r = 0; r < W; r++) {
        const __m512i v = _mm512_loadu_si512((const void *)(w + r * rb + c * 32));
        const __m512 lo = kd_bf16x16_512(_mm512_castsi512_si256(v));
        const __m512 hi = kd_bf16x16_512(_mm512_extracti64x4_epi64(v, 1));
#pragma GCC unroll 2
        for (int t = 0; t < R; t++) {
          acc[t][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + t * ldx + 16 * c), acc[t][r]);
          acc[t][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + t * ldx + 16 * c + 16), acc[t][r]);
        }
      }
    }
    if (c < nc) { /* an odd last chunk */
#pragma GCC unroll 12
      for (int r = 0; r < W; r++) {
        const __m512 lo = kd_bf16x16_512(_mm256_loadu_si256((const __m256i *)(w + r * rb + c * 32)));
#pragma GCC unroll 2
        for (int t = 0; t < R; t++) acc[t][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + t * ldx + 16 * c), acc[t][r]);
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < R; t++)
#pragma GCC unroll 12
      for (int r = 0; r < W; r++) out[t * n_out + o + r] = kd_hsum512(acc[t][r]);
  }
}
#define KD_ROWSW512(R)                                                                                            \
  __attribute__((target(KD_A512))) static void kd_rowsw512_##R(const kd_wsrc *s, const float *x, int64_t ldx,     \
                                                               float *out, int64_t o0, int64_t o1, int64_t pf) {   \
    kd_rowsw512(R, s, x, ldx, out, o0, o1, pf);                                                                   \
  }
KD_ROWSW512(1) KD_ROWSW512(2)

/* Float32, 5-9 rows of x (R; not 8): three weight rows per pass, each (row of x, weight row) pair's 16 lanes over the
 * whole row in registers (R x 3 accumulators: 27 at R = 9), x's rows read from L2, each weight row prefetched
 * KD_ROWS_PF bytes ahead (past its end into the next pass's row). The same FMA sequence per lane as the tiles (the same
 * bits). Against the k-blocked tiles (4 + 1 .. 4 + 4 + 1 row tiles), alternating in one process: 2048 x 7168, 18432 x
 * 7168 and 7168 x 2048, 2 threads, T = 5 1.12-1.25x, T = 6-7 1.04-1.13x, T = 9 1.13-1.19x (one thread 1.02x); T = 8
 * 1.05-1.07x with the memory slow but 0.82-0.89x fast and 0.89x on one thread, so 8 rows (4 + 4, the tiles' best
 * case) keep the tiles. Whole tiny_wide fp32 forwards (two engines, same weights, logits equal): T = 9 1.02-1.11x,
 * T = 17 1.04x (experts of 5-7 rows), 1 thread T = 9 1.045x, T = 17 1.035x. Rows [o0, o1): whole passes.
 * A near-copy of kd_rows512 on purpose: kd_rows512 with a weight-rows parameter (and its o_pf > o test, which the
 * BF16 passes need) ran T = 9 at 0.93-0.96x of this loop (2048 x 7168 and 7168 x 2048, 2 threads, alternating), and
 * only the form without that test kept pace. */
__attribute__((target(KD_A512), always_inline)) static inline void kd_rows3w512(const int R, const kd_wsrc *s,
                                                                             const float *x, int64_t ldx, float *out,
                                                                             int64_t o0, int64_t o1, int64_t o_pf) {
  enum { W = 3 };
  const int64_t n_in = s->n_in, n_out = s->n_out, nc = n_in / 16, rb = n_in * 4;
  for (int64_t o = o0; o < o1; o += W) {
    const char *w = (const char *)(s->w + o * n_in);
    const char *nx = o + W < o_pf ? w + W * rb : NULL;
    __m512 acc[9][W];
#pragma GCC unroll 9
    for (int t = 0; t < R; t++)
#pragma GCC unroll 3
      for (int r = 0; r < W; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
      const int64_t at = c * 64 + KD_ROWS_PF;
      if (at < rb || nx) {
        const char *pf = at < rb ? w + at : nx + (at - rb);
#pragma GCC unroll 3
        for (int r = 0; r < W; r++) _mm_prefetch(pf + r * rb, _MM_HINT_T1);
      }
      __m512 wv[W];
#pragma GCC unroll 3
      for (int r = 0; r < W; r++) wv[r] = _mm512_loadu_ps((const float *)(w + r * rb + c * 64));
#pragma GCC unroll 9
      for (int t = 0; t < R; t++) {
        const __m512 xv = _mm512_loadu_ps(x + t * ldx + 16 * c);
#pragma GCC unroll 3
        for (int r = 0; r < W; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
      }
    }
#pragma GCC unroll 9
    for (int t = 0; t < R; t++)
#pragma GCC unroll 3
      for (int r = 0; r < W; r++) out[t * n_out + o + r] = kd_hsum512(acc[t][r]);
  }
}
#define KD_ROWS3W512(R)                                                                                              \
  __attribute__((target(KD_A512))) static void kd_rows3w512_##R(const kd_wsrc *s, const float *x, int64_t ldx,       \
                                                              float *out, int64_t o0, int64_t o1, int64_t pf) {     \
    kd_rows3w512(R, s, x, ldx, out, o0, o1, pf);                                                                    \
  }
KD_ROWS3W512(5) KD_ROWS3W512(6) KD_ROWS3W512(7) KD_ROWS3W512(9)
static const kd_rows512_fn kd_rows3w512_fns[5] = {kd_rows3w512_5, kd_rows3w512_6, kd_rows3w512_7, NULL, kd_rows3w512_9};
#define KD_ROWS3W_T(T) ((T) >= 5 && (T) <= 9 && (T) != 8)

/* BF16, one row of x whose x fits half of L1 (n_in <= KD_ROW1_MAX): one weight row at a time, a 64-byte line per
 * step (a 512-bit load widened in its two halves), the stream prefetched KD_ROW1_PF bytes ahead in address order (the
 * rows are contiguous). Same FMA order per lane as kd_rows512 (the same bits). One accumulator chain (two dependent
 * multiply-adds per line) keeps up with one core's stream only while x's lines stay in L1: one thread, alternating
 * with the twelve-row passes / six-row panels, n_in 512-4096 1.03-1.40x (2048, 4 KB rows, 1.24-1.28x; 1024 1.37-1.40x)
 * but 6144-18432 0.42-0.52x (x's lines evicted by the stream: every x load from L2 on the chain). Rows [o0, o1). */
#define KD_ROW1_PF 512
#define KD_ROW1_MAX 4096
__attribute__((target(KD_A512))) static void kd_row1_bf16(const kd_wsrc *s, const float *x, float *out, int64_t o0,
                                                          int64_t o1) {
  const int64_t n_in = s->n_in, nc = n_in / 16;
  for (int64_t o = o0; o < o1; o++) {
    const char *w = (const char *)(s->w16 + o * n_in);
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= nc; c += 2) {
      _mm_prefetch(w + c * 32 + KD_ROW1_PF, _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512((const void *)(w + c * 32));
      acc = _mm512_fmadd_ps(kd_bf16x16_512(_mm512_castsi512_si256(v)), _mm512_loadu_ps(x + 16 * c), acc);
      acc = _mm512_fmadd_ps(kd_bf16x16_512(_mm512_extracti64x4_epi64(v, 1)), _mm512_loadu_ps(x + 16 * c + 16), acc);
    }
    if (c < nc) /* an odd last chunk */
      acc = _mm512_fmadd_ps(kd_bf16x16_512(_mm256_loadu_si256((const __m256i *)(w + c * 32))), _mm512_loadu_ps(x + 16 * c),
                            acc);
    out[o] = kd_hsum512(acc);
  }
}

/* out [T, n_out] = x [T, n_in] . w^T for every T >= 1 (s: the weights). Long rows (more than one k block: K2-sized
 * matrices) copy x once to 64-byte aligned rows an odd number of cache lines apart (rows 4 KB apart would share L1
 * sets); short rows are read in place. Large calls give each thread a contiguous range of panels: an output is one
 * thread's fixed-order dot either way, so the bits depend neither on T nor on the number of threads. */
/* panels [p0, p1) of kd_linear_512 on this thread: its own P (k-blocked rows) and weight block; 1 = out of memory */
__attribute__((target(KD_A512))) static int kd_panels512(const kd_wsrc *s, const float *x, int64_t ldx, float *out,
                                                         int64_t T, int64_t p0, int64_t p1, const kd_rowtile *rt,
                                                         int64_t G, int lsh) {
  float wb[KD_PO * KD_PKC] __attribute__((aligned(64)));
  float *P = NULL;
  if ((s->n_in > KD_PKC || s->perm) && !(P = (float *)aligned_alloc(64, sizeof(float) * (size_t)(T * KD_PO * 16))))
    return 1;
  int64_t p = p0;
  if (s->w16 && T == 1 && s->n_in % 16 == 0 && s->n_in <= KD_ROW1_MAX) { /* BF16, one row, short rows */
    kd_row1_bf16(s, x, out, p0 * KD_PO, p1 * KD_PO < s->n_out ? p1 * KD_PO : s->n_out);
    p = p1;
  }
  /* float32 rows for one row tile (kd_rows512) or 5-9 rows but 8 (kd_rows3w512), BF16 rows while x fits L2 (whole
   * chunks): over the full panels */
  if (p < p1 && s->n_in % 16 == 0 &&
      ((s->w && (T <= KD_PR || KD_ROWS3W_T(T))) ||
       (s->w16 && T * s->n_in * (int64_t)sizeof(float) <= KD_ROWS_X_MAX))) {
    const kd_rows512_fn *fn = kd_rows512_fns[s->w ? 0 : 1];
    const int64_t full = p1 * KD_PO <= s->n_out ? p1 : p1 - 1, end = full * KD_PO; /* a last partial panel: below */
    /* BF16, 1 (long rows) or 2 rows: KD_RW weight rows per pass (an odd last panel below) */
    const int64_t q = s->w16 && T <= 2 && s->n_in != 2048 && full > p0 ? p0 + (full - p0) / 2 * 2 : p0;
    if (q > p0) (T == 1 ? kd_rowsw512_1 : kd_rowsw512_2)(s, x, ldx, out, p0 * KD_PO, q * KD_PO, end);
    if (full > q && s->w && T > KD_PR) {
      kd_rows3w512_fns[T - 5](s, x, ldx, out, q * KD_PO, end, end);
    } else if (full > q && T <= KD_PR) {
      fn[T - 1](s, x, ldx, out, q * KD_PO, end, end);
    } else if (full > q) { /* a panel at a time, 4 rows of x per pass: the first pass streams it, the rest from L2 */
      for (int64_t o = q * KD_PO; o < end; o += KD_PO)
        for (int64_t t0 = 0; t0 < T; t0 += KD_PR)
          fn[(T - t0 < KD_PR ? T - t0 : KD_PR) - 1](s, x + t0 * ldx, ldx, out + t0 * s->n_out, o, o + KD_PO,
                                                    t0 == 0 ? end : 0);
    }
    p = full > p0 ? full : p0;
  }
  for (; p < p1; p++) kd_panel512(s, x, ldx, out, p * KD_PO, p1 * KD_PO, rt, G, lsh, P, wb);
  free(P);
  return 0;
}

__attribute__((target(KD_A512))) static int kd_linear_512(const kd_wsrc *src, const float *x, float *out, int64_t T,
                                                          int parallel) {
  kd_wsrc sp = *src;
  const kd_wsrc *s = &sp;
  const int64_t n_in = s->n_in, n_out = s->n_out, panels = (n_out + KD_PO - 1) / KD_PO;
  /* INT4 of whole chunks per group (K2's group 32) and whole chunks per row: blocks dequantized in the GEMV's lane
   * order (kd_dequant_perm_512), x copied in it */
  sp.perm = s->qp && s->wpg % 2 == 0 && n_in % 16 == 0;
  int64_t ldx = n_in;
  float *xa = NULL;
  if (n_in > KD_PKC || s->perm) {
    ldx = (n_in + 15) / 16 * 16 + 16;
    xa = (float *)aligned_alloc(64, sizeof(float) * (size_t)(T * ldx));
    if (!xa) return kd_fail(KD_ENOMEM, "kd_linear: out of memory (T=%lld, in=%lld)", (long long)T, (long long)n_in);
    if (s->perm) {
      kd_x_perm512(x, T, n_in, xa, ldx);
    } else {
      for (int64_t t = 0; t < T; t++) memcpy(xa + t * ldx, x + t * n_in, sizeof(float) * (size_t)n_in);
    }
  }
  const float *xr = xa ? xa : x;
  /* prefetch: the next block's KD_PO rows of 2^lsh lines each (a row's block bytes, rounded up), split over tiles */
  int lsh = 0;
  const int64_t block_lines = ((n_in < KD_PKC ? n_in : KD_PKC) * kd_wsrc_row_bytes(s) / n_in + 63) / 64;
  while (((int64_t)1 << lsh) < block_lines) lsh++;
  const int64_t G = (T + KD_PR - 1) / KD_PR, lines = (int64_t)KD_PO << lsh;
  kd_rowtile rts[64], *rt = G <= 64 ? rts : (kd_rowtile *)malloc(sizeof(kd_rowtile) * (size_t)G);
  if (!rt) {
    free(xa);
    return kd_fail(KD_ENOMEM, "kd_linear: out of memory (T=%lld)", (long long)T);
  }
  for (int64_t g = 0, t = 0; g < G; g++) {
    rt[g].R = (int)(T - t < KD_PR ? T - t : KD_PR), rt[g].t = t;
    rt[g].l0 = lines * g / G, rt[g].npf = lines * (g + 1) / G - rt[g].l0;
    t += rt[g].R;
  }
  int nomem = 0;
  /* threads: K2-sized matrices always; smaller ones for multi-row calls worth a region (a one-row call of a small
   * matrix enters no OpenMP region at all: even an if(0) region costs a GOMP_parallel call) */
  if (parallel || (T >= 2 && kd_par_worth(T * n_in * n_out, panels))) {
#pragma omp parallel num_threads(kd_threads())
    {
      int nt = omp_get_num_threads(), me = omp_get_thread_num();
      if (kd_panels512(s, xr, ldx, out, T, panels * me / nt, panels * (me + 1) / nt, rt, G, lsh)) { /* contiguous */
#pragma omp atomic write
        nomem = 1;
      }
    }
  } else {
    nomem = kd_panels512(s, xr, ldx, out, T, 0, panels, rt, G, lsh);
  }
  if (rt != rts) free(rt);
  free(xa);
  return nomem ? kd_fail(KD_ENOMEM, "kd_linear: out of memory (T=%lld)", (long long)T) : KD_OK;
}
#endif

/* The fused W4A16 kernel on AVX2, for R = 1..KD_W4_PASS_T rows of x per pass: each 16-weight chunk of a weight row
 * is formed once in registers and multiplied into all R rows of x, so a small verify's or batch's rows (a K2 expert
 * gets 1-3 of a tree's rows) stream the INT4 bytes once, without the panel path's dequantize-to-L1 round trip, with
 * which 2 rows cost 3.4 one-row calls (2048 x 7168, 2 threads: 1.82 vs 0.53 ms; this kernel 0.84 ms;
 * native/bench_ab.py, docs/measurements.md, 14th session). W weight rows per pass: the GEMV (R = 1) takes 2 (one x
 * load for both; 4 rows with the scales held in registers spilled an accumulator, and out of cache 2 rows -- 4
 * accumulators + each row's scale and -8 * scale broadcasts -- ran 5-10 % faster than 3); R >= 2 rows of x take 1
 * (2 R accumulators + the row's scale pair and its two weight registers: 14 of 16 at R = 4, 16 at R = 5). Per
 * chunk 2 fused multiply-adds form the 16 weights and 2 R multiply them into the rows; cache-hot it runs at about
 * half that count's rate, held by the per-lane accumulator chains at R = 1-3 (one 4-cycle multiply-add per chunk, in
 * the order the bits fix: one pass of 5 rows ran 1.29x passes of 3 + 2) and by x read from L2 where x leaves L1 (the
 * k-blocked form below). */
#define KD_W4_ROWS 2   /* weight rows per pass of the GEMV */
#define KD_W4_PASS_T 5 /* rows of x per pass of the fused kernel (one weight row each) */
#define KD_W4_GW 64    /* groups per window of the staged -8 * scales: W x 64 floats of stack */

/* the fused kernels' multiply-adds: chunk c's weights of row r (we: the even elements, wo: the odd ones) into the
 * accumulators of R rows of x (xe / xo: the one row's chunk, already loaded when R == 1; else read from xp, stride
 * ldp) */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_fused_fma_avx2(
    const int R, int r, int64_t c, __m256 we, __m256 wo, __m256 xe, __m256 xo, const float *xp, int64_t ldp,
    __m256 *ev, __m256 *od) {
#pragma GCC unroll 8
  for (int t = 0; t < R; t++) {
    ev[r * R + t] = _mm256_fmadd_ps(we, R == 1 ? xe : _mm256_load_ps(xp + t * ldp + 16 * c), ev[r * R + t]);
    od[r * R + t] = _mm256_fmadd_ps(wo, R == 1 ? xo : _mm256_load_ps(xp + t * ldp + 16 * c + 8), od[r * R + t]);
  }
}

/* the 16 lanes of a fused kernel's dot in logical order: register lane i of ev is logical lane 2i, of od 2i + 1 */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_fused_lanes_avx2(__m256 ev, __m256 od,
                                                                                          float *b) {
  float a[KD_LANES];
  _mm256_storeu_ps(a, _mm256_unpacklo_ps(ev, od)); /* lanes 0,1,2,3 | 8,9,10,11 */
  _mm256_storeu_ps(a + 8, _mm256_unpackhi_ps(ev, od)); /* lanes 4,5,6,7 | 12,13,14,15 */
  static const int at[KD_LANES] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  for (int i = 0; i < KD_LANES; i++) b[i] = a[at[i]];
}

/* chunks [c0, c1) of W weight rows x R rows of x (xp: permuted rows, stride ldp), all in one group: row r's weight
 * (q - 8) * s formed as fma(q, sc[r], ns[r]) with ns = -8 s: the fused product-sum is exact before its one rounding,
 * and q s - 8 s = (q - 8) s (-8 s is exact, a power-of-two scaling), so the bits are kd_int4_weight's (finite
 * scales). The products with x are a second fused multiply-add into the lane (accumulator r * R + t), as
 * kd_dot_f32. The next rows' words are prefetched, pfs bytes per chunk (whole rows: 32, >= the 8 bytes a chunk reads
 * per row; k blocks: 8, the same chunk of a later row). */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_w4_chunks_avx2(
    const int W, const int R, const uint32_t *const *wr, const float *xp, int64_t ldp, const char *next, int64_t pfs,
    int64_t c0, int64_t c1, const __m256 *sc, const __m256 *ns, __m256 *ev, __m256 *od) {
  const __m256i m15 = _mm256_set1_epi32(15);
#pragma GCC unroll 1 /* unrolled, gcc interleaves two chunks and spills their weights */
  for (int64_t c = c0; c < c1; c++) {
    /* one row of x: its chunk loaded once for the W weight rows; more rows: read by the multiply-adds */
    const __m256 xe = R == 1 ? _mm256_load_ps(xp + 16 * c) : _mm256_setzero_ps();
    const __m256 xo = R == 1 ? _mm256_load_ps(xp + 16 * c + 8) : _mm256_setzero_ps();
    _mm_prefetch(next + pfs * c, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int r = 0; r < W; r++) {
      __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wr[r] + 2 * c)));
      __m256 we = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, m15)), sc[r], ns[r]);
      __m256 wo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), sc[r], ns[r]);
      kd_fused_fma_avx2(R, r, c, we, wo, xe, xo, xp, ldp, ev, od);
    }
  }
}

/* even wpg: a group is cpg = wpg / 2 whole chunks. The scale and -8 * scale of each group are broadcast once per
 * group from memory: both are staged KD_W4_GW groups at a time (the scale widened from BF16 where it is held so),
 * so that the first chunk of a group waits on two loads, not a load and a multiply (the group-32 case has only two
 * chunks per group). */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_w4_groups_avx2(
    const int W, const int R, const uint32_t *const *wr, const kd_qs *sr, const float *xp, int64_t ldp,
    const char *next, int64_t pfs, int64_t c_lo, int64_t nc, int64_t cpg, __m256 *ev, __m256 *od) {
  float scb[KD_W4_ROWS][KD_W4_GW] __attribute__((aligned(32))), nsb[KD_W4_ROWS][KD_W4_GW] __attribute__((aligned(32)));
  const int64_t ng = (nc + cpg - 1) / cpg; /* chunks [c_lo, nc), c_lo a multiple of cpg */
  for (int64_t g0 = c_lo / cpg; g0 < ng; g0 += KD_W4_GW) {
    int64_t gn = ng - g0 < KD_W4_GW ? ng - g0 : KD_W4_GW;
    for (int r = 0; r < W; r++)
      for (int64_t g = 0; g < gn; g++) scb[r][g] = kd_qs_at(sr[r], g0 + g), nsb[r][g] = -8.0f * scb[r][g];
    for (int64_t g = 0; g < gn; g++) {
      __m256 sc[KD_W4_ROWS], ns[KD_W4_ROWS];
#pragma GCC unroll 8
      for (int r = 0; r < W; r++)
        sc[r] = _mm256_broadcast_ss(&scb[r][g]), ns[r] = _mm256_broadcast_ss(&nsb[r][g]);
      int64_t c0 = (g0 + g) * cpg;
      if (c0 + cpg <= nc) /* a whole group: a constant trip count (unrolled for cpg = 2) */
        kd_w4_chunks_avx2(W, R, wr, xp, ldp, next, pfs, c0, c0 + cpg, sc, ns, ev, od);
      else
        kd_w4_chunks_avx2(W, R, wr, xp, ldp, next, pfs, c0, nc, sc, ns, ev, od);
    }
  }
}

/* One dot of the fused kernel: 16 elements = 2 packed words = 8 bytes: vpmovzxbd puts byte i (elements 2i, 2i+1) in
 * dword i; & 15 gives the even elements (lanes 0, 2, .., 14), >> 4 the odd ones (lanes 1, 3, .., 15). x is permuted
 * the same way once per call (xp), so register lane i of `ev` is logical lane 2i and of `od` lane 2i+1: each
 * logical lane still adds (q * s) * x in ascending k, as kd_dot_f32 on the dequantized row. A chunk's 8 bytes span
 * words 2c and 2c+1: scale s[2c / wpg] for bytes 0..3, s[(2c+1) / wpg] for bytes 4..7 (equal when wpg is even).
 * Inlined: a call per output made the caller spill the other rows' accumulators (T = 1 at 128-512 wide rows: 0.92x). */
__attribute__((target("avx2,fma"), always_inline)) static inline float kd_w4_finish_avx2(
    __m256 ev, __m256 od, const uint32_t *wr, kd_qs sr, const float *x, int64_t n_in, int64_t wpg) {
  float b[KD_LANES];
  kd_fused_lanes_avx2(ev, od, b);
  for (int64_t k = n_in / KD_LANES * KD_LANES; k < n_in; k++) /* tail: lane k % 16, ascending */
    b[k % KD_LANES] = fmaf(kd_int4_weight(wr[k / 8], (int)(k % 8), kd_qs_at(sr, k / 8 / wpg)), x[k], b[k % KD_LANES]);
  return kd_lanes_sum(b);
}

/* outputs o .. o + W - 1 of out [R, n_out] for R rows of x (xp: permuted, stride ldp; x: the rows themselves) */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_w4_rows_avx2(
    const int W, const int R, const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg,
    const float *xp, int64_t ldp, const float *x, float *out, int64_t n_in, int64_t n_out, int64_t o) {
  const int64_t nc = n_in / KD_LANES;
  /* the next rows' words: rows are short streams (2 KB at n_in = 4096), which the hardware prefetcher picks up
   * too late (out of cache: 1.99 -> 1.63 ms at 4096 x 4096). Past the last rows it prefetches these rows again (a
   * prefetch never faults) rather than branch in the loop. */
  const char *next = (const char *)(qp + (o + W < n_out ? o + W : o) * n_words);
  const uint32_t *wr[KD_W4_ROWS];
  kd_qs sr[KD_W4_ROWS];
  for (int r = 0; r < W; r++) { /* past the last output: repeat it, result discarded */
    int64_t oo = o + r < n_out ? o + r : n_out - 1;
    wr[r] = qp + oo * n_words, sr[r] = kd_qs_row(qs, oo * n_groups);
  }
  __m256 ev[KD_W4_ROWS * KD_W4_PASS_T], od[KD_W4_ROWS * KD_W4_PASS_T];
#pragma GCC unroll 8
  for (int i = 0; i < W * R; i++) ev[i] = od[i] = _mm256_setzero_ps();
  if (wpg == 4) /* group 32 (the K2 checkpoints'): two chunks per group, the chunk loop unrolled */
    kd_w4_groups_avx2(W, R, wr, sr, xp, ldp, next, 32, 0, nc, 2, ev, od);
  else if (wpg == 16) /* group 128 */
    kd_w4_groups_avx2(W, R, wr, sr, xp, ldp, next, 32, 0, nc, 8, ev, od);
  else if (wpg % 2 == 0)
    kd_w4_groups_avx2(W, R, wr, sr, xp, ldp, next, 32, 0, nc, wpg / 2, ev, od);
  else { /* odd wpg (group = 8, 24, ..): a chunk may straddle two groups, its scales blended per chunk */
    const __m256 mm8 = _mm256_set1_ps(-8.0f);
    int64_t ga = 0, ra = 0; /* word 2c is word ra of group ga: no division per chunk */
    for (int64_t c = 0; c < nc; c++) {
      int64_t gb = ra + 1 == wpg ? ga + 1 : ga; /* group of word 2c + 1 */
      __m256 sc[KD_W4_ROWS], ns[KD_W4_ROWS];
#pragma GCC unroll 8
      for (int r = 0; r < W; r++) {
        sc[r] = _mm256_blend_ps(_mm256_set1_ps(kd_qs_at(sr[r], ga)), _mm256_set1_ps(kd_qs_at(sr[r], gb)), 0xF0);
        ns[r] = _mm256_mul_ps(sc[r], mm8);
      }
      kd_w4_chunks_avx2(W, R, wr, xp, ldp, next, 32, c, c + 1, sc, ns, ev, od);
      for (ra += 2; ra >= wpg; ra -= wpg) ga++;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < W; r++) /* unrolled: ev/od stay in registers */
#pragma GCC unroll 8
    for (int t = 0; t < R; t++)
      if (o + r < n_out)
        out[t * n_out + o + r] =
            kd_w4_finish_avx2(ev[r * R + t], od[r * R + t], wr[r], sr[r], x + t * n_in, n_in, wpg);
}

#define KD_W4_AVX2(W, R)                                                                                          \
  __attribute__((target("avx2,fma"))) static void kd_w4_rows_avx2_##R(                                            \
      const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg, const float *xp, int64_t ldp,  \
      const float *x, float *out, int64_t n_in, int64_t n_out, int64_t o) {                                        \
    kd_w4_rows_avx2(W, R, qp, qs, n_words, n_groups, wpg, xp, ldp, x, out, n_in, n_out, o);                       \
  }
KD_W4_AVX2(KD_W4_ROWS, 1) KD_W4_AVX2(1, 2) KD_W4_AVX2(1, 3) KD_W4_AVX2(1, 4) KD_W4_AVX2(1, 5)

/* The same kernel k-blocked, for 2-5 rows of x over long rows (even wpg): rows of x 28 KB long (n_in = 7168) do not
 * stay in L1, and every chunk read R x 64 bytes of x from L2. Here KD_W4_RG weight rows pass over one k block of x
 * (KD_W4_KB chunks: R x 4 KB, in L1) before the next block; each row's lane sums wait in P between blocks, and the
 * blocks go in ascending k, so every lane still adds its products in ascending k: the same bits. The next-but-one
 * row's chunk is prefetched (the rows of a group are visited one block at a time). */
#define KD_W4_KB 64 /* chunks per k block (1024 elements) */
/* floats of x a pass's rows may span and still run unblocked: at 2048 x 2 rows (16 KB, in L1) the blocked form ran
 * 0.89x, at 2048 x 4 rows 1.0x, at 7168 x 2-4 rows 1.04-1.35x (2 threads, native/bench_ab.py) */
#define KD_W4_XL1 6144
#define KD_W4_RG 16 /* weight rows per group */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_w4_group_avx2(
    const int R, const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg, const float *xp,
    int64_t ldp, const float *x, float *out, int64_t n_in, int64_t n_out, int64_t o0) {
  const int64_t nc = n_in / KD_LANES, cpg = wpg / 2, kb = KD_W4_KB > cpg ? KD_W4_KB / cpg * cpg : cpg;
  const int64_t o1 = o0 + KD_W4_RG < n_out ? o0 + KD_W4_RG : n_out;
  __m256 P[KD_W4_RG][2 * KD_W4_PASS_T];
  for (int64_t c_lo = 0; c_lo < nc; c_lo += kb) {
    const int64_t c_hi = c_lo + kb < nc ? c_lo + kb : nc;
    for (int64_t o = o0; o < o1; o++) {
      const uint32_t *wr[1] = {qp + o * n_words};
      const kd_qs sr[1] = {kd_qs_row(qs, o * n_groups)};
      const char *next = (const char *)(qp + (o + 2 < n_out ? o + 2 : o) * n_words);
      __m256 ev[KD_W4_PASS_T], od[KD_W4_PASS_T];
#pragma GCC unroll 8
      for (int t = 0; t < R; t++) {
        ev[t] = c_lo ? P[o - o0][2 * t] : _mm256_setzero_ps();
        od[t] = c_lo ? P[o - o0][2 * t + 1] : _mm256_setzero_ps();
      }
      kd_w4_groups_avx2(1, R, wr, sr, xp, ldp, next, 8, c_lo, c_hi, cpg, ev, od);
#pragma GCC unroll 8
      for (int t = 0; t < R; t++) P[o - o0][2 * t] = ev[t], P[o - o0][2 * t + 1] = od[t];
    }
  }
  for (int64_t o = o0; o < o1; o++)
#pragma GCC unroll 8
    for (int t = 0; t < R; t++)
      out[t * n_out + o] = kd_w4_finish_avx2(P[o - o0][2 * t], P[o - o0][2 * t + 1], qp + o * n_words,
                                             kd_qs_row(qs, o * n_groups), x + t * n_in, n_in, wpg);
}

#define KD_W4_GROUP(R)                                                                                            \
  __attribute__((target("avx2,fma"))) static void kd_w4_group_avx2_##R(                                           \
      const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg, const float *xp, int64_t ldp,  \
      const float *x, float *out, int64_t n_in, int64_t n_out, int64_t o) {                                        \
    kd_w4_group_avx2(R, qp, qs, n_words, n_groups, wpg, xp, ldp, x, out, n_in, n_out, o);                         \
  }
KD_W4_GROUP(2) KD_W4_GROUP(3) KD_W4_GROUP(4) KD_W4_GROUP(5)

/* register lanes 0..7 take the even elements of a chunk, 8..15 the odd ones (the two words' nibble order) */
static const unsigned char kd_w4_perm_avx2[KD_LANES] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

/* the fused kernels' copy of x [T, n_in] into xp: each row's whole chunks in the kernels' lane order (xp[16 c + j] =
 * x[16 c + perm[j]]), rows ldp floats apart */
static void kd_fused_permute(float *xp, const float *x, int64_t T, int64_t n_in, int64_t ldp) {
  const int64_t nc = n_in / KD_LANES;
  for (int64_t t = 0; t < T; t++)
    for (int64_t c = 0; c < nc; c++)
      for (int j = 0; j < KD_LANES; j++)
        xp[t * ldp + KD_LANES * c + j] = x[t * n_in + KD_LANES * c + kd_w4_perm_avx2[j]];
}

/* kd_fused_permute into a new 64-byte aligned buffer; NULL (the error set, naming op) when out of memory */
static float *kd_fused_x(const char *op, const float *x, int64_t T, int64_t n_in, int64_t ldp) {
  float *xp = (float *)aligned_alloc(64, sizeof(float) * (size_t)(T * ldp));
  if (!xp) {
    kd_fail(KD_ENOMEM, "%s: out of memory for a %lld x %lld copy of x", op, (long long)T, (long long)n_in);
    return NULL;
  }
  kd_fused_permute(xp, x, T, n_in, ldp);
  return xp;
}

/* out [T, n_out] for 1 <= T <= KD_W4_SMALL_MAX rows of x on AVX2: x permuted once per call into the kernel's lane
 * order (xp[16 c + j] = x[16 c + perm[j]]), then W outputs at a time, on the threads when parallel (no OpenMP region
 * at all for small matrices, see kd_gemv_f32_avx2). From 6 rows each weight row (or group of rows, k-blocked)
 * takes ceil(T / 5) passes of 2-5 rows of x back to back, the later ones finding it in L1. Against the panel path
 * (2048 x 7168 / 7168 x 2048, 2 threads, docs/measurements.md, 14th session): T = 2 2.3-2.5x, T = 3-4 2.0-2.2x,
 * T = 5-8 1.3-1.4x, T = 12-16 1.06-1.21x; from 17 rows the panel path's one dequantization per block takes over.
 * Passes of up to 5 rows instead of 4 (16th session): T = 5 1.29-1.30x, T = 9 1.14-1.27x, T = 10 1.09-1.11x, T = 13
 * 1.10x, other T 1.00-1.03x. */
#define KD_W4_SMALL_MAX 16
typedef void (*kd_w4_rows_fn)(const uint32_t *, kd_qs, int64_t, int64_t, int64_t, const float *, int64_t,
                              const float *, float *, int64_t, int64_t, int64_t);
static int kd_w4_small_avx2(const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg,
                            const float *x, float *out, int64_t T, int64_t n_in, int64_t n_out, int parallel) {
  /* by rows of x per pass; the k-blocked form where a pass's rows of x would not stay in L1 (KD_W4_RG weight rows
   * per step) */
  static const kd_w4_rows_fn fns[KD_W4_PASS_T + 1] = {NULL, kd_w4_rows_avx2_1, kd_w4_rows_avx2_2,
                                                      kd_w4_rows_avx2_3, kd_w4_rows_avx2_4, kd_w4_rows_avx2_5};
  static const kd_w4_rows_fn gfns[KD_W4_PASS_T + 1] = {NULL, NULL, kd_w4_group_avx2_2, kd_w4_group_avx2_3,
                                                       kd_w4_group_avx2_4, kd_w4_group_avx2_5};
  /* ceil(T / 5) passes of 2-5 rows each (as even as they come; T = 1: the GEMV), back to back per weight row */
  const int64_t np = (T + KD_W4_PASS_T - 1) / KD_W4_PASS_T, rmax = (T + np - 1) / np;
  const int blocked = T >= 2 && rmax * n_in > KD_W4_XL1 && wpg % 2 == 0;
  const kd_w4_rows_fn *tab = blocked ? gfns : fns;
  const int64_t ldp = n_in / KD_LANES * KD_LANES + KD_LANES;
  const int64_t step = blocked ? KD_W4_RG : T == 1 ? KD_W4_ROWS : 1;
  float *xp = kd_fused_x("kd_linear_w4a16", x, T, n_in, ldp);
  if (!xp) return KD_ENOMEM;
  int64_t tb[(KD_W4_SMALL_MAX + KD_W4_PASS_T - 1) / KD_W4_PASS_T + 1]; /* pass p: rows [tb[p], tb[p + 1]) */
  for (int64_t p = 0; p <= np; p++) tb[p] = p * T / np;
  if (parallel) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t o = 0; o < n_out; o += step)
      for (int64_t p = 0; p < np; p++)
        tab[tb[p + 1] - tb[p]](qp, qs, n_words, n_groups, wpg, xp + tb[p] * ldp, ldp, x + tb[p] * n_in,
                               out + tb[p] * n_out, n_in, n_out, o);
  } else {
    for (int64_t o = 0; o < n_out; o += step)
      for (int64_t p = 0; p < np; p++)
        tab[tb[p + 1] - tb[p]](qp, qs, n_words, n_groups, wpg, xp + tb[p] * ldp, ldp, x + tb[p] * n_in,
                               out + tb[p] * n_out, n_in, n_out, o);
  }
  free(xp);
  return KD_OK;
}

/* ---- the fused kernel on BF16 weights (AVX2), 2-7 rows of x ---------------------------------------------------
 * kd_w4_small_avx2's passes with a BF16 chunk in place of an INT4 one: 16 elements are 32 bytes, one load; dword i
 * holds elements 2i (low half) and 2i + 1 (high half), so `<< 16` widens the even elements and `& 0xffff0000` the
 * odd ones, exactly, one op each, into the INT4 kernel's permuted lane order (register lane i of `ev` is logical
 * lane 2i, of `od` 2i + 1; x permuted the same way once per call). Each logical lane adds w * x in ascending k, the
 * n % 16 tail and the lane sum as kd_dot_f32 on the widened row: the bits of every other BF16 path. Why: the panels
 * (two passes over each 512-element block, a 4-row panel per row tile) ran BF16 calls of 3-8 rows at 35-47 GFLOP/s
 * per thread, streaming 12-25 GB/s where one row streams 38-48 (2 threads); this kernel runs 3 rows 1.22-1.35x,
 * 4 rows 1.43-1.52x, 5-7 rows 1.07-1.23x faster (docs/measurements.md, 15th session; 5-6 rows in one pass since,
 * below). Not for 2 rows whose x leaves L1 (the panels stream them at ~0.85 of the read roof already: 0.87-0.90x)
 * nor from 8 rows (passes of 4-6 rows over 8-12: 0.67-1.0x, 16th session). */
#define KD_B16_FUSED_T 7
/* rows of x per pass: 2 R accumulators + the two weight registers + the mask, 15 of 16 at R = 6 (R = 7 spilled:
 * 0.82x). One pass of 5-6 rows against passes of 3 + 2 / 3 + 3: 1.13-1.14x / 1.07-1.12x (16th session): a pass of
 * R <= 3 rows is held by its 2 R four-cycle accumulator chains (one multiply-add each per chunk). */
#define KD_B16_PASS_T 6
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_b16_chunks_avx2(
    const int R, const uint16_t *wr, const float *xp, int64_t ldp, const char *next, int64_t pfs, int64_t c0,
    int64_t c1, __m256 *ev, __m256 *od) {
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 4 /* against 2: 3 rows 1.03-1.09x, others within 2 % */
  for (int64_t c = c0; c < c1; c++) {
    const __m256 xe = R == 1 ? _mm256_load_ps(xp + 16 * c) : _mm256_setzero_ps();
    const __m256 xo = R == 1 ? _mm256_load_ps(xp + 16 * c + 8) : _mm256_setzero_ps();
    _mm_prefetch(next + pfs * c, _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(wr + 16 * c));
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
    kd_fused_fma_avx2(R, 0, c, we, wo, xe, xo, xp, ldp, ev, od);
  }
}

/* one dot of the BF16 fused kernel: the lanes un-permuted, the tail added (lane k % 16, ascending), the lane sum */
__attribute__((target("avx2,fma"), always_inline)) static inline float kd_b16_finish_avx2(__m256 ev, __m256 od,
                                                                                         const uint16_t *wr,
                                                                                         const float *x, int64_t n_in) {
  float b[KD_LANES];
  kd_fused_lanes_avx2(ev, od, b);
  for (int64_t k = n_in / KD_LANES * KD_LANES; k < n_in; k++) {
    uint32_t u = (uint32_t)wr[k] << 16;
    float wv;
    memcpy(&wv, &u, 4);
    b[k % KD_LANES] = fmaf(wv, x[k], b[k % KD_LANES]);
  }
  return kd_lanes_sum(b);
}

/* output o of out [R, n_out] for R rows of x (xp permuted, stride ldp; x the rows themselves): one weight row per
 * pass, whole */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_b16_row_avx2(
    const int R, const uint16_t *w, const float *xp, int64_t ldp, const float *x, float *out, int64_t n_in,
    int64_t n_out, int64_t o) {
  const uint16_t *wr = w + o * n_in;
  const char *next = (const char *)(w + (o + 1 < n_out ? o + 1 : o) * n_in);
  __m256 ev[KD_B16_PASS_T], od[KD_B16_PASS_T];
#pragma GCC unroll 8
  for (int t = 0; t < R; t++) ev[t] = od[t] = _mm256_setzero_ps();
  kd_b16_chunks_avx2(R, wr, xp, ldp, next, 64, 0, n_in / KD_LANES, ev, od); /* 64 bytes per 32-byte chunk: 2 rows */
#pragma GCC unroll 8
  for (int t = 0; t < R; t++) out[t * n_out + o] = kd_b16_finish_avx2(ev[t], od[t], wr, x + t * n_in, n_in);
}

/* one pass of R rows of x over chunks [c_lo, c_hi) of one weight row, its lane sums taken from and left in P */
__attribute__((target("avx2,fma"), always_inline)) static inline void kd_b16_pass_avx2(
    const int R, const uint16_t *w, const float *xp, int64_t ldp, const char *next, int64_t c_lo, int64_t c_hi,
    __m256 *P) {
  __m256 ev[KD_B16_PASS_T], od[KD_B16_PASS_T];
#pragma GCC unroll 8
  for (int t = 0; t < R; t++) {
    ev[t] = c_lo ? P[2 * t] : _mm256_setzero_ps();
    od[t] = c_lo ? P[2 * t + 1] : _mm256_setzero_ps();
  }
  kd_b16_chunks_avx2(R, w, xp, ldp, next, 32, c_lo, c_hi, ev, od);
#pragma GCC unroll 8
  for (int t = 0; t < R; t++) P[2 * t] = ev[t], P[2 * t + 1] = od[t];
}

/* the same k-blocked: KD_W4_RG weight rows over one block of x before the next block, every pass of a row over the
 * block back to back (the row's block then in L1 for the later passes; the block kb chunks, so that all T rows of
 * it stay in L1 too: against whole passes one after another, 5-7 rows 1.00-1.15x), each (row, pass)'s lane sums
 * parked in P between blocks, blocks in ascending k */
__attribute__((target("avx2,fma"))) static void kd_b16_group_avx2(const uint16_t *w, const float *xp, int64_t ldp,
                                                                  const float *x, float *out, int64_t T,
                                                                  const int64_t *tb, int64_t np, int64_t n_in,
                                                                  int64_t n_out, int64_t o0) {
  const int64_t nc = n_in / KD_LANES, o1 = o0 + KD_W4_RG < n_out ? o0 + KD_W4_RG : n_out;
  const int64_t kb = T * KD_W4_KB > 256 ? (256 / T > 16 ? 256 / T : 16) : KD_W4_KB; /* T x kb x 64 B <= 16 KB */
  __m256 P[KD_W4_RG][2 * KD_B16_FUSED_T];
  for (int64_t c_lo = 0; c_lo < nc; c_lo += kb) {
    const int64_t c_hi = c_lo + kb < nc ? c_lo + kb : nc;
    for (int64_t o = o0; o < o1; o++) {
      const char *next = (const char *)(w + (o + 2 < n_out ? o + 2 : o) * n_in);
      for (int64_t p = 0; p < np; p++) {
        const float *xq = xp + tb[p] * ldp;
        __m256 *Pq = P[o - o0] + 2 * tb[p];
        switch (tb[p + 1] - tb[p]) {
        case 1: kd_b16_pass_avx2(1, w + o * n_in, xq, ldp, next, c_lo, c_hi, Pq); break;
        case 2: kd_b16_pass_avx2(2, w + o * n_in, xq, ldp, next, c_lo, c_hi, Pq); break;
        case 3: kd_b16_pass_avx2(3, w + o * n_in, xq, ldp, next, c_lo, c_hi, Pq); break;
        case 4: kd_b16_pass_avx2(4, w + o * n_in, xq, ldp, next, c_lo, c_hi, Pq); break;
        case 5: kd_b16_pass_avx2(5, w + o * n_in, xq, ldp, next, c_lo, c_hi, Pq); break;
        default: kd_b16_pass_avx2(6, w + o * n_in, xq, ldp, next, c_lo, c_hi, Pq); break;
        }
      }
    }
  }
  for (int64_t o = o0; o < o1; o++)
    for (int64_t t = 0; t < T; t++)
      out[t * n_out + o] =
          kd_b16_finish_avx2(P[o - o0][2 * t], P[o - o0][2 * t + 1], w + o * n_in, x + t * n_in, n_in);
}

typedef void (*kd_b16_fn)(const uint16_t *, const float *, int64_t, const float *, float *, int64_t, int64_t, int64_t);
#define KD_B16_ROW(R)                                                                                            \
  __attribute__((target("avx2,fma"))) static void kd_b16_row_avx2_##R(const uint16_t *w, const float *xp,         \
                                                                      int64_t ldp, const float *x, float *out,    \
                                                                      int64_t n_in, int64_t n_out, int64_t o) {   \
    kd_b16_row_avx2(R, w, xp, ldp, x, out, n_in, n_out, o);                                                      \
  }
KD_B16_ROW(1) KD_B16_ROW(2) KD_B16_ROW(3) KD_B16_ROW(4) KD_B16_ROW(5) KD_B16_ROW(6)

/* KD_W4_RG outputs from o (blocked) or output o, every pass (inlined: a call per output cost 2 rows 0.96x) */
static inline __attribute__((always_inline)) void kd_b16_step(int blocked, const uint16_t *w, const float *xp,
                                                             int64_t ldp, const float *x, float *out, int64_t T,
                                                             const int64_t *tb, int64_t np, int64_t n_in,
                                                             int64_t n_out, int64_t o) {
  static const kd_b16_fn fns[KD_B16_PASS_T + 1] = {NULL, kd_b16_row_avx2_1, kd_b16_row_avx2_2, kd_b16_row_avx2_3,
                                                    kd_b16_row_avx2_4, kd_b16_row_avx2_5, kd_b16_row_avx2_6};
  if (blocked) {
    kd_b16_group_avx2(w, xp, ldp, x, out, T, tb, np, n_in, n_out, o);
    return;
  }
  for (int64_t p = 0; p < np; p++)
    fns[tb[p + 1] - tb[p]](w, xp + tb[p] * ldp, ldp, x + tb[p] * n_in, out + tb[p] * n_out, n_in, n_out, o);
}

/* out [T, n_out] for 2 <= T <= KD_B16_FUSED_T rows of x: kd_w4_small_avx2's passes (one of all T rows up to
 * KD_B16_PASS_T, else two of 3-4 rows, back to back per weight row), k-blocked where the T rows of x span more
 * than KD_W4_XL1 floats */
static int kd_b16_small_avx2(const uint16_t *w, const float *x, float *out, int64_t T, int64_t n_in, int64_t n_out,
                             int parallel) {
  const int64_t np = (T + KD_B16_PASS_T - 1) / KD_B16_PASS_T;
  const int blocked = T * n_in > KD_W4_XL1; /* the passes over a weight row read all T rows of x */
  const int64_t ldp = n_in / KD_LANES * KD_LANES + KD_LANES, step = blocked ? KD_W4_RG : 1;
  float *xp = kd_fused_x("kd_linear_bf16", x, T, n_in, ldp);
  if (!xp) return KD_ENOMEM;
  int64_t tb[KD_B16_FUSED_T + 1];
  for (int64_t p = 0; p <= np; p++) tb[p] = p * T / np;
  if (parallel) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t o = 0; o < n_out; o += step) kd_b16_step(blocked, w, xp, ldp, x, out, T, tb, np, n_in, n_out, o);
  } else {
    for (int64_t o = 0; o < n_out; o += step) kd_b16_step(blocked, w, xp, ldp, x, out, T, tb, np, n_in, n_out, o);
  }
  free(xp);
  return KD_OK;
}

/* ---- BF16 GEMV (T = 1) on AVX2 ----------------------------------------------------------------------------------
 * The f32 GEMV's dots over BF16 weights (kd_dot_4x1_bf16_avx2) widen 8 weights with a zero-extend and a shift, two
 * operations on the two shuffle/shift pipes per 8 weights beside the multiply-add: from L3 they ran at 27-35 GB/s per
 * thread, and with two threads streamed 33-50 GB/s where the read roof was 42-62 (16th session). Here, as in
 * kd_b16_small_avx2, 16 elements are one 32-byte load widened by a shift (the even elements) and a mask (the odd ones)
 * into the permuted lane order, x permuted once per call: half the widening operations, none of them a shuffle. Four
 * weight rows per pass (eight independent accumulators, x loaded once for the four); the lanes are un-permuted in
 * registers, then the tail and kd_hsum4_avx2 as kd_dot_4x1_bf16_avx2: the same bits. Against those dots, 2 threads:
 * 1.3-1.6 % faster per linear at a 40 GB/s roof, 3-8 % at 42-64 GB/s; prefetching the next rows (L1 or L2, or at a
 * fixed distance in the row) cost 2-25 %. */
__attribute__((target("avx2,fma"))) static void kd_b16_gemv4_avx2(const uint16_t *w, int64_t ws, const float *xp,
                                                                  const float *x, int64_t n, float *r) {
  const uint16_t *wr[4] = {w, w + ws, w + 2 * ws, w + 3 * ws};
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
  __m256 ev[4], od[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) ev[i] = od[i] = _mm256_setzero_ps();
  const int64_t nc = n / KD_LANES;
  for (int64_t c = 0; c < nc; c++) {
    const __m256 xe = _mm256_load_ps(xp + 16 * c), xo = _mm256_load_ps(xp + 16 * c + 8);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(wr[i] + 16 * c));
      ev[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xe, ev[i]);
      od[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), xo, od[i]);
    }
  }
  __m256 lo[4], hv[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) { /* register lane j of ev is logical lane 2j, of od 2j + 1 */
    const __m256 a = _mm256_unpacklo_ps(ev[i], od[i]), b = _mm256_unpackhi_ps(ev[i], od[i]); /* 0-3|8-11, 4-7|12-15 */
    lo[i] = _mm256_permute2f128_ps(a, b, 0x20), hv[i] = _mm256_permute2f128_ps(a, b, 0x31);
    KD_WTAIL_AVX2(lo[i], hv[i], wr[i], x, nc * KD_LANES, n, 1);
  }
  _mm_storeu_ps(r, kd_hsum4_avx2(lo[0], hv[0], lo[1], hv[1], lo[2], hv[2], lo[3], hv[3]));
}

#define KD_B16_GEMV_XS 4096 /* rows of x up to this many floats are permuted on the stack, longer ones on the heap */
static int kd_b16_gemv_avx2(const float *x, const uint16_t *w, float *out, int64_t n_in, int64_t n_out,
                            int parallel) {
  const int64_t ldp = n_in / KD_LANES * KD_LANES + KD_LANES, n4 = n_out / 4 * 4;
  float xs[KD_B16_GEMV_XS + KD_LANES] __attribute__((aligned(64)));
  float *xp = xs;
  if (ldp <= KD_B16_GEMV_XS + KD_LANES)
    kd_fused_permute(xs, x, 1, n_in, ldp);
  else if (!(xp = kd_fused_x("kd_linear_bf16", x, 1, n_in, ldp)))
    return KD_ENOMEM;
  if (parallel) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t o = 0; o < n4; o += 4) kd_b16_gemv4_avx2(w + o * n_in, n_in, xp, x, n_in, out + o);
  } else {
    for (int64_t o = 0; o < n4; o += 4) kd_b16_gemv4_avx2(w + o * n_in, n_in, xp, x, n_in, out + o);
  }
  for (int64_t o = n4; o < n_out; o++) out[o] = kd_dot_bf16_avx2(w + o * n_in, x, n_in);
  if (xp != xs) free(xp);
  return KD_OK;
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
/* ---- AVX-512 W4A16, 1-8 rows (GEMV) ---------------------------------------------------------------------------
 * A 16-element chunk of a row is 8 bytes (two words). Broadcast as a qword to the eight qword lanes, dword lane 2m
 * holds word 0 (elements 0..7) and lane 2m + 1 word 1 (elements 8..15); shifting lane 2m and 2m + 1 right by 4m
 * puts element m resp. 8 + m in the low nibble, and vpermps -- which reads only an index's low 4 bits -- looks the
 * nibble q up in the group's table T[q] = (float)(q - 8) * scale, exactly kd_int4_weight's one rounding. So a
 * chunk is a broadcast load, a shift, a lookup and one fused multiply-add into the row's accumulator, whose register
 * lane 2m is logical lane m and lane 2m + 1 logical lane 8 + m (x is permuted the same way once per call): every
 * logical lane still adds its elements in ascending k, as kd_dot_f32 on the dequantized row. A group (even wpg)
 * is a whole number of chunks: one table per group and row. */
#define KD_W4R512 4 /* weight rows per pass */

/* The fused W4A16 kernel for R = 1..KD_W4_SMALL_T rows of x (the GEMV; a verify's rows routed to one expert; a small
 * batch): one pass over KD_W4R512 weight rows, each chunk looked up once and multiplied into all R rows of x (xp:
 * permuted rows, stride ldp). No block is stored and read back, and the weights stream once at the
 * GEMV's rate: the panel path dequantizes into L1 first, which at 2-3 rows cost 2.3x a one-row call. Each output is
 * the GEMV's dot -- lanes in ascending k, then the same un-permuted sum -- so the bits do not depend on T. */
#define KD_W4_SMALL_T 4 /* accumulators KD_W4R512 x 4 + 4 tables + 4 x rows + the shifts, the ramp, a weight: 28 */
__attribute__((target(KD_A512), always_inline)) static inline void kd_w4_small512(
    const int R, const int H, const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg,
    const float *xp, int64_t ldp, const float *x, float *out, int64_t n_in, int64_t n_out, int64_t o) {
  const int64_t nc = n_in / KD_LANES, cpg = wpg / 2;
  const __m512i sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512 ramp = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const uint32_t *wr[KD_W4R512];
  kd_qs sr[KD_W4R512];
  for (int r = 0; r < KD_W4R512; r++) { /* past the last output: repeat it, result discarded */
    int64_t oo = o + r < n_out ? o + r : n_out - 1;
    wr[r] = qp + oo * n_words, sr[r] = kd_qs_row(qs, oo * n_groups);
  }
  const char *next = (const char *)(qp + (o + KD_W4R512 < n_out ? o + KD_W4R512 : o) * n_words);
  __m512 acc[KD_W4R512][KD_W4_SMALL_T];
#pragma GCC unroll 4
  for (int r = 0; r < KD_W4R512; r++)
#pragma GCC unroll 4
    for (int t = 0; t < R; t++) acc[r][t] = _mm512_setzero_ps();
  /* the scales of 16 groups at a time, widened once into sc (H: BF16 bits), so a group's table is one multiply by a
   * broadcast load: no scalar widening and register broadcast on the shuffle ports the lookups need */
  float sc[KD_W4R512][KD_LANES] __attribute__((aligned(64)));
  const int64_t ngc = (nc + cpg - 1) / cpg; /* groups with whole chunks */
  for (int64_t g0 = 0; g0 < ngc; g0 += KD_LANES) {
    const int64_t gn = ngc - g0 < KD_LANES ? ngc - g0 : KD_LANES;
    const __mmask16 gm = (__mmask16)((1u << gn) - 1);
#pragma GCC unroll 4
    for (int r = 0; r < KD_W4R512; r++)
      _mm512_store_ps(sc[r], H ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(gm, sr[r].h + g0)), 16))
                               : _mm512_maskz_loadu_ps(gm, sr[r].f + g0));
    for (int64_t j = 0; j < gn; j++) {
      const int64_t c0 = (g0 + j) * cpg, c1 = c0 + cpg < nc ? c0 + cpg : nc;
      __m512 tab[KD_W4R512];
#pragma GCC unroll 4
      for (int r = 0; r < KD_W4R512; r++) tab[r] = _mm512_mul_ps(ramp, _mm512_set1_ps(sc[r][j]));
      for (int64_t c = c0; c < c1; c++) {
        __m512 xv[KD_W4_SMALL_T];
#pragma GCC unroll 4
        for (int t = 0; t < R; t++) xv[t] = _mm512_load_ps(xp + t * ldp + 16 * c);
        if ((c & 1) == 0) _mm_prefetch(next + KD_W4R512 * 8 * c, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < KD_W4R512; r++) {
          const __m512 wv = _mm512_permutexvar_ps(
              _mm512_srlv_epi32(_mm512_set1_epi64(*(const int64_t *)(wr[r] + 2 * c)), sh), tab[r]);
#pragma GCC unroll 4
          for (int t = 0; t < R; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < KD_W4R512; r++) {
    if (o + r >= n_out) break;
#pragma GCC unroll 4
    for (int t = 0; t < R; t++) {
      float a[KD_LANES], b[KD_LANES];
      _mm512_storeu_ps(a, acc[r][t]);
      for (int m = 0; m < 8; m++) b[m] = a[2 * m], b[8 + m] = a[2 * m + 1];
      for (int64_t k = nc * KD_LANES; k < n_in; k++) /* tail: lane k % 16, ascending */
        b[k % KD_LANES] = fmaf(kd_int4_weight(wr[r][k / 8], (int)(k % 8), kd_qs_at(sr[r], k / 8 / wpg)),
                               x[t * n_in + k], b[k % KD_LANES]);
      out[t * n_out + o + r] = kd_lanes_sum(b);
    }
  }
}

#define KD_W4_SMALL(R, H, S)                                                                                      \
  __attribute__((target(KD_A512))) static void kd_w4_small512_##R##S(                                            \
      const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg, const float *xp, int64_t ldp,  \
      const float *x, float *out, int64_t n_in, int64_t n_out, int64_t o) {                                        \
    kd_w4_small512(R, H, qp, qs, n_words, n_groups, wpg, xp, ldp, x, out, n_in, n_out, o);                       \
  }
KD_W4_SMALL(1, 0, f) KD_W4_SMALL(2, 0, f) KD_W4_SMALL(3, 0, f) KD_W4_SMALL(4, 0, f)
KD_W4_SMALL(1, 1, h) KD_W4_SMALL(2, 1, h) KD_W4_SMALL(3, 1, h) KD_W4_SMALL(4, 1, h)

/* out [T, n_out] for 1 <= T <= 2 x KD_W4_SMALL_T rows of x, even wpg: x permuted once per call, then
 * one pass per KD_W4_SMALL_T rows (2048x7168, 2 threads: T = 5 1.29 -> 1.11 ms, T = 8 1.67 -> 1.43 against the
 * block path; at T = 9 three passes cost what the block path does, which keeps T > 8) */
static int kd_linear_w4_small512(const uint32_t *qp, kd_qs qs, int64_t n_words, int64_t n_groups, int64_t wpg,
                                 const float *x, float *out, int64_t T, int64_t n_in, int64_t n_out, int parallel) {
  typedef void (*fn_t)(const uint32_t *, kd_qs, int64_t, int64_t, int64_t, const float *, int64_t, const float *,
                       float *, int64_t, int64_t, int64_t);
  static const fn_t fns[2][KD_W4_SMALL_T] = { /* [BF16 scales][R - 1] */
      {kd_w4_small512_1f, kd_w4_small512_2f, kd_w4_small512_3f, kd_w4_small512_4f},
      {kd_w4_small512_1h, kd_w4_small512_2h, kd_w4_small512_3h, kd_w4_small512_4h}};
  const int64_t nc = n_in / KD_LANES, ldp = nc * KD_LANES + KD_LANES;
  float *xp = (float *)aligned_alloc(64, sizeof(float) * (size_t)(T * ldp));
  if (!xp) return kd_fail(KD_ENOMEM, "kd_linear_w4a16: out of memory (T=%lld, in=%lld)", (long long)T, (long long)n_in);
  kd_x_perm512(x, T, n_in, xp, ldp);
  for (int64_t t0 = 0; t0 < T; t0 += KD_W4_SMALL_T) {
    const int64_t R = T - t0 < KD_W4_SMALL_T ? T - t0 : KD_W4_SMALL_T;
    const fn_t fn = fns[qs.h != NULL][R - 1];
    const float *xq = xp + t0 * ldp, *xt = x + t0 * n_in;
    float *ot = out + t0 * n_out;
    /* one row enters no OpenMP region for a small matrix (even an if(0) region costs a GOMP_parallel call) */
    if (parallel || (T >= 2 && kd_par_worth(R * n_in * n_out, (n_out + KD_W4R512 - 1) / KD_W4R512))) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
      for (int64_t o = 0; o < n_out; o += KD_W4R512)
        fn(qp, qs, n_words, n_groups, wpg, xq, ldp, xt, ot, n_in, n_out, o);
    } else {
      for (int64_t o = 0; o < n_out; o += KD_W4R512)
        fn(qp, qs, n_words, n_groups, wpg, xq, ldp, xt, ot, n_in, n_out, o);
    }
  }
  free(xp);
  return KD_OK;
}
#endif

/* out[t, o0 + i] for the `no` (<= 4) weight rows w (stride n_in) and all T rows of x: four x rows per weight
 * load, then the leftover rows four weight rows at a time. */
static void kd_linear_block(const float *x, const float *w, int no, float *out, int64_t T, int64_t n_in,
                            int64_t n_out, int64_t o0) {
  float r[4];
  int64_t t = 0;
  for (; t + 4 <= T; t += 4)
    for (int i = 0; i < no; i++) {
      kd_dot_1x4(w + i * n_in, x + t * n_in, n_in, r);
      for (int j = 0; j < 4; j++) out[(t + j) * n_out + o0 + i] = r[j];
    }
  for (; t < T; t++) {
    if (no == 4) {
      kd_dot_4x1(w, n_in, x + t * n_in, n_in, r);
      for (int i = 0; i < 4; i++) out[t * n_out + o0 + i] = r[i];
    } else {
      for (int i = 0; i < no; i++) out[t * n_out + o0 + i] = kd_dot(w + i * n_in, x + t * n_in, n_in);
    }
  }
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
  int parallel = n_out * n_in >= KD_PARALLEL_MIN_WEIGHTS;
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx512()) {
    kd_wsrc src = {w, NULL, NULL, {NULL, NULL}, 0, 0, 1, n_in, n_out, 0};
    return kd_linear_512(&src, x, out, T, parallel);
  }
  if (T >= 2 && kd_host_avx2() && n_in <= KD_KC && !parallel) { /* short rows: whole dots in register tiles */
    kd_linear_direct(x, n_in, w, n_in, out, n_out, T, n_in, n_out);
    return KD_OK;
  }
  if (T >= 2 && kd_host_avx2()) /* register tiles over k blocks; T = 1 below is bound by reading w anyway */
    return kd_linear_multirow(x, w, NULL, NULL, kd_qs_none, 0, 0, 1, out, T, n_in, n_out, parallel);
  if (kd_host_avx2()) {
    kd_gemv_f32_avx2(x, w, out, n_in, n_out, parallel);
    return KD_OK;
  }
#endif
  /* four weight rows stay in L1 across the T rows; large matrices split the blocks over threads (small ones enter
   * no OpenMP region: see kd_gemv_f32_avx2) */
  if (parallel) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t o = 0; o < n_out; o += 4)
      kd_linear_block(x, w + o * n_in, (int)(n_out - o < 4 ? n_out - o : 4), out, T, n_in, n_out, o);
  } else {
    for (int64_t o = 0; o < n_out; o += 4)
      kd_linear_block(x, w + o * n_in, (int)(n_out - o < 4 ? n_out - o : 4), out, T, n_in, n_out, o);
  }
  return KD_OK;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* output triple o of the short-row BF16 path: its three rows widened into L1 (this thread's stack), then the direct
 * tiles over every row of x -- kd_linear_f32's short-row path on the widened rows */
__attribute__((target("avx2,fma"))) static void kd_bf16_direct_col(const uint16_t *w, const float *x, float *out,
                                                                int64_t T, int64_t n_in, int64_t n_out, int64_t o) {
  float wb[3 * KD_KC] __attribute__((aligned(64)));
  int O = n_out - o < 3 ? (int)(n_out - o) : 3;
  for (int i = 0; i < O; i++) kd_bf16_widen_avx2(w + (o + i) * n_in, wb + i * KD_KC, n_in);
  kd_linear_direct(x, n_in, wb, KD_KC, out + o, n_out, T, n_in, O);
}
#endif

/* kd_linear_f32 on BF16 weights, path for path: T = 1 widens in registers (kd_b16_gemv_avx2: the f32 GEMV's dots in the
 * fused kernels' lane order), 3-7 rows (and 2 over short rows) in the fused kernel's registers (kd_b16_small_avx2),
 * other T >= 2 in the panels (in the register for a few rows, else each weight slice into the L1 buffer the f32 tiles
 * read); the portable path widens four rows at a time for kd_linear_block. Every output is the same float32 sequence as
 * kd_linear_f32 over the widened weights, so the two agree bit for bit (tests/native/test_bf16_weights.py). */
int kd_linear_bf16(const float *x, const uint16_t *w, float *out, int64_t T, int64_t n_in, int64_t n_out,
                   void *stream) {
  (void)stream;
  kd_clear_error();
  if (T < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "kd_linear_bf16: negative size");
  if (T == 0 || n_out == 0) return KD_OK;
  KD_CHECK_PTR("kd_linear_bf16", x);
  KD_CHECK_PTR("kd_linear_bf16", w);
  KD_CHECK_PTR("kd_linear_bf16", out);
  int parallel = n_out * n_in >= KD_PARALLEL_MIN_WEIGHTS;
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx512()) {
    kd_wsrc src = {NULL, w, NULL, {NULL, NULL}, 0, 0, 1, n_in, n_out, 0};
    return kd_linear_512(&src, x, out, T, parallel);
  }
  if (T >= 2 && kd_host_avx2() && n_in <= KD_KC && !parallel) { /* as kd_linear_direct: whole triples per thread */
    int64_t n3 = (n_out + 2) / 3;
    if (kd_par_worth(T * n_in * n_out, n3)) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
      for (int64_t i = 0; i < n3; i++) kd_bf16_direct_col(w, x, out, T, n_in, n_out, 3 * i);
    } else {
      for (int64_t i = 0; i < n3; i++) kd_bf16_direct_col(w, x, out, T, n_in, n_out, 3 * i);
    }
    return KD_OK;
  }
  if (T >= 2 && T <= KD_B16_FUSED_T && (T >= 3 || T * n_in <= KD_W4_XL1) && kd_host_avx2()) /* a few rows */
    return kd_b16_small_avx2(w, x, out, T, n_in, n_out, parallel);
  if (T >= 2 && kd_host_avx2())
    return kd_linear_multirow(x, NULL, w, NULL, kd_qs_none, 0, 0, 1, out, T, n_in, n_out, parallel);
  if (kd_host_avx2()) {
    return kd_b16_gemv_avx2(x, w, out, n_in, n_out, parallel);
  }
#endif
  /* portable: four rows widened (L1-resident), then kd_linear_f32's portable block kernel */
  float *wf = (float *)malloc(sizeof(float) * (size_t)(4 * (n_in ? n_in : 1)));
  if (!wf) return kd_fail(KD_ENOMEM, "kd_linear_bf16: out of memory (in=%lld)", (long long)n_in);
  for (int64_t o = 0; o < n_out; o += 4) {
    int no = (int)(n_out - o < 4 ? n_out - o : 4);
    kd_bf16_widen_generic(w + o * n_in, wf, no * n_in);
    kd_linear_block(x, wf, no, out, T, n_in, n_out, o);
  }
  free(wf);
  return KD_OK;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* output triple o of the short-row W4A16 path: its three rows dequantized into L1 (this thread's stack), then the
 * direct tiles over every row of x */
__attribute__((target("avx2,fma"))) static void kd_w4_direct_col(const uint32_t *qp, kd_qs scales, int64_t n_words,
                                                              int64_t n_groups, int64_t wpg, const float *x, float *out,
                                                              int64_t T, int64_t n_in, int64_t n_out, int64_t o) {
  float wb[3 * KD_KC] __attribute__((aligned(64)));
  int O = n_out - o < 3 ? (int)(n_out - o) : 3;
  for (int i = 0; i < O; i++)
    kd_dequant_slice_avx2(qp + (o + i) * n_words, kd_qs_row(scales, (o + i) * n_groups), wb + i * KD_KC, 0, n_in, wpg);
  kd_linear_direct(x, n_in, wb, KD_KC, out + o, n_out, T, n_in, O);
}
#endif

/* the W4A16 linear over either kind of scales (kd_linear_w4a16: float32; kd_linear_w4a16_bf16_scales: BF16 bits) */
static int kd_linear_w4a16_q(const char *op, const float *x, const int32_t *packed, kd_qs scales, float *out,
                             int64_t T, int64_t n_in, int64_t n_out, int64_t group) {
  kd_clear_error();
  if (T < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "%s: negative size", op);
  if (group <= 0 || group % 8 != 0)
    return kd_fail(KD_EINVAL, "%s: group=%lld must be a positive multiple of 8", op, (long long)group);
  if (T == 0 || n_out == 0) return KD_OK;
  KD_CHECK_PTR(op, x);
  KD_CHECK_PTR(op, packed);
  if (!scales.f && !scales.h) return kd_fail(KD_EINVAL, "%s: scales is NULL", op);
  KD_CHECK_PTR(op, out);
  int64_t n_words = (n_in + 7) / 8, n_groups = (n_in + group - 1) / group, wpg = group / 8;
  const uint32_t *qp = (const uint32_t *)packed;
  int parallel = n_out * n_in >= KD_PARALLEL_MIN_WEIGHTS; /* each output still one thread's fixed-order dot */
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) {
    if (T <= 2 * KD_W4_SMALL_T && kd_host_avx512() && wpg % 2 == 0)
      return kd_linear_w4_small512(qp, scales, n_words, n_groups, wpg, x, out, T, n_in, n_out, parallel);
    /* AVX2: the fused kernel up to KD_W4_SMALL_MAX rows; for short rows the direct tiles below win from 4 rows
     * (n_in = 512: 0.88x at T = 5) and at any T below 512 elements (n_in = 128: 0.5-0.9x) */
    const int64_t fused_t = n_in > KD_KC || parallel ? KD_W4_SMALL_MAX : n_in >= 512 ? 3 : 1;
    if (T == 1 || (T <= fused_t && !kd_host_avx512()))
      return kd_w4_small_avx2(qp, scales, n_words, n_groups, wpg, x, out, T, n_in, n_out, parallel);
    if (kd_host_avx512()) {
      kd_wsrc src = {NULL, NULL, qp, scales, n_words, n_groups, wpg, n_in, n_out, 0};
      return kd_linear_512(&src, x, out, T, parallel);
    }
    if (n_in <= KD_KC && !parallel) { /* short rows: three rows dequantized into L1, then the direct tiles */
      int64_t n3 = (n_out + 2) / 3;
      if (kd_par_worth(T * n_in * n_out, n3)) { /* whole triples per thread, as kd_linear_direct */
#pragma omp parallel for schedule(static) num_threads(kd_threads())
        for (int64_t i = 0; i < n3; i++) kd_w4_direct_col(qp, scales, n_words, n_groups, wpg, x, out, T, n_in, n_out, 3 * i);
      } else {
        for (int64_t i = 0; i < n3; i++) kd_w4_direct_col(qp, scales, n_words, n_groups, wpg, x, out, T, n_in, n_out, 3 * i);
      }
      return KD_OK;
    }
    return kd_linear_multirow(x, NULL, NULL, qp, scales, n_words, n_groups, wpg, out, T, n_in, n_out, parallel);
  }
#endif
  if (T == 1) { /* GEMV: decode fused into the dot product */
    if (parallel) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
      for (int64_t o = 0; o < n_out; o++)
        out[o] = kd_dot_w4_generic(qp + o * n_words, kd_qs_row(scales, o * n_groups), x, n_in, wpg);
    } else {
      for (int64_t o = 0; o < n_out; o++)
        out[o] = kd_dot_w4_generic(qp + o * n_words, kd_qs_row(scales, o * n_groups), x, n_in, wpg);
    }
    return KD_OK;
  }
  /* T > 1: decode four rows at a time (L1-resident), then the f32 block kernel: same products, same lanes */
  float *w = (float *)malloc(sizeof(float) * (size_t)(4 * (n_in ? n_in : 1)));
  if (!w) return kd_fail(KD_ENOMEM, "kd_linear_w4a16: out of memory (in=%lld)", (long long)n_in);
  for (int64_t o = 0; o < n_out; o += 4) {
    int no = (int)(n_out - o < 4 ? n_out - o : 4);
    for (int i = 0; i < no; i++)
      kd_dequant_row(qp + (o + i) * n_words, kd_qs_row(scales, (o + i) * n_groups), w + i * n_in, n_in, wpg);
    kd_linear_block(x, w, no, out, T, n_in, n_out, o);
  }
  free(w);
  return KD_OK;
}

int kd_linear_w4a16(const float *x, const int32_t *packed, const float *scales, float *out, int64_t T,
                    int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  (void)stream;
  kd_qs s = {scales, NULL};
  return kd_linear_w4a16_q("kd_linear_w4a16", x, packed, s, out, T, n_in, n_out, group);
}

int kd_linear_w4a16_bf16_scales(const float *x, const int32_t *packed, const uint16_t *scales, float *out, int64_t T,
                                int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  (void)stream;
  kd_qs s = {NULL, scales};
  return kd_linear_w4a16_q("kd_linear_w4a16_bf16_scales", x, packed, s, out, T, n_in, n_out, group);
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
    float inv = kd_rms_inv(kd_sumsq(r, D), D, eps);
    for (int64_t d = 0; d < D; d++) out[t * D + d] = r[d] * inv * w[d];
  }
  return KD_OK;
}

/* out[i] = kd_silu_mul_cpu(gate[i], up[i]); eight at a time with AVX2 (the same operations per element) */
static void kd_silu_mul_span(const float *gate, const float *up, float *out, int64_t n) {
  int64_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) i = kd_silu_mul_avx2(gate, up, out, n);
#endif
  for (; i < n; i++) out[i] = kd_silu_mul_cpu(gate[i], up[i]);
}

/* p[i] = kd_expf(p[i]) for i < n (AVX2 eight at a time, same bits) */
void kd_exp_inplace(float *p, int64_t n) {
  int64_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) i = kd_exp_avx2(p, n);
#endif
  for (; i < n; i++) p[i] = kd_expf(p[i]);
}

int kd_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t I, void *stream) {
  (void)stream;
  kd_clear_error();
  if (T < 0 || I < 0) return kd_fail(KD_EINVAL, "kd_silu_mul: negative size");
  if (T == 0 || I == 0) return KD_OK;
  KD_CHECK_PTR("kd_silu_mul", gate);
  KD_CHECK_PTR("kd_silu_mul", up);
  KD_CHECK_PTR("kd_silu_mul", out);
  if (kd_par_worth(T * I * 8, T)) { /* element-wise (an exp ~ 8 multiply-adds): rows split, same bits */
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t t = 0; t < T; t++) kd_silu_mul_span(gate + t * I, up + t * I, out + t * I, I);
    return KD_OK;
  }
  kd_silu_mul_span(gate, up, out, T * I);
  return KD_OK;
}

/* ---- tree-verify MLA-absorb attention ------------------------------------------------------------------ */
KD_CLONES static void kd_axpy(float *y, float a, const float *x, int64_t n) {
  for (int64_t d = 0; d < n; d++) y[d] += a * x[d];
}

/* softmax of each of the H rows of p [H, n] in place: max, exp(x - max) summed in key order, divide */
static void kd_softmax_rows(float *p, int64_t H, int64_t n) {
  for (int64_t h = 0; h < H; h++) {
    float *ph = p + h * n, m = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
      if (ph[i] > m) m = ph[i];
    for (int64_t i = 0; i < n; i++) ph[i] = ph[i] - m;
    kd_exp_inplace(ph, n);
    for (int64_t i = 0; i < n; i++) sum += ph[i];
    for (int64_t i = 0; i < n; i++) ph[i] = ph[i] / sum;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* One query row of kd_mla_attention (AVX2): the scores of the cache prefix in direct register tiles (H query heads x
 * keys) over each run of contiguous key rows (a page, or several adjacent ones), the visible block keys one by one,
 * each dot exactly kd_dot's (a score does not depend on the run it is computed in);
 * softmax as the portable loop; then out[h] = sum_i p[h, i] kv_i[:L] with every element's adds in key order
 * (a multiply, then an add, as kd_axpy), eight lanes of one head's output at a time. */
__attribute__((target("avx2,fma"))) static void kd_mla_row_avx2(const float *qt, const float *kv, const int64_t *keys,
                                                             int64_t n, int64_t n_prefix, float *p, float *ot,
                                                             int64_t H, int64_t L, int64_t E, float scale) {
  int64_t np = n_prefix < n ? n_prefix : n;
  for (int64_t i = 0, j; i < np; i = j) { /* p[h * n + i], i < np: one direct call per contiguous run of keys */
    for (j = i + 1; j < np && keys[j] == keys[j - 1] + 1; j++) {
    }
    kd_linear_direct(qt, E, kv + keys[i] * E, E, p + i, n, H, E, j - i);
  }
  for (int64_t i = np; i < n; i++)
    for (int64_t h = 0; h < H; h++) p[h * n + i] = kd_dot_avx2(qt + h * E, kv + keys[i] * E, E);
  for (int64_t i = 0; i < H * n; i++) p[i] = p[i] * scale;
  kd_softmax_rows(p, H, n);
  for (int64_t h = 0; h < H; h++) {
    const float *ph = p + h * n;
    float *oh = ot + h * L;
    int64_t d = 0;
    for (; d + 32 <= L; d += 32) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; /* ot starts at +0, as the memset */
      for (int64_t i = 0; i < n; i++) {
        const float *kr = kv + keys[i] * E + d;
        __m256 w = _mm256_set1_ps(ph[i]);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(w, _mm256_loadu_ps(kr)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(w, _mm256_loadu_ps(kr + 8)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(w, _mm256_loadu_ps(kr + 16)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(w, _mm256_loadu_ps(kr + 24)));
      }
      _mm256_storeu_ps(oh + d, a0), _mm256_storeu_ps(oh + d + 8, a1);
      _mm256_storeu_ps(oh + d + 16, a2), _mm256_storeu_ps(oh + d + 24, a3);
    }
    for (; d < L; d++) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n; i++) acc = acc + ph[i] * kv[keys[i] * E + d];
      oh[d] = acc;
    }
  }
}
#endif

/* Query rows [t0, t1) of kd_mla_attention (scratch: keys [n_prefix + T], p [(n_prefix + T) * H]). Each row is a
 * computation of its own, so rows may be split between threads (kd_model_forward) with the same bits. keys[] holds
 * the visible rows' places in kv (through the page table when there is one): which page holds a row never changes
 * its bits. */
void kd_mla_attention_rows(const float *q, const float *kv, const int32_t *pages, int64_t page_rows,
                           const uint64_t *visibility, float *out, int64_t t0, int64_t t1, int64_t T, int64_t H,
                           int64_t L, int64_t R, int64_t n_prefix, float scale, int64_t *keys, float *p) {
  int64_t E = L + R, words = (T + 63) / 64;
  for (int64_t t = t0; t < t1; t++) {
    /* this query's visible keys, ascending position: the whole cache, then its visible block rows */
    int64_t n = 0;
    for (int64_t j = 0; j < n_prefix; j++) keys[n++] = pages ? kd_page_key(pages, page_rows, j) : j;
    for (int64_t k = 0; k < T; k++)
      if (visibility ? kd_visible(visibility + t * words, k) : k <= t)
        keys[n++] = pages ? kd_page_key(pages, page_rows, n_prefix + k) : n_prefix + k;
    const float *qt = q + t * H * E;
    float *ot = out + t * H * L;
    memset(ot, 0, sizeof(float) * (size_t)(H * L));
    if (n == 0) continue;
#if defined(__x86_64__) && defined(__GNUC__)
    if (kd_host_avx2()) { /* the same dots and sums as below, in register tiles */
      kd_mla_row_avx2(qt, kv, keys, n, n_prefix, p, ot, H, L, E, scale);
      continue;
    }
#endif
    /* key-major loops keep a key row in cache across the heads; each (t, h) still sees exactly the sequence
     * dot -> max -> exp -> sum -> weighted sum in key order, so the result does not depend on H or T */
    for (int64_t i = 0; i < n; i++) {
      const float *kr = kv + keys[i] * E;
      float r[4];
      int64_t h = 0;
      for (; h + 4 <= H; h += 4) { /* four heads per key load; each dot exactly kd_dot_f32 */
        kd_dot_4x1(qt + h * E, E, kr, E, r);
        for (int j = 0; j < 4; j++) p[(h + j) * n + i] = r[j] * scale;
      }
      for (; h < H; h++) p[h * n + i] = kd_dot(qt + h * E, kr, E) * scale;
    }
    kd_softmax_rows(p, H, n);
    for (int64_t i = 0; i < n; i++)
      for (int64_t h = 0; h < H; h++) kd_axpy(ot + h * L, p[h * n + i], kv + keys[i] * E, L);
  }
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
  int64_t S = n_prefix + T;
  int64_t *keys = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
  float *p = (float *)malloc(sizeof(float) * (size_t)(S * H)); /* [H, n] weights of one query row */
  if (!keys || !p) {
    free(keys);
    free(p);
    return kd_fail(KD_ENOMEM, "kd_mla_attention: out of memory (S=%lld, H=%lld)", (long long)S, (long long)H);
  }
  kd_mla_attention_rows(q, kv, NULL, 0, visibility, out, 0, T, T, H, L, R, n_prefix, scale, keys, p);
  free(keys);
  free(p);
  return KD_OK;
}

/* ---- fused MoE layer (float32 weights) ------------------------------------------------------------------
 * Routing arrays are host pointers in both builds. Slots t*k + j are grouped by expert (counting sort, slot
 * order kept); each expert runs gate/up/silu/down (kd_linear_f32 rows, so independent of which rows share the
 * call) over its gathered rows; then per token out = (((0 + w_0 y_0) + w_1 y_1) + ...) + shared(x). */
int kd_moe_f32(const float *x, const int32_t *experts, const float *weights, const float *const *gate,
               const float *const *up, const float *const *down, int64_t n_experts, const float *shared_gate,
               const float *shared_up, const float *shared_down, float *out, int64_t T, int64_t D, int64_t I,
               int64_t Is, int64_t k, void *stream) {
  (void)stream;
  kd_clear_error();
  int rc = kd_moe_check(x, experts, weights, gate, up, down, n_experts, shared_gate, shared_up, shared_down, out, T,
                        D, I, Is, k);
  if (rc || T == 0) return rc;
  int has_shared = shared_gate != NULL;
  int64_t S = T * k;
  int64_t inter = I > Is ? I : Is, rows = S > T ? S : T;
  int64_t *start = (int64_t *)calloc((size_t)n_experts + 1, sizeof(int64_t));
  int64_t *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)(S ? S : 1)); /* slot -> sorted position */
  float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (2 * D + 2 * inter)));
  if (!start || !pos || !buf) {
    free(start), free(pos), free(buf);
    return kd_fail(KD_ENOMEM, "kd_moe_f32: out of memory (T=%lld, k=%lld)", (long long)T, (long long)k);
  }
  float *xs = buf, *ys = xs + rows * D, *g = ys + rows * D, *u = g + rows * inter;
  for (int64_t i = 0; i < S; i++) start[experts[i] + 1]++;
  for (int64_t e = 0; e < n_experts; e++) start[e + 1] += start[e];
  for (int64_t i = 0; i < S; i++) { /* stable: slots of one expert in slot order */
    int64_t p = start[experts[i]]++;
    pos[i] = p;
    memcpy(xs + p * D, x + (i / k) * D, sizeof(float) * (size_t)D);
  }
  for (int64_t e = n_experts; e > 0; e--) start[e] = start[e - 1]; /* back to the group starts */
  start[0] = 0;
  for (int64_t e = 0; e < n_experts; e++) {
    int64_t p0 = start[e], n = start[e + 1] - p0;
    if (n == 0) continue;
    kd_linear_f32(xs + p0 * D, gate[e], g, n, D, I, NULL);
    kd_linear_f32(xs + p0 * D, up[e], u, n, D, I, NULL);
    kd_silu_mul(g, u, g, n, I, NULL);
    kd_linear_f32(g, down[e], ys + p0 * D, n, I, D, NULL);
  }
  if (has_shared) { /* into xs, free again: shared(x) for every token */
    kd_linear_f32(x, shared_gate, g, T, D, Is, NULL);
    kd_linear_f32(x, shared_up, u, T, D, Is, NULL);
    kd_silu_mul(g, u, g, T, Is, NULL);
    kd_linear_f32(g, shared_down, xs, T, Is, D, NULL);
  }
  kd_moe_combine(out, ys, pos, weights, has_shared ? xs : NULL, T, k, D);
  free(start), free(pos), free(buf);
  kd_clear_error();
  return KD_OK;
}

/* ---- per-head linear (MLA absorb: q_nope -> latent, latent -> v) -------------------------------------- */
/* one weight row of kd_head_linear against one row of x: float32 w, or BF16 w16 (the same fused multiply-adds on the
 * widened values: kd_dot_f32's lanes, so kd_head_linear_bf16 gives kd_head_linear_f32's bits) */
static float kd_head_dot(const float *w, const uint16_t *w16, const float *x, int64_t n) {
  if (!w16) return kd_dot(w, x, n);
#if defined(__x86_64__) && defined(__GNUC__)
  if (kd_host_avx2()) return kd_dot_bf16_avx2(w16, x, n);
#endif
  float acc[KD_LANES] = {0};
  for (int64_t k = 0; k < n; k++) {
    uint32_t b = (uint32_t)w16[k] << 16;
    float wk;
    memcpy(&wk, &b, 4);
    acc[k % KD_LANES] = fmaf(wk, x[k], acc[k % KD_LANES]);
  }
  return kd_lanes_sum(acc);
}

/* head h of kd_head_linear for all T rows, output by output (kd_dot_4x1 / kd_dot, or their BF16 forms) */
static void kd_head_dots(const float *x, int64_t xs_t, int64_t xs_h, const float *w, const uint16_t *w16, float *out,
                         int64_t os_t, int64_t os_h, int64_t T, int64_t h, int64_t n_in, int64_t n_out) {
  const float *wh = w ? w + h * n_out * n_in : NULL;
  const uint16_t *wh16 = w16 ? w16 + h * n_out * n_in : NULL;
  float r[4];
#if defined(__x86_64__) && defined(__GNUC__)
  const int bf_avx2 = wh16 && kd_host_avx2();
#endif
  for (int64_t t = 0; t < T; t++) {
    const float *xr = x + t * xs_t + h * xs_h;
    float *orow = out + t * os_t + h * os_h;
    int64_t o = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    for (; bf_avx2 && o + 4 <= n_out; o += 4) {
      kd_dot_4x1_bf16_avx2(wh16 + o * n_in, n_in, xr, n_in, r);
      for (int j = 0; j < 4; j++) orow[o + j] = r[j];
    }
#endif
    for (; wh && o + 4 <= n_out; o += 4) {
      kd_dot_4x1(wh + o * n_in, n_in, xr, n_in, r);
      for (int j = 0; j < 4; j++) orow[o + j] = r[j];
    }
    for (; o < n_out; o++) orow[o] = kd_head_dot(wh ? wh + o * n_in : NULL, wh16 ? wh16 + o * n_in : NULL, xr, n_in);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* head h of kd_head_linear for T >= 2 rows, n_in <= KD_KC: the direct register tiles over the rows (float32 rows read
 * in place; BF16 rows widened three at a time into L1, as kd_bf16_direct_col) */
__attribute__((target("avx2,fma"))) static void kd_head_direct(const float *x, int64_t xs_t, int64_t xs_h,
                                                             const float *w, const uint16_t *w16, float *out,
                                                             int64_t os_t, int64_t os_h, int64_t T, int64_t h,
                                                             int64_t n_in, int64_t n_out) {
  const float *xh = x + h * xs_h;
  float *oh = out + h * os_h;
  if (w) {
    kd_linear_direct(xh, xs_t, w + h * n_out * n_in, n_in, oh, os_t, T, n_in, n_out);
    return;
  }
  float wb[3 * KD_KC] __attribute__((aligned(64)));
  for (int64_t o = 0; o < n_out; o += 3) {
    int O = n_out - o < 3 ? (int)(n_out - o) : 3;
    for (int i = 0; i < O; i++) kd_bf16_widen_avx2(w16 + (h * n_out + o + i) * n_in, wb + i * KD_KC, n_in);
    kd_linear_direct(xh, xs_t, wb, KD_KC, oh + o, os_t, T, n_in, O);
  }
}
#endif

/* kd_head_linear_f32 (w) / kd_head_linear_bf16 (w16): whole heads per thread where worth it (an output's dot is the
 * same either way). One row (a decode step: K2's 64 heads x 512 x 128 weights per call, 16.8 MB float32, 8.4 MB
 * BF16) streams each head's rows; T >= 2 short rows run the register tiles. */
static int kd_head_linear(const char *op, const float *x, int64_t xs_t, int64_t xs_h, const float *w,
                          const uint16_t *w16, float *out, int64_t os_t, int64_t os_h, int64_t T, int64_t H,
                          int64_t n_in, int64_t n_out) {
  kd_clear_error();
  if (T < 0 || H < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "%s: negative size", op);
  if (T == 0 || H == 0 || n_out == 0) return KD_OK;
  KD_CHECK_PTR(op, x);
  if (!w && !w16) return kd_fail(KD_EINVAL, "%s: w is NULL", op);
  KD_CHECK_PTR(op, out);
  const int par = kd_par_worth(T * H * n_in * n_out, H);
#if defined(__x86_64__) && defined(__GNUC__)
  if (T >= 2 && n_in <= KD_KC && kd_host_avx2()) {
    if (par) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
      for (int64_t h = 0; h < H; h++) kd_head_direct(x, xs_t, xs_h, w, w16, out, os_t, os_h, T, h, n_in, n_out);
    } else {
      for (int64_t h = 0; h < H; h++) kd_head_direct(x, xs_t, xs_h, w, w16, out, os_t, os_h, T, h, n_in, n_out);
    }
    return KD_OK;
  }
#endif
  if (par) {
#pragma omp parallel for schedule(static) num_threads(kd_threads())
    for (int64_t h = 0; h < H; h++) kd_head_dots(x, xs_t, xs_h, w, w16, out, os_t, os_h, T, h, n_in, n_out);
  } else {
    for (int64_t h = 0; h < H; h++) kd_head_dots(x, xs_t, xs_h, w, w16, out, os_t, os_h, T, h, n_in, n_out);
  }
  return KD_OK;
}

int kd_head_linear_f32(const float *x, int64_t xs_t, int64_t xs_h, const float *w, float *out, int64_t os_t,
                       int64_t os_h, int64_t T, int64_t H, int64_t n_in, int64_t n_out, void *stream) {
  (void)stream;
  return kd_head_linear("kd_head_linear_f32", x, xs_t, xs_h, w, NULL, out, os_t, os_h, T, H, n_in, n_out);
}

int kd_head_linear_bf16(const float *x, int64_t xs_t, int64_t xs_h, const uint16_t *w, float *out, int64_t os_t,
                        int64_t os_h, int64_t T, int64_t H, int64_t n_in, int64_t n_out, void *stream) {
  (void)stream;
  return kd_head_linear("kd_head_linear_bf16", x, xs_t, xs_h, NULL, w, out, os_t, os_h, T, H, n_in, n_out);
}
