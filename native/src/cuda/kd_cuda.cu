/* CUDA build of the kdtree kernels (libkdtree_cuda.so): device pointers, a cudaStream_t passed as void*.
 *
 *   make -C native cuda            # sm_90 SASS + compute_90 PTX, cudart linked statically
 *   native/gpu_check.sh            # parity suite (pytest -m gpu tests/native) + kernel benchmarks on a GPU
 *
 * Batch invariance: every output element is produced by one warp (linear) or one block (rms_norm, attention)
 * whose reduction order depends only on the row length (n_in, D, the visible key list), never on T, on the grid
 * size or on pointer alignment; --fmad=false keeps the rounding fixed by the source. The per-element math
 * (int4 decode, silu, rms scale, visibility bit) is shared with the CPU build through kd_common.h (KD_HD).
 * Tree ops run on the host (kd_common.c), on host pointers, exactly as in the CPU build.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include "kd_common.h"

#define KD_WARPS 8  /* warps per block for the per-output kernels */

static int kd_devices = -1;
static char kd_dev_reason[256];

extern "C" const char *kd_backend(void) { return "cuda"; }

/* backend.threads is the CPU build's (OpenMP); the CUDA build's host work is the tree ops, one thread */
extern "C" int kd_set_threads(int n) {
  kd_clear_error();
  if (n < 0) return kd_fail(KD_EINVAL, "kd_set_threads: n=%d must be >= 0 (0 = the OpenMP default)", n);
  return KD_OK;
}

extern "C" int kd_threads(void) { return 1; }

extern "C" int kd_device_count(void) {
  kd_clear_error();
  if (kd_devices < 0) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      snprintf(kd_dev_reason, sizeof kd_dev_reason, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
      cudaGetLastError();
      n = 0;
    } else if (n == 0) {
      snprintf(kd_dev_reason, sizeof kd_dev_reason, "cudaGetDeviceCount: 0 devices");
    }
    kd_devices = n;
  }
  if (kd_devices == 0) kd_fail(KD_ENODEV, "%s", kd_dev_reason);
  return kd_devices;
}

static int kd_need_device(const char *op) {
  if (kd_device_count() > 0) {
    kd_clear_error();
    return KD_OK;
  }
  return kd_fail(KD_ENODEV, "%s: no CUDA device (%s)", op, kd_dev_reason);
}

static int kd_cuda_status(const char *op) {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? KD_OK : kd_fail(KD_ECUDA, "%s: %s", op, cudaGetErrorString(e));
}

#define KD_STREAM(s) ((cudaStream_t)(s))

/* ---- memory ------------------------------------------------------------------------------------------- */
extern "C" int kd_malloc(void **ptr, size_t bytes) {
  int rc = kd_need_device("kd_malloc");
  if (rc) return rc;
  KD_CHECK_PTR("kd_malloc", ptr);
  cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 1);
  if (e != cudaSuccess) cudaGetLastError(); /* reported here, not by the next launch's check */
  return e == cudaSuccess ? KD_OK : kd_fail(KD_ENOMEM, "kd_malloc(%zu bytes): %s", bytes, cudaGetErrorString(e));
}

extern "C" int kd_free(void *ptr) {
  if (!ptr || kd_devices <= 0) return KD_OK;
  cudaError_t e = cudaFree(ptr);
  return e == cudaSuccess ? KD_OK : kd_fail(KD_ECUDA, "kd_free: %s", cudaGetErrorString(e));
}

static int kd_copy(void *dst, const void *src, size_t bytes, void *stream, cudaMemcpyKind kind, const char *op) {
  int rc = kd_need_device(op);
  if (rc) return rc;
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, KD_STREAM(stream));
  if (e == cudaSuccess) e = cudaStreamSynchronize(KD_STREAM(stream)); /* host buffer is ready on return */
  if (e != cudaSuccess) cudaGetLastError();
  return e == cudaSuccess ? KD_OK : kd_fail(KD_ECUDA, "%s(%zu bytes): %s", op, bytes, cudaGetErrorString(e));
}

