/* Host-only C (both builds' host code): a deterministic expf, scalar and AVX2 with the same bits. Device code
 * uses the device's expf. */
#ifndef KD_EXP_H
#define KD_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for the host code's silu, sigmoid, softmaxes and the draft top-k's log-softmax: Cephes' expf (range reduction by ln 2 in two parts, a
 * degree-6 polynomial, times 2^n as two exact power-of-two products so that subnormal results round once), within
 * 2 ulp of libm. One sequence of IEEE operations with no contraction (-ffp-contract=off): kd_expf8_avx2 runs the
 * same operations on eight lanes, so the AVX2 and portable loops agree bit for bit, and libm's scalar expf (a
 * function call per element, 10 % of a tree verify in perf) is out of the hot loops. NaN stays NaN; overflow is
 * +inf past ln(FLT_MAX); below -103.97 (under half the least subnormal) the result is +0. */
/* 1 when the AVX2 + FMA paths run (the CPU has them and KDTREE_CPU_GENERIC=1 is not set); kd_common.c */
__attribute__((visibility("hidden"))) int kd_host_avx2(void);
/* 1 when the CPU build's AVX-512 linear kernels run (kd_common.c: AVX-512 F/BW/VL/DQ, KDTREE_CPU_ISA != avx2) */
__attribute__((visibility("hidden"))) int kd_host_avx512(void);

#define KD_EXP_HI 88.72283935546875f
#define KD_EXP_LO -103.97207641601562f
#define KD_EXP_LOG2E 1.44269504088896341f
#define KD_EXP_C1 0.693359375f
#define KD_EXP_C2 -2.12194440e-4f
#define KD_EXP_P0 1.9875691500E-4f
#define KD_EXP_P1 1.3981999507E-3f
#define KD_EXP_P2 8.3334519073E-3f
#define KD_EXP_P3 4.1665795894E-2f
#define KD_EXP_P4 1.6666665459E-1f
#define KD_EXP_P5 5.0000001201E-1f

static inline float kd_pow2i(int32_t n) { /* 2^n for -126 <= n <= 127 */
  uint32_t b = (uint32_t)(n + 127) << 23;
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

static inline float kd_expf(float x) {
  if (x != x) return x;
  if (x > KD_EXP_HI) return INFINITY;
  if (x < KD_EXP_LO) return 0.0f;
  float fx = floorf(x * KD_EXP_LOG2E + 0.5f); /* -150 <= fx <= 128 */
  float r = x - fx * KD_EXP_C1;
  r = r - fx * KD_EXP_C2;
  float z = r * r, y = KD_EXP_P0;
  y = y * r + KD_EXP_P1;
  y = y * r + KD_EXP_P2;
  y = y * r + KD_EXP_P3;
  y = y * r + KD_EXP_P4;
  y = y * r + KD_EXP_P5;
  y = y * z + r + 1.0f;
  int32_t n = (int32_t)fx, n1 = n >> 1; /* arithmetic shift: floor(n / 2) */
  return y * kd_pow2i(n1) * kd_pow2i(n - n1);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx2"))) static inline __m256i kd_pow2i8_avx2(__m256i n) {
  return _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
}

/* kd_expf on eight lanes: the same operations in the same order */
__attribute__((target("avx2"))) static inline __m256 kd_expf8_avx2(__m256 x) {
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(KD_EXP_LOG2E)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(KD_EXP_C1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(KD_EXP_C2)));
  __m256 z = _mm256_mul_ps(r, r), y = _mm256_set1_ps(KD_EXP_P0);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(KD_EXP_P1));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(KD_EXP_P2));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(KD_EXP_P3));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(KD_EXP_P4));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(KD_EXP_P5));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0f));
  /* fx of an out-of-range lane may be huge: clamp it before the integer conversion (that lane is replaced below) */
  __m256i n = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(fx, _mm256_set1_ps(-150.0f)), _mm256_set1_ps(128.0f)));
  __m256i n1 = _mm256_srai_epi32(n, 1);
  y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(kd_pow2i8_avx2(n1))),
                    _mm256_castsi256_ps(kd_pow2i8_avx2(_mm256_sub_epi32(n, n1))));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(KD_EXP_HI), _CMP_GT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(KD_EXP_LO), _CMP_LT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); /* NaN stays NaN */
}
#endif
#endif /* KD_EXP_H */