extern "C" int kd_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream) {
  return kd_copy(dst, src, bytes, stream, cudaMemcpyHostToDevice, "kd_memcpy_h2d");
}
extern "C" int kd_memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream) {
  return kd_copy(dst, src, bytes, stream, cudaMemcpyDeviceToHost, "kd_memcpy_d2h");
}
extern "C" int kd_synchronize(void *stream) {
  int rc = kd_need_device("kd_synchronize");
  if (rc) return rc;
  cudaError_t e = cudaStreamSynchronize(KD_STREAM(stream));
  return e == cudaSuccess ? KD_OK : kd_fail(KD_ECUDA, "kd_synchronize: %s", cudaGetErrorString(e));
}

/* ---- warp / block reductions (fixed trees) ------------------------------------------------------------ */
__device__ __forceinline__ float kd_warp_sum(float v) {
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float kd_load(const float *p) { return *p; }
__device__ __forceinline__ float kd_load(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ float kd_load(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

/* ---- linear: one warp per output (t, o); lane l sums elements k = 128 i + 4 l + j (j = 0..3) in order -------- */
__global__ void kd_linear_f32_kernel(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ out,
                                     int64_t n_in, int64_t n_out) {
  int lane = threadIdx.x & 31;
  int64_t o = (int64_t)blockIdx.x * KD_WARPS + (threadIdx.x >> 5), t = blockIdx.y;
  if (o >= n_out) return;
  const float *wr = w + o * n_in, *xr = x + t * n_in;
  float acc = 0.0f;
  for (int64_t k0 = 4 * lane; k0 < n_in; k0 += 128)
    for (int j = 0; j < 4 && k0 + j < n_in; j++) acc += wr[k0 + j] * xr[k0 + j];
  acc = kd_warp_sum(acc);
  if (lane == 0) out[t * n_out + o] = acc;
}

extern "C" int kd_linear_f32(const float *x, const float *w, float *out, int64_t T, int64_t n_in, int64_t n_out,
                             void *stream) {
  int rc = kd_need_device("kd_linear_f32");
  if (rc) return rc;
  if (T < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "kd_linear_f32: negative size");
  if (T == 0 || n_out == 0) return KD_OK;
  if (T > 65535) return kd_fail(KD_EINVAL, "kd_linear_f32: T=%lld > 65535 rows per call", (long long)T);
  KD_CHECK_PTR("kd_linear_f32", x);
  KD_CHECK_PTR("kd_linear_f32", w);
  KD_CHECK_PTR("kd_linear_f32", out);
  dim3 grid((unsigned)((n_out + KD_WARPS - 1) / KD_WARPS), (unsigned)T);
  kd_linear_f32_kernel<<<grid, 32 * KD_WARPS, 0, KD_STREAM(stream)>>>(x, w, out, n_in, n_out);
  return kd_cuda_status("kd_linear_f32");
}

/* BF16 weights: kd_linear_f32_kernel with the weight widened exactly at the load (the same bits) */
__global__ void kd_linear_bf16_kernel(const float *__restrict__ x, const __nv_bfloat16 *__restrict__ w,
                                      float *__restrict__ out, int64_t n_in, int64_t n_out) {
  int lane = threadIdx.x & 31;
  int64_t o = (int64_t)blockIdx.x * KD_WARPS + (threadIdx.x >> 5), t = blockIdx.y;
  if (o >= n_out) return;
  const __nv_bfloat16 *wr = w + o * n_in;
  const float *xr = x + t * n_in;
  float acc = 0.0f;
  for (int64_t k0 = 4 * lane; k0 < n_in; k0 += 128)
    for (int j = 0; j < 4 && k0 + j < n_in; j++) acc += kd_load(wr + k0 + j) * xr[k0 + j];
  acc = kd_warp_sum(acc);
  if (lane == 0) out[t * n_out + o] = acc;
}

extern "C" int kd_linear_bf16(const float *x, const uint16_t *w, float *out, int64_t T, int64_t n_in, int64_t n_out,
                              void *stream) {
  int rc = kd_need_device("kd_linear_bf16");
  if (rc) return rc;
  if (T < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "kd_linear_bf16: negative size");
  if (T == 0 || n_out == 0) return KD_OK;
  if (T > 65535) return kd_fail(KD_EINVAL, "kd_linear_bf16: T=%lld > 65535 rows per call", (long long)T);
  KD_CHECK_PTR("kd_linear_bf16", x);
  KD_CHECK_PTR("kd_linear_bf16", w);
  KD_CHECK_PTR("kd_linear_bf16", out);
  dim3 grid((unsigned)((n_out + KD_WARPS - 1) / KD_WARPS), (unsigned)T);
  kd_linear_bf16_kernel<<<grid, 32 * KD_WARPS, 0, KD_STREAM(stream)>>>(x, (const __nv_bfloat16 *)w, out, n_in, n_out);
  return kd_cuda_status("kd_linear_bf16");
}

/* ---- W4A16: one warp per output, kd_linear_f32_kernel's lane order (lane l sums k = 128 i + 4 l + j in order),
 * so the result is exactly kd_linear_f32 on the dequantized weight (kdtree.h). k and k+1..k+3 share a word half
 * and a group (group % 8 == 0). */
template <typename X, typename S>
__global__ void kd_w4a16_kernel(const X *__restrict__ x, const uint32_t *__restrict__ packed,
                                const S *__restrict__ scales, float *__restrict__ out, int64_t n_in,
                                int64_t n_out, int64_t words_per_group) {
  int lane = threadIdx.x & 31;
  int64_t o = (int64_t)blockIdx.x * KD_WARPS + (threadIdx.x >> 5), t = blockIdx.y;
  if (o >= n_out) return;
  int64_t n_words = (n_in + 7) / 8, n_groups = (n_in + 8 * words_per_group - 1) / (8 * words_per_group);
  const uint32_t *wr = packed + o * n_words;
  const S *sr = scales + o * n_groups; /* float32 or BF16 (widened exactly) */
  const X *xr = x + t * n_in;
  float acc = 0.0f;
  for (int64_t k0 = 4 * lane; k0 < n_in; k0 += 128) {
    uint32_t u = wr[k0 / 8];
    float s = kd_load(sr + k0 / (8 * words_per_group));
    for (int j = 0; j < 4 && k0 + j < n_in; j++)
      acc += kd_int4_weight(u, (int)(k0 % 8) + j, s) * kd_load(xr + k0 + j);
  }
  acc = kd_warp_sum(acc);
  if (lane == 0) out[t * n_out + o] = acc;
}

template <typename X, typename S>
static int kd_w4a16_launch(const char *op, const X *x, const int32_t *packed, const S *scales, float *out,
                           int64_t T, int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  int rc = kd_need_device(op);
  if (rc) return rc;
  if (T < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "%s: negative size", op);
  if (group <= 0 || group % 8 != 0)
    return kd_fail(KD_EINVAL, "%s: group=%lld must be a positive multiple of 8", op, (long long)group);
  if (T == 0 || n_out == 0) return KD_OK;
  if (T > 65535) return kd_fail(KD_EINVAL, "%s: T=%lld > 65535 rows per call", op, (long long)T);
  if (!x || !packed || !scales || !out) return kd_fail(KD_EINVAL, "%s: NULL pointer", op);
  dim3 grid((unsigned)((n_out + KD_WARPS - 1) / KD_WARPS), (unsigned)T);
  kd_w4a16_kernel<X, S><<<grid, 32 * KD_WARPS, 0, KD_STREAM(stream)>>>(x, (const uint32_t *)packed, scales, out, n_in,
                                                                     n_out, group / 8);
  return kd_cuda_status(op);
}

extern "C" int kd_linear_w4a16(const float *x, const int32_t *packed, const float *scales, float *out, int64_t T,
                               int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  return kd_w4a16_launch<float, float>("kd_linear_w4a16", x, packed, scales, out, T, n_in, n_out, group, stream);
}

/* BF16 scales (device BF16 bits), read and widened exactly in the kernel: the same result as kd_linear_w4a16 on the
 * widened scales */
extern "C" int kd_linear_w4a16_bf16_scales(const float *x, const int32_t *packed, const uint16_t *scales, float *out,
                                           int64_t T, int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  return kd_w4a16_launch<float, __nv_bfloat16>("kd_linear_w4a16_bf16_scales", x, packed,
                                               (const __nv_bfloat16 *)scales, out, T, n_in, n_out, group, stream);
}

extern "C" int kd_linear_w4a16_half(const void *x, int act_dtype, const int32_t *packed, const float *scales,
                                    float *out, int64_t T, int64_t n_in, int64_t n_out, int64_t group, void *stream) {
  if (act_dtype == KD_DTYPE_F16)
    return kd_w4a16_launch<__half, float>("kd_linear_w4a16_half", (const __half *)x, packed, scales, out, T, n_in, n_out,
                                   group, stream);
  if (act_dtype == KD_DTYPE_BF16)
    return kd_w4a16_launch<__nv_bfloat16, float>("kd_linear_w4a16_half", (const __nv_bfloat16 *)x, packed, scales, out, T,
                                          n_in, n_out, group, stream);
  return kd_fail(KD_EINVAL, "kd_linear_w4a16_half: act_dtype=%d; use KD_DTYPE_F16 (1) or KD_DTYPE_BF16 (2)",
                 act_dtype);
}

/* ---- rms_norm: one block per row, thread i sums d = i + 256 k in order, fixed shared-memory tree ------------- */
#define KD_NORM_THREADS 256
__global__ void kd_rms_norm_kernel(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ out,
                                   int64_t D, float eps) {
  __shared__ float part[KD_NORM_THREADS];
  const float *r = x + blockIdx.x * D;
  float acc = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += KD_NORM_THREADS) acc += r[d] * r[d];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = KD_NORM_THREADS / 2; s >= 1; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  float inv = kd_rms_inv(part[0], D, eps);
  for (int64_t d = threadIdx.x; d < D; d += KD_NORM_THREADS) out[blockIdx.x * D + d] = r[d] * inv * w[d];
}

extern "C" int kd_rms_norm(const float *x, const float *w, float *out, int64_t T, int64_t D, float eps, void *stream) {
  int rc = kd_need_device("kd_rms_norm");
  if (rc) return rc;
  if (T < 0 || D <= 0) return kd_fail(KD_EINVAL, "kd_rms_norm: bad size T=%lld D=%lld", (long long)T, (long long)D);
  if (T == 0) return KD_OK;
  KD_CHECK_PTR("kd_rms_norm", x);
  KD_CHECK_PTR("kd_rms_norm", w);
  KD_CHECK_PTR("kd_rms_norm", out);
  kd_rms_norm_kernel<<<(unsigned)T, KD_NORM_THREADS, 0, KD_STREAM(stream)>>>(x, w, out, D, eps);
  return kd_cuda_status("kd_rms_norm");
}

/* ---- silu_mul: elementwise ----------------------------------------------------------------------------- */
__global__ void kd_silu_mul_kernel(const float *__restrict__ g, const float *__restrict__ u, float *__restrict__ out,
                                   int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = kd_silu_mul1(g[i], u[i]);
}

extern "C" int kd_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t I, void *stream) {
  int rc = kd_need_device("kd_silu_mul");
  if (rc) return rc;
  if (T < 0 || I < 0) return kd_fail(KD_EINVAL, "kd_silu_mul: negative size");
  int64_t n = T * I;
  if (n == 0) return KD_OK;
  KD_CHECK_PTR("kd_silu_mul", gate);
  KD_CHECK_PTR("kd_silu_mul", up);
  KD_CHECK_PTR("kd_silu_mul", out);
  int64_t blocks = (n + 255) / 256;
  kd_silu_mul_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, KD_STREAM(stream)>>>(gate, up, out, n);
  return kd_cuda_status("kd_silu_mul");
}

/* ---- tree-verify MLA attention: one block per (t, h), online softmax over chunks of the visible key list ----
 * The visible keys (cache rows, then the query's visible block rows, ascending) are cut into chunks of
 * KD_ATT_CHUNK by their index in that list, so the same context gives the same chunks and the same rounding
 * whether it sits in the cache (AR step) or in the verify block (tree node). */
#define KD_ATT_THREADS 128
#define KD_ATT_CHUNK 64
#define KD_ATT_MAX_DIMS 8   /* L <= KD_ATT_THREADS * KD_ATT_MAX_DIMS = 1024 */

/* Word w of query t's visibility row, bits past key T-1 cleared (padding is not part of the mask). */
__device__ __forceinline__ uint64_t kd_vis_word(const uint64_t *vis, int64_t t, int64_t w, int64_t T) {
  const int64_t words = (T + 63) / 64;
  uint64_t bits = vis[t * words + w];
  if (w == words - 1 && (T & 63)) bits &= ((uint64_t)1 << (T & 63)) - 1;
  return bits;
}

__global__ void kd_mla_attention_kernel(const float *__restrict__ q, const float *__restrict__ kv,
                                        const uint64_t *__restrict__ vis, float *__restrict__ out, int64_t T,
                                        int64_t H, int64_t L, int64_t R, int64_t P, float scale) {
  __shared__ int64_t keypos[KD_ATT_CHUNK];
  __shared__ float e[KD_ATT_CHUNK];
  __shared__ float stat[3]; /* running max, running sum, rescale factor of this chunk */
  const int64_t t = blockIdx.x / H, h = blockIdx.x % H, E = L + R, words = (T + 63) / 64;
  const float *qh = q + (t * H + h) * E;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = KD_ATT_THREADS / 32;
  int64_t nblock = 0; /* visible block keys of this query */
  if (vis) {
    for (int64_t w = 0; w < words; w++) nblock += __popcll(kd_vis_word(vis, t, w, T));
  } else {
    nblock = t + 1;
  }
  const int64_t n = P + nblock;
  float acc[KD_ATT_MAX_DIMS];
  for (int i = 0; i < KD_ATT_MAX_DIMS; i++) acc[i] = 0.0f;
  if (tid == 0) {
    stat[0] = -INFINITY;
    stat[1] = 0.0f;
  }
  int64_t cur_word = 0;    /* thread 0's cursor over the visibility row */
  uint64_t cur_bits = vis ? kd_vis_word(vis, t, 0, T) : 0;
  int64_t causal_next = 0; /* thread 0's cursor for the causal case */
  for (int64_t c0 = 0; c0 < n; c0 += KD_ATT_CHUNK) {
    const int m = (int)(n - c0 < KD_ATT_CHUNK ? n - c0 : KD_ATT_CHUNK);
    if (tid == 0) {
      for (int i = 0; i < m; i++) {
        int64_t v = c0 + i;
        if (v < P) {
          keypos[i] = v;
        } else if (!vis) {
          keypos[i] = P + causal_next++;
        } else {
          while (cur_bits == 0) cur_bits = kd_vis_word(vis, t, ++cur_word, T);
          keypos[i] = P + cur_word * 64 + __ffsll((long long)cur_bits) - 1;
          cur_bits &= cur_bits - 1;
        }
      }
    }
    __syncthreads();
    /* scores: warp w takes chunk keys w, w + nwarps, ...; lane l sums elements d = l + 32 k in order */
    for (int i = warp; i < m; i += nwarps) {
      const float *kr = kv + keypos[i] * E;
      float s = 0.0f;
      for (int64_t d = lane; d < E; d += 32) s += qh[d] * kr[d];
      s = kd_warp_sum(s);
      if (lane == 0) e[i] = s * scale;
    }
    __syncthreads();
    if (tid == 0) { /* chunk max, rescale, weights and their sum, in key order */
      float mx = stat[0];
      for (int i = 0; i < m; i++) mx = fmaxf(mx, e[i]);
      float alpha = expf(stat[0] - mx); /* exp(-inf) = 0 on the first chunk */
      float sum = stat[1] * alpha;
      for (int i = 0; i < m; i++) {
        e[i] = expf(e[i] - mx);
        sum += e[i];
      }
      stat[0] = mx;
      stat[1] = sum;
      stat[2] = alpha;
    }
    __syncthreads();
    const float alpha = stat[2];
    for (int k = 0; k < KD_ATT_MAX_DIMS; k++) {
      int64_t d = tid + (int64_t)k * KD_ATT_THREADS;
      if (d >= L) break;
      float a = acc[k] * alpha;
      for (int i = 0; i < m; i++) a += e[i] * kv[keypos[i] * E + d];
      acc[k] = a;
    }
    __syncthreads();
  }
  __syncthreads(); /* n == 0: no chunk ran, stat[] was written by thread 0 only */
  float *o = out + (t * H + h) * L;
  const float total = stat[1];
  for (int k = 0; k < KD_ATT_MAX_DIMS; k++) {
    int64_t d = tid + (int64_t)k * KD_ATT_THREADS;
    if (d >= L) break;
    o[d] = n ? acc[k] / total : 0.0f;
  }
}

extern "C" int kd_mla_attention(const float *q, const float *kv, const uint64_t *visibility, float *out, int64_t T,
                                int64_t H, int64_t L, int64_t R, int64_t n_prefix, float scale, void *stream) {
  int rc = kd_need_device("kd_mla_attention");
  if (rc) return rc;
  if (T < 0 || H < 0 || L < 0 || R < 0 || n_prefix < 0) return kd_fail(KD_EINVAL, "kd_mla_attention: negative size");
  if (L > KD_ATT_THREADS * KD_ATT_MAX_DIMS)
    return kd_fail(KD_EINVAL, "kd_mla_attention: kv_lora L=%lld > %d supported by the CUDA kernel", (long long)L,
                   KD_ATT_THREADS * KD_ATT_MAX_DIMS);
  if (T == 0 || H == 0) return KD_OK;
  if (T * H > 2147483647LL) return kd_fail(KD_EINVAL, "kd_mla_attention: T*H too large");
  KD_CHECK_PTR("kd_mla_attention", q);
  KD_CHECK_PTR("kd_mla_attention", kv);
  KD_CHECK_PTR("kd_mla_attention", out);
  kd_mla_attention_kernel<<<(unsigned)(T * H), KD_ATT_THREADS, 0, KD_STREAM(stream)>>>(q, kv, visibility, out, T, H, L,
                                                                                      R, n_prefix, scale);
  return kd_cuda_status("kd_mla_attention");
}

/* ---- fused MoE layer (float32 weights): grouping on the host, experts through the kernels above --------- */
__global__ void kd_gather_rows_kernel(const float *__restrict__ x, const int32_t *__restrict__ src,
                                      float *__restrict__ dst, int64_t n, int64_t D) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * D; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = x[(int64_t)src[i / D] * D + i % D];
}

/* out[t, d] = (((0 + w[t,0] y[pos[t,0], d]) + w[t,1] y[pos[t,1], d]) + ...) + shared[t, d] */
__global__ void kd_moe_combine_kernel(const float *__restrict__ ys, const int32_t *__restrict__ pos,
                                      const float *__restrict__ w, const float *__restrict__ shared,
                                      float *__restrict__ out, int64_t T, int64_t D, int64_t k) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < T * D; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t t = i / D, d = i % D;
    float acc = 0.0f;
    for (int64_t j = 0; j < k; j++) acc = acc + w[t * k + j] * ys[(int64_t)pos[t * k + j] * D + d];
    if (shared) acc = acc + shared[i];
    out[i] = acc;
  }
}

static unsigned kd_blocks(int64_t n) {
  int64_t b = (n + 255) / 256;
  return (unsigned)(b < 1 ? 1 : b < 65536 ? b : 65536);
}

extern "C" int kd_moe_f32(const float *x, const int32_t *experts, const float *weights, const float *const *gate,
                          const float *const *up, const float *const *down, int64_t n_experts,
                          const float *shared_gate, const float *shared_up, const float *shared_down, float *out,
                          int64_t T, int64_t D, int64_t I, int64_t Is, int64_t k, void *stream) {
  int rc = kd_need_device("kd_moe_f32");
  if (rc) return rc;
  rc = kd_moe_check(x, experts, weights, gate, up, down, n_experts, shared_gate, shared_up, shared_down, out, T,
                        D, I, Is, k);
  if (rc || T == 0) return rc;
  int has_shared = shared_gate != NULL;
  int64_t S = T * k;
  /* host: counting sort of the slots by expert (slot order kept) -> src row per sorted slot, pos per slot */
  int64_t *start = (int64_t *)calloc((size_t)n_experts + 2, sizeof(int64_t));
  int32_t *host = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * S + 1));
  float *wh = (float *)malloc(sizeof(float) * (size_t)(S + 1));
  if (!start || !host || !wh) {
    free(start), free(host), free(wh);
    return kd_fail(KD_ENOMEM, "kd_moe_f32: out of host memory");
  }
  int32_t *src = host, *pos = host + S;
  for (int64_t i = 0; i < S; i++) start[experts[i] + 1]++;
  for (int64_t e = 0; e < n_experts; e++) start[e + 1] += start[e];
  for (int64_t i = 0; i < S; i++) {
    int64_t p = start[experts[i]]++;
    pos[i] = (int32_t)p;
    src[p] = (int32_t)(i / k);
    wh[i] = weights[i];
  }
  for (int64_t e = n_experts; e > 0; e--) start[e] = start[e - 1];
  start[0] = 0;
  int64_t inter = I > Is ? I : Is, rows = S > T ? S : T;
  size_t f_bytes = sizeof(float) * (size_t)(rows * (2 * D + 2 * inter) + T * D + S + 1);
  size_t i_bytes = sizeof(int32_t) * (size_t)(2 * S + 1);
  char *dev = NULL;
  cudaStream_t st = KD_STREAM(stream);
  cudaError_t e = cudaMalloc((void **)&dev, f_bytes + i_bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    free(start), free(host), free(wh);
    return kd_fail(KD_ENOMEM, "kd_moe_f32: cudaMalloc(%zu): %s", f_bytes + i_bytes, cudaGetErrorString(e));
  }
  float *xs = (float *)dev, *ys = xs + rows * D, *g = ys + rows * D, *u = g + rows * inter, *sh = u + rows * inter;
  float *wd = sh + T * D;
  int32_t *src_d = (int32_t *)(dev + f_bytes), *pos_d = src_d + S;
  e = cudaMemcpyAsync(src_d, host, sizeof(int32_t) * (size_t)(2 * S), cudaMemcpyHostToDevice, st);
  if (e == cudaSuccess) e = cudaMemcpyAsync(wd, wh, sizeof(float) * (size_t)S, cudaMemcpyHostToDevice, st);
  rc = e == cudaSuccess ? KD_OK : kd_fail(KD_ECUDA, "kd_moe_f32: copy: %s", cudaGetErrorString(e));
  if (!rc && S) {
    kd_gather_rows_kernel<<<kd_blocks(S * D), 256, 0, st>>>(x, src_d, xs, S, D);
    rc = kd_cuda_status("kd_moe_f32 gather");
  }
  for (int64_t ex = 0; !rc && ex < n_experts; ex++) {
    int64_t p0 = start[ex], n = start[ex + 1] - p0;
    if (n == 0) continue;
    rc = kd_linear_f32(xs + p0 * D, gate[ex], g, n, D, I, stream);
    if (!rc) rc = kd_linear_f32(xs + p0 * D, up[ex], u, n, D, I, stream);
    if (!rc) rc = kd_silu_mul(g, u, g, n, I, stream);
    if (!rc) rc = kd_linear_f32(g, down[ex], ys + p0 * D, n, I, D, stream);
  }
  if (!rc && has_shared) {
    rc = kd_linear_f32(x, shared_gate, g, T, D, Is, stream);
    if (!rc) rc = kd_linear_f32(x, shared_up, u, T, D, Is, stream);
    if (!rc) rc = kd_silu_mul(g, u, g, T, Is, stream);
    if (!rc) rc = kd_linear_f32(g, shared_down, sh, T, Is, D, stream);
  }
  if (!rc) {
    kd_moe_combine_kernel<<<kd_blocks(T * D), 256, 0, st>>>(ys, pos_d, wd, has_shared ? sh : NULL, out, T, D, k);
    rc = kd_cuda_status("kd_moe_f32 combine");
  }
  e = cudaStreamSynchronize(st); /* scratch and host staging stay alive until the stream is done with them */
  if (!rc && e != cudaSuccess) rc = kd_fail(KD_ECUDA, "kd_moe_f32: %s", cudaGetErrorString(e));
  cudaFree(dev);
  free(start), free(host), free(wh);
  return rc;
}

/* ---- per-head linear: one warp per output (t, h, o), kd_linear_f32_kernel's lane order; float32 or BF16 weights
 * (widened exactly at the load: the same bits) ------------------------------------------------------------- */
template <typename Wt>
__global__ void kd_head_linear_kernel(const float *__restrict__ x, int64_t xs_t, int64_t xs_h,
                                      const Wt *__restrict__ w, float *__restrict__ out, int64_t os_t,
                                      int64_t os_h, int64_t H, int64_t n_in, int64_t n_out) {
  int lane = threadIdx.x & 31;
  int64_t o = (int64_t)blockIdx.x * KD_WARPS + (threadIdx.x >> 5), th = blockIdx.y;
  if (o >= n_out) return;
  int64_t t = th / H, h = th % H;
  const Wt *wr = w + (h * n_out + o) * n_in;
  const float *xr = x + t * xs_t + h * xs_h;
  float acc = 0.0f;
  for (int64_t k0 = 4 * lane; k0 < n_in; k0 += 128)
    for (int j = 0; j < 4 && k0 + j < n_in; j++) acc += kd_load(wr + k0 + j) * xr[k0 + j];
  acc = kd_warp_sum(acc);
  if (lane == 0) out[t * os_t + h * os_h + o] = acc;
}

template <typename Wt>
static int kd_head_linear_launch(const char *op, const float *x, int64_t xs_t, int64_t xs_h, const Wt *w, float *out,
                                 int64_t os_t, int64_t os_h, int64_t T, int64_t H, int64_t n_in, int64_t n_out,
                                 void *stream) {
  int rc = kd_need_device(op);
  if (rc) return rc;
  if (T < 0 || H < 0 || n_in < 0 || n_out < 0) return kd_fail(KD_EINVAL, "%s: negative size", op);
  if (T == 0 || H == 0 || n_out == 0) return KD_OK;
  if (T * H > 65535) return kd_fail(KD_EINVAL, "%s: T*H=%lld > 65535", op, (long long)(T * H));
  KD_CHECK_PTR(op, x);
  KD_CHECK_PTR(op, w);
  KD_CHECK_PTR(op, out);
  dim3 grid((unsigned)((n_out + KD_WARPS - 1) / KD_WARPS), (unsigned)(T * H));
  kd_head_linear_kernel<Wt><<<grid, 32 * KD_WARPS, 0, KD_STREAM(stream)>>>(x, xs_t, xs_h, w, out, os_t, os_h, H, n_in,
                                                                            n_out);
  return kd_cuda_status(op);
}

extern "C" int kd_head_linear_f32(const float *x, int64_t xs_t, int64_t xs_h, const float *w, float *out,
                                  int64_t os_t, int64_t os_h, int64_t T, int64_t H, int64_t n_in, int64_t n_out,
                                  void *stream) {
  return kd_head_linear_launch("kd_head_linear_f32", x, xs_t, xs_h, w, out, os_t, os_h, T, H, n_in, n_out, stream);
}

extern "C" int kd_head_linear_bf16(const float *x, int64_t xs_t, int64_t xs_h, const uint16_t *w, float *out,
                                   int64_t os_t, int64_t os_h, int64_t T, int64_t H, int64_t n_in, int64_t n_out,
                                   void *stream) {
  return kd_head_linear_launch("kd_head_linear_bf16", x, xs_t, xs_h, (const __nv_bfloat16 *)w, out, os_t, os_h, T, H,
                               n_in, n_out, stream);
}
