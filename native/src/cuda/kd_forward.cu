/* Whole-model forward of the CUDA build (libkdtree_cuda.so): the K2 target of kdtree.h's kd_model_* ABI with
 * device-resident weights, a paged latent-cache arena and scratch, one stream of kernels per forward, CUDA graphs per
 * row-count bucket.
 *
 *   make -C native cuda             # builds it into libkdtree_cuda.so (no device needed to compile)
 *   native/gpu_check.sh             # runs the gpu-marked tests against it (forward parity, invariance, graphs)
 *
 * NOT RUN ON A GPU YET: written and compiled without a device (issue #17); gpu_check.sh is the first proof.
 *
 * Layout of one forward (the CPU build's kd_forward.c, the same order of operations):
 *   host: validate, build per-row metadata (token, cache row, prefix, block, visibility offset, YaRN cos/sin in
 *         float64 rounded once, as the CPU build) into a pinned staging buffer -> ONE H2D copy;
 *   device: embed -> layers (rms_norm, q_a/q_b/kv_a projections, latent rows written into the sequence's cache
 *         pages (through its page table), rope, absorbed q, MLA attention over prefix + visible block rows (keys read
 *         through the page table), absorbed v, o_proj, [all-reduce],
 *         residual; rms_norm, dense MLP or MoE: router + sigmoid routing with group limit + a counting sort by
 *         expert + grouped expert kernels + combine, [all-reduce], residual) -> final norm, lm_head, argmax;
 *   host: D2H of the asked outputs, one synchronize.
 * Every kernel reads sizes that depend only on the row count N and pointers into fixed buffers (metadata is
 * data, not launch arguments), so the kernel sequence of a given N is captured once as a CUDA graph and replayed.
 *
 * Numerics: every output element is one warp's dot product in kd_cuda.cu's lane order (lane l takes k = 128 i +
 * 4 l + j, INT4 included), norms and attention are kd_cuda.cu's kernels'
 * arithmetic; a row's bits depend only on its own inputs (batch invariant), whether replayed or launched eagerly.
 * Weights: float32 tensors whose every value is exactly a bfloat16 (a BF16 checkpoint widened by the loader) are
 * kept as BF16 on the device and widened exactly in the kernels: same bits as float32 weights, half the bytes.
 * INT4 stays packed; its scales are kept BF16 when exact (compressed-tensors stores them BF16), else float32.
 * Tensor parallel: kd_model_set_nccl puts the all-reduce on the stream (an NCCL all-gather, dlopened, and a
 * rank-ordered sum kernel; graphs stay on). Without it desc.all_reduce is called on a pinned host copy (D2H,
 * callback, H2D) and graphs are off (a host callback cannot be captured).
 * The DFlash drafter (kd_drafter_*, at the end of this file) runs on the device too, eagerly (no graphs yet). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kd_common.h"

#define FW_WARPS 8
#define FW_NORM_THREADS 256
#define FW_ATT_THREADS 128
#define FW_ATT_CHUNK 64
#define FW_ATT_MAX_DIMS 8
#define FW_MAX_GRAPHS 16
#define FW_MAX_HIDDEN 16

enum { FW_F32 = 0, FW_BF16 = 1, FW_INT4_BF16 = 2, FW_INT4_F32 = 3 };

typedef struct {
  const void *w;       /* f32 / bf16 [n_out, n_in], or packed int32 [n_out, ceil(n_in/8)] */
  const void *scales;  /* int4: bf16 / f32 [n_out, ceil(n_in/group)] */
  int32_t kind;
  int64_t n_out, n_in, group;
} fw_w;

typedef struct {
  fw_w gate, up, down;
} fw_mlp;

typedef struct {
  const float *in_norm, *post_norm, *q_a_norm, *kv_a_norm; /* f32 on the device */
  fw_w q_a, q_b, kv_a, o, w_uk_t, w_uv;                     /* w_uk_t [H*L, nope], w_uv [H*v, L] */
  int64_t heads;
  int32_t is_moe, has_shared;
  fw_mlp mlp, shared;
  fw_w router;
  const float *router_bias;
  fw_mlp *experts;       /* device array [E] */
  int64_t inter;         /* largest intermediate of this layer's experts */
} fw_layer;

typedef struct {
  float *arena;         /* the paged latent arena [n_layers][n_pages * page_rows][L+R] (device) */
  const int32_t *pages; /* device: its sequence's page table (staged with the forward; data, not a launch argument) */
  int64_t page_rows, layer_rows;  /* layer_rows = n_pages * page_rows: one layer's block */
  int64_t dst;          /* this row's cache row (prefix + index in its block), through the page table */
  int64_t prefix;       /* the sequence's cached rows before this forward */
  int64_t t, T;         /* index in its block, block rows */
  const uint64_t *vis;  /* device: its block's visibility rows [T, ceil(T/64)], NULL = causal. A pointer in the
                           metadata (data, not a launch argument): the visibility buffer may grow between a
                           graph's capture and its replay */
} fw_row;

typedef struct {
  int64_t N, n_out, want_logits, want_argmax, n_hidden, hidden[FW_MAX_HIDDEN];
  cudaGraphExec_t exec;
} fw_graph;

struct kd_model {
  kd_model_desc d;
  double *inv_freq;
  fw_layer *layers;
  const float *embed_f32, *final_norm;  /* device */
  const __nv_bfloat16 *embed_bf16;
  fw_w lm_head;
  char *arena;                          /* every weight, one allocation */
  size_t arena_bytes;
  float *kv;            /* kd_model_pages: the paged latent arena [n_layers][n_pages * page_rows][L+R] */
  int64_t n_pages, page_rows;
  int64_t E, q_lora, Hmax, Emax, inter_max, kmax;
  int64_t gu_cols;                      /* g/u scratch floats per row: max(dense I, top_k * expert I + shared I) */
  cudaStream_t stream;
  /* scratch for up to cap_rows rows (device) and the staging of one forward's metadata (pinned host + device) */
  int64_t cap_rows, cap_hidden;
  char *scratch;
  char *meta_h, *meta_d;
  size_t meta_bytes;
  /* the visibility rows of one forward (pinned host + device), grow-only apart from the rest: fw_row.vis points
   * into it, so growing it never invalidates a captured graph */
  uint64_t *vis_h, *vis_d;
  int64_t cap_vis;                      /* words */
  int32_t *pages_h, *pages_d;           /* the page tables of one forward (pinned host + device), grow-only as vis */
  int64_t cap_pages;
  float *host_reduce;                   /* pinned [cap_rows * D] for the all-reduce hook (only with one) */
  struct fw_nccl_comm *nccl;            /* kd_model_set_nccl: the all-reduce on the stream (NULL = the hook) */
  int64_t nccl_ranks, nccl_rank;
  /* graphs */
  int64_t graph_rows[FW_MAX_GRAPHS], n_graph_rows;
  fw_graph graphs[FW_MAX_GRAPHS];
  int64_t n_graphs, replays, eager, said_eager;
  int graphs_broken; /* a capture or instantiate failed on this device: eager from then on (said once) */
  double capture_s;
};

/* ---- helpers ------------------------------------------------------------------------------------------ */
static int fw_err_in(const char *fn, cudaError_t e, const char *what) {
  if (e == cudaSuccess) return KD_OK;
  cudaGetLastError(); /* clear a non-sticky error so the next call starts clean */
  return kd_fail(KD_ECUDA, "%s: %s: %s", fn, what, cudaGetErrorString(e));
}
static int fw_err(cudaError_t e, const char *what) { return fw_err_in("kd_model_forward", e, what); }

#define FW_TRY(expr)     \
  do {                   \
    int rc_ = (expr);    \
    if (rc_) return rc_; \
  } while (0)

static int fw_launched(const char *what) { return fw_err(cudaGetLastError(), what); }

static size_t fw_align(size_t n) { return (n + 255) & ~(size_t)255; }

static unsigned fw_blocks(int64_t n) {
  int64_t b = (n + 255) / 256;
  return (unsigned)(b < 1 ? 1 : b < 65536 ? b : 65536);
}

__device__ __forceinline__ float fw_warp_sum(float v) {
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float fw_ld(const float *p) { return *p; }
__device__ __forceinline__ float fw_ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

/* one warp: sum_k w[o, k] x[k] in kd_cuda.cu's lane order for the weight's kind */
template <typename Wt>
__device__ __forceinline__ float fw_dot_dense(const Wt *wr, const float *xr, int64_t n_in, int lane) {
  float acc = 0.0f;
  for (int64_t k0 = 4 * lane; k0 < n_in; k0 += 128)
    for (int j = 0; j < 4 && k0 + j < n_in; j++) acc += fw_ld(wr + k0 + j) * xr[k0 + j];
  return fw_warp_sum(acc);
}

/* INT4 in the dense lane order (k = 128 i + 4 l + j): exactly fw_dot_dense on the dequantized row */
template <typename St>
__device__ __forceinline__ float fw_dot_int4(const uint32_t *wr, const St *sr, const float *xr, int64_t n_in,
                                             int64_t wpg, int lane) {
  float acc = 0.0f;
  for (int64_t k0 = 4 * lane; k0 < n_in; k0 += 128) {
    uint32_t u = wr[k0 / 8];
    float s = fw_ld(sr + k0 / (8 * wpg));
    for (int j = 0; j < 4 && k0 + j < n_in; j++) acc += kd_int4_weight(u, (int)(k0 % 8) + j, s) * xr[k0 + j];
  }
  return fw_warp_sum(acc);
}

__device__ __forceinline__ float fw_dot(const fw_w &w, int64_t o, const float *xr, int lane) {
  switch (w.kind) {
    case FW_F32:
      return fw_dot_dense((const float *)w.w + o * w.n_in, xr, w.n_in, lane);
    case FW_BF16:
      return fw_dot_dense((const __nv_bfloat16 *)w.w + o * w.n_in, xr, w.n_in, lane);
    default: {
      int64_t n_words = (w.n_in + 7) / 8, n_groups = (w.n_in + w.group - 1) / w.group;
      const uint32_t *wr = (const uint32_t *)w.w + o * n_words;
      if (w.kind == FW_INT4_BF16)
        return fw_dot_int4(wr, (const __nv_bfloat16 *)w.scales + o * n_groups, xr, w.n_in, w.group / 8, lane);
      return fw_dot_int4(wr, (const float *)w.scales + o * n_groups, xr, w.n_in, w.group / 8, lane);
    }
  }
}

/* ---- kernels ------------------------------------------------------------------------------------------ */
/* out[t * os + o] = w[o, :] . x[t * xs, :]; grid (ceil(n_out / FW_WARPS), T) */
__global__ void fw_linear_kernel(fw_w w, const float *__restrict__ x, int64_t xs, float *__restrict__ out,
                                 int64_t os) {
  int lane = threadIdx.x & 31;
  int64_t o = (int64_t)blockIdx.x * FW_WARPS + (threadIdx.x >> 5), t = blockIdx.y;
  if (o >= w.n_out) return;
  float acc = fw_dot(w, o, x + t * xs, lane);
  if (lane == 0) out[t * os + o] = acc;
}

/* per-head linear (absorbed MLA): out[t, h, o] = w[h * n_out + o, :] . x[t, h, :]; w viewed [H * n_out, n_in];
 * grid (T * H, ceil(n_out / FW_WARPS)): T * H exceeds grid.y's 65535 for K2 (64 heads) from 1024 rows on */
__global__ void fw_head_linear_kernel(fw_w w, int64_t n_out, const float *__restrict__ x, int64_t xs_t,
                                      int64_t xs_h, float *__restrict__ out, int64_t os_t, int64_t os_h, int64_t H) {
  int lane = threadIdx.x & 31;
  int64_t o = (int64_t)blockIdx.y * FW_WARPS + (threadIdx.x >> 5), th = blockIdx.x;
  if (o >= n_out) return;
  int64_t t = th / H, h = th % H;
  float acc = fw_dot(w, h * n_out + o, x + t * xs_t + h * xs_h, lane);
  if (lane == 0) out[t * os_t + h * os_h + o] = acc;
}

/* h[r] = embed[tokens[r]] */
template <typename Et>
__global__ void fw_embed_kernel(const Et *__restrict__ embed, const int32_t *__restrict__ tokens,
                                float *__restrict__ h, int64_t N, int64_t D) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * D; i += (int64_t)gridDim.x * blockDim.x)
    h[i] = fw_ld(embed + (int64_t)tokens[i / D] * D + i % D);
}

__global__ void fw_add_kernel(float *__restrict__ h, const float *__restrict__ t, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    h[i] = h[i] + t[i];
}

/* (x0 c - x1 s, x1 c + x0 s) per interleaved pair, as kd_forward.c's kd_rope_interleaved */
__device__ __forceinline__ void fw_rope_pair(const float *src, float *dst, const float *cs, int64_t half,
                                             int64_t i) {
  float x0 = src[2 * i], x1 = src[2 * i + 1], c = cs[i], s = cs[half + i];
  dst[2 * i] = x0 * c + x1 * -s;
  dst[2 * i + 1] = x1 * c + x0 * s;
}

/* new latent rows: cache[dst] = [rms_norm(kva[:L]) * w, rope(kva[L:])]; one block per row (kd_rms_norm's tree) */
__global__ void fw_cache_write_kernel(const float *__restrict__ kva, const float *__restrict__ norm_w,
                                      const fw_row *__restrict__ rows, const float *__restrict__ cs, int64_t layer,
                                      int64_t L, int64_t R, float eps) {
  __shared__ float part[FW_NORM_THREADS];
  const int64_t r = blockIdx.x, E = L + R;
  const fw_row m = rows[r];
  const float *src = kva + r * E;
  float *dst = m.arena + kd_page_row(m.pages, m.page_rows, m.layer_rows, E, layer, m.dst);
  float acc = 0.0f;
  for (int64_t d = threadIdx.x; d < L; d += FW_NORM_THREADS) acc += src[d] * src[d];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = FW_NORM_THREADS / 2; s >= 1; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  float inv = kd_rms_inv(part[0], L, eps);
  for (int64_t d = threadIdx.x; d < L; d += FW_NORM_THREADS) dst[d] = src[d] * inv * norm_w[d];
  for (int64_t i = threadIdx.x; i < R / 2; i += FW_NORM_THREADS) fw_rope_pair(src + L, dst + L, cs + r * R, R / 2, i);
}

/* qf[r, h, L:] = rope(q[r, h, nope:]); grid N * H */
__global__ void fw_q_rope_kernel(const float *__restrict__ q, float *__restrict__ qf, const float *__restrict__ cs,
                                 int64_t H, int64_t nope, int64_t L, int64_t R) {
  const int64_t r = blockIdx.x / H, h = blockIdx.x % H;
  for (int64_t i = threadIdx.x; i < R / 2; i += blockDim.x)
    fw_rope_pair(q + (r * H + h) * (nope + R) + nope, qf + (r * H + h) * (L + R) + L, cs + r * R, R / 2, i);
}

/* Word w of a block-row's visibility, bits past key T-1 cleared (kd_cuda.cu's kd_vis_word) */
__device__ __forceinline__ uint64_t fw_vis_word(const uint64_t *row, int64_t w, int64_t T) {
  const int64_t words = (T + 63) / 64;
  uint64_t bits = row[w];
  if (w == words - 1 && (T & 63)) bits &= ((uint64_t)1 << (T & 63)) - 1;
  return bits;
}

/* Tree-verify MLA attention of kd_cuda.cu (kd_mla_attention_kernel), one block per (row, head), its sequence's
 * page table and block read from the row's metadata: the same chunks of the visible key list, the same rounding
 * (keypos holds each visible row's place in the layer's arena, through the page table). */
__global__ void fw_attention_kernel(const float *__restrict__ q, const fw_row *__restrict__ rows,
                                    float *__restrict__ out, int64_t layer, int64_t H, int64_t L, int64_t R,
                                    float scale) {
  __shared__ int64_t keypos[FW_ATT_CHUNK];
  __shared__ float e[FW_ATT_CHUNK];
  __shared__ float stat[3];
  const int64_t r = blockIdx.x / H, h = blockIdx.x % H, E = L + R;
  const fw_row m = rows[r];
  const int64_t T = m.T, t = m.t, P = m.prefix, words = (T + 63) / 64;
  const float *kv = m.arena + layer * m.layer_rows * E; /* key k's row: kv + kd_page_key(...) * E */
  const uint64_t *vis = m.vis ? m.vis + t * words : NULL;
  const float *qh = q + (r * H + h) * E;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = FW_ATT_THREADS / 32;
  int64_t nblock = 0;
  if (vis) {
    for (int64_t w = 0; w < words; w++) nblock += __popcll(fw_vis_word(vis, w, T));
  } else {
    nblock = t + 1;
  }
  const int64_t n = P + nblock;
  float acc[FW_ATT_MAX_DIMS];
  for (int i = 0; i < FW_ATT_MAX_DIMS; i++) acc[i] = 0.0f;
  if (tid == 0) {
    stat[0] = -INFINITY;
    stat[1] = 0.0f;
  }
  int64_t cur_word = 0;
  uint64_t cur_bits = vis ? fw_vis_word(vis, 0, T) : 0;
  int64_t causal_next = 0;
  for (int64_t c0 = 0; c0 < n; c0 += FW_ATT_CHUNK) {
    const int cm = (int)(n - c0 < FW_ATT_CHUNK ? n - c0 : FW_ATT_CHUNK);
    if (tid == 0) {
      for (int i = 0; i < cm; i++) {
        int64_t v = c0 + i, j;
        if (v < P) {
          j = v;
        } else if (!vis) {
          j = P + causal_next++;
        } else {
          while (cur_bits == 0) cur_bits = fw_vis_word(vis, ++cur_word, T);
          j = P + cur_word * 64 + __ffsll((long long)cur_bits) - 1;
          cur_bits &= cur_bits - 1;
        }
        keypos[i] = kd_page_key(m.pages, m.page_rows, j);
      }
    }
    __syncthreads();
    for (int i = warp; i < cm; i += nwarps) {
      const float *kr = kv + keypos[i] * E;
      float s = 0.0f;
      for (int64_t d = lane; d < E; d += 32) s += qh[d] * kr[d];
      s = fw_warp_sum(s);
      if (lane == 0) e[i] = s * scale;
    }
    __syncthreads();
    if (tid == 0) {
      float mx = stat[0];
      for (int i = 0; i < cm; i++) mx = fmaxf(mx, e[i]);
      float alpha = expf(stat[0] - mx);
      float sum = stat[1] * alpha;
      for (int i = 0; i < cm; i++) {
        e[i] = expf(e[i] - mx);
        sum += e[i];
      }
      stat[0] = mx;
      stat[1] = sum;
      stat[2] = alpha;
    }
    __syncthreads();
    const float alpha = stat[2];
    for (int k = 0; k < FW_ATT_MAX_DIMS; k++) {
      int64_t d = tid + (int64_t)k * FW_ATT_THREADS;
      if (d >= L) break;
      float a = acc[k] * alpha;
      for (int i = 0; i < cm; i++) a += e[i] * kv[keypos[i] * E + d];
      acc[k] = a;
    }
    __syncthreads();
  }
  __syncthreads();
  float *o = out + (r * H + h) * L;
  const float total = stat[1];
  for (int k = 0; k < FW_ATT_MAX_DIMS; k++) {
    int64_t d = tid + (int64_t)k * FW_ATT_THREADS;
    if (d >= L) break;
    o[d] = n ? acc[k] / total : 0.0f;
  }
}

/* index of the first maximum among entries not yet taken (kd_forward.c's kd_pick_max) */
__device__ int64_t fw_pick_max(const float *v, unsigned char *taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  if (best >= 0) taken[best] = 1;
  return best;
}

/* numpy's float32 pairwise sum of a short row (kd_forward.c's kd_np_sum) */
__device__ float fw_np_sum(const float *a, int64_t n) {
  if (n < 8) {
    float r = 0.0f;
    for (int64_t i = 0; i < n; i++) r += a[i];
    return r;
  }
  float p[8];
  for (int j = 0; j < 8; j++) p[j] = a[j];
  int64_t i = 8;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) p[j] += a[i + j];
  float res = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
  for (; i < n; i++) res += a[i];
  return res;
}

/* routing of one row per thread (kd_forward.c's kd_route, the same operations): s = sigmoid(logits), choice =
 * s + bias, group limit (sum of each group's best two, keep topk_group groups, others 0.0), top-k in choice
 * order, weights = s of the chosen (normalised if asked) x routed_scale. rl [N, E] in: logits, out: s. */
__global__ void fw_route_kernel(float *__restrict__ rl, const float *__restrict__ bias, float *__restrict__ work,
                                unsigned char *__restrict__ taken_all, int32_t *__restrict__ ex,
                                float *__restrict__ ew, int64_t N, int64_t E, int64_t G, int64_t topk_group,
                                int64_t k, int32_t norm, float routed_scale) {
  int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= N) return;
  float *s = rl + r * E, *choice = work + r * (E + G), *gscore = choice + E;
  unsigned char *taken = taken_all + r * (E > G ? E : G);
  for (int64_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-s[e]));
  for (int64_t e = 0; e < E; e++) choice[e] = s[e] + bias[e];
  if (G > 1) {
    int64_t per = E / G, top = per < 2 ? per : 2;
    for (int64_t g = 0; g < G; g++) {
      for (int64_t j = 0; j < per; j++) taken[j] = 0;
      float acc = 0.0f;
      for (int64_t j = 0; j < top; j++) acc += choice[g * per + fw_pick_max(choice + g * per, taken, per)];
      gscore[g] = acc;
    }
    for (int64_t g = 0; g < G; g++) taken[g] = 0;
    for (int64_t j = 0; j < topk_group; j++) fw_pick_max(gscore, taken, G);
    for (int64_t g = 0; g < G; g++)
      if (!taken[g])
        for (int64_t j = 0; j < per; j++) choice[g * per + j] = 0.0f;
  }
  for (int64_t e = 0; e < E; e++) taken[e] = 0;
  int32_t *xr = ex + r * k;
  float *wr = ew + r * k;
  for (int64_t j = 0; j < k; j++) {
    xr[j] = (int32_t)fw_pick_max(choice, taken, E);
    wr[j] = s[xr[j]];
  }
  if (norm) {
    float den = fw_np_sum(wr, k) + 1e-20f;
    for (int64_t j = 0; j < k; j++) wr[j] = wr[j] / den;
  }
  for (int64_t j = 0; j < k; j++) wr[j] = wr[j] * routed_scale;
}

/* counting sort of the N*k routing slots by expert, slot order kept: start[E+1], src[p] (row of sorted slot p),
 * pos[i] (sorted place of slot i). One thread: S and E are small (S = rows x top_k); a parallel scan is later. */
__global__ void fw_sort_kernel(const int32_t *__restrict__ ex, int32_t *__restrict__ start, int32_t *__restrict__ src,
                               int32_t *__restrict__ pos, int64_t S, int64_t E, int64_t k) {
  if (blockIdx.x || threadIdx.x) return;
  for (int64_t e = 0; e <= E; e++) start[e] = 0;
  for (int64_t i = 0; i < S; i++) start[ex[i] + 1]++;
  for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
  for (int64_t i = 0; i < S; i++) {
    int32_t p = start[ex[i]]++;
    pos[i] = p;
    src[p] = (int32_t)(i / k);
  }
  for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
  start[0] = 0;
}

__global__ void fw_gather_kernel(const float *__restrict__ x, const int32_t *__restrict__ src,
                                 float *__restrict__ dst, int64_t n, int64_t D) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * D; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = x[(int64_t)src[i / D] * D + i % D];
}

/* Grouped experts: block (output tile, expert e) runs e's weight rows over the sorted rows start[e]..start[e+1]-1
 * (the weight tile is read once from DRAM for all of them). which: 0 = gate and up (xs -> g, u), 1 = down (g -> ys).
 * Grid sizes depend only on E and the widths, never on the routing, so the launch is graph-capturable. */
__global__ void fw_experts_kernel(const fw_mlp *__restrict__ experts, const int32_t *__restrict__ start,
                                  const float *__restrict__ xin, int64_t xs, float *__restrict__ o1,
                                  float *__restrict__ o2, int64_t os, int which) {
  const int64_t e = blockIdx.y;
  const int32_t p0 = start[e], p1 = start[e + 1];
  if (p0 == p1) return;
  int lane = threadIdx.x & 31;
  int64_t o = (int64_t)blockIdx.x * FW_WARPS + (threadIdx.x >> 5);
  const fw_mlp &m = experts[e];
  if (which == 0) {
    if (o >= m.gate.n_out) return;
    for (int32_t p = p0; p < p1; p++) {
      float g = fw_dot(m.gate, o, xin + p * xs, lane), u = fw_dot(m.up, o, xin + p * xs, lane);
      if (lane == 0) o1[p * os + o] = g, o2[p * os + o] = u;
    }
  } else {
    if (o >= m.down.n_out) return;
    for (int32_t p = p0; p < p1; p++) {
      float y = fw_dot(m.down, o, xin + p * xs, lane);
      if (lane == 0) o1[p * os + o] = y;
    }
  }
}

/* out[t, d] = (((0 + w[t,0] y[pos[t,0], d]) + w[t,1] y[pos[t,1], d]) + ...) + shared[t, d] (kd_moe_combine) */
__global__ void fw_combine_kernel(const float *__restrict__ ys, const int32_t *__restrict__ pos,
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

__global__ void fw_gather_rows_kernel(const float *__restrict__ h, const int64_t *__restrict__ rows,
                                      float *__restrict__ out, int64_t n, int64_t D) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * D; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = h[rows[i / D] * D + i % D];
}

/* argmax per row, ties -> lowest id (kd_forward.c: the first strictly greater value wins) */
__global__ void fw_argmax_kernel(const float *__restrict__ lg, int32_t *__restrict__ am, int64_t V) {
  __shared__ float bv[256];
  __shared__ int64_t bi[256];
  const float *row = lg + blockIdx.x * V;
  float best = -INFINITY;
  int64_t idx = -1;
  for (int64_t v = threadIdx.x; v < V; v += 256)
    if (idx < 0 || row[v] > best) best = row[v], idx = v;
  bv[threadIdx.x] = best;
  bi[threadIdx.x] = idx;
  __syncthreads();
  for (int s = 128; s >= 1; s >>= 1) {
    if (threadIdx.x < s) {
      float ov = bv[threadIdx.x + s];
      int64_t oi = bi[threadIdx.x + s];
      if (oi >= 0 && (bi[threadIdx.x] < 0 || ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])))
        bv[threadIdx.x] = ov, bi[threadIdx.x] = oi;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) am[blockIdx.x] = (int32_t)(bi[0] < 0 ? 0 : bi[0]);
}

/* kd_cache_keep on the device: per layer (block), rows[i] -> start + i in ascending order (never over a row to
 * move), both through the sequence's page table */
__global__ void fw_keep_kernel(float *__restrict__ kv, const int32_t *__restrict__ pages, int64_t page_rows,
                               int64_t layer_rows, int64_t E, const int64_t *__restrict__ rows, int64_t start,
                               int64_t n) {
  const int64_t l = blockIdx.x;
  for (int64_t i = 0; i < n; i++) {
    if (rows[i] != start + i) {
      float *to = kv + kd_page_row(pages, page_rows, layer_rows, E, l, start + i);
      const float *from = kv + kd_page_row(pages, page_rows, layer_rows, E, l, rows[i]);
      for (int64_t d = threadIdx.x; d < E; d += blockDim.x) to[d] = from[d];
    }
    __syncthreads();
  }
}

/* rows [T, W] -> context rows start.. of one sequence's drafter arena (layer li, through its page table); grid T */
__global__ void fw_page_scatter_kernel(const float *__restrict__ src, float *__restrict__ arena,
                                       const int32_t *__restrict__ pages, int64_t page_rows, int64_t layer_rows,
                                       int64_t W, int64_t li, int64_t start) {
  const int64_t r = blockIdx.x;
  float *dst = arena + kd_page_row(pages, page_rows, layer_rows, W, li, start + r);
  for (int64_t d = threadIdx.x; d < W; d += blockDim.x) dst[d] = src[r * W + d];
}

/* ---- NCCL, loaded at run time (tensor parallel on the stream) -------------------------------------------
 * The five entry points of nccl.h this file uses, declared here so that building needs no NCCL: ncclUniqueId is
 * 128 bytes passed by value, ncclResult_t / ncclDataType_t are ints (ncclSuccess = 0, ncclFloat32 = 7). */
typedef struct {
  char internal[128];
} fw_nccl_id;
typedef struct fw_nccl_comm *fw_nccl_comm_t;
static struct {
  void *lib;
  int (*get_unique_id)(fw_nccl_id *);
  int (*comm_init_rank)(fw_nccl_comm_t *, int, fw_nccl_id, int);
  int (*all_gather)(const void *, void *, size_t, int, fw_nccl_comm_t, cudaStream_t);
  int (*comm_destroy)(fw_nccl_comm_t);
  const char *(*error_string)(int);
} fw_nccl;
#define FW_NCCL_FLOAT32 7

/* dlopen NCCL once (`path`, else libnccl.so.2: a process that imported torch has it loaded already) */
static int fw_nccl_load(const char *fn, const char *path) {
  if (fw_nccl.lib) return KD_OK;
  const char *name = path && path[0] ? path : "libnccl.so.2";
  void *h = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
  if (!h) return kd_fail(KD_EINVAL, "%s: cannot load NCCL (%s): %s; set KDTREE_NCCL_LIB to libnccl.so.2's path or "
                                    "tp.collective=host", fn, name, dlerror());
  fw_nccl.get_unique_id = (int (*)(fw_nccl_id *))dlsym(h, "ncclGetUniqueId");
  fw_nccl.comm_init_rank = (int (*)(fw_nccl_comm_t *, int, fw_nccl_id, int))dlsym(h, "ncclCommInitRank");
  fw_nccl.all_gather = (int (*)(const void *, void *, size_t, int, fw_nccl_comm_t, cudaStream_t))dlsym(h, "ncclAllGather");
  fw_nccl.comm_destroy = (int (*)(fw_nccl_comm_t))dlsym(h, "ncclCommDestroy");
  fw_nccl.error_string = (const char *(*)(int))dlsym(h, "ncclGetErrorString");
  if (!fw_nccl.get_unique_id || !fw_nccl.comm_init_rank || !fw_nccl.all_gather || !fw_nccl.comm_destroy ||
      !fw_nccl.error_string) {
    dlclose(h);
    memset(&fw_nccl, 0, sizeof fw_nccl);
    return kd_fail(KD_EINVAL, "%s: %s lacks an NCCL entry point (ncclGetUniqueId / ncclCommInitRank / ncclAllGather "
                              "/ ncclCommDestroy / ncclGetErrorString)", fn, name);
  }
  fw_nccl.lib = h;
  return KD_OK;
}

static int fw_nccl_err(const char *fn, int r, const char *what) {
  if (r == 0) return KD_OK;
  return kd_fail(KD_ECUDA, "%s: %s: NCCL error %d (%s)", fn, what, r, fw_nccl.error_string(r));
}

/* x[i] = ((g[0][i] + g[1][i]) + g[2][i]) + ...: kdtree/parallel/comm.py's rank order, elementwise in float32 (the
 * host hook's bits, independent of the row count) */
__global__ void fw_ordered_sum_kernel(const float *__restrict__ g, float *__restrict__ x, int64_t n, int64_t ranks) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float acc = g[i];
    for (int64_t r = 1; r < ranks; r++) acc = acc + g[r * n + i];
    x[i] = acc;
  }
}

extern "C" int kd_nccl_unique_id(const char *nccl_lib, uint8_t *id128) {
  kd_clear_error();
  KD_CHECK_PTR("kd_nccl_unique_id", id128);
  FW_TRY(fw_nccl_load("kd_nccl_unique_id", nccl_lib));
  fw_nccl_id id;
  FW_TRY(fw_nccl_err("kd_nccl_unique_id", fw_nccl.get_unique_id(&id), "ncclGetUniqueId"));
  memcpy(id128, id.internal, sizeof id.internal);
  return KD_OK;
}

/* ---- weight upload: every tensor into one device arena (pass 0 sizes it, pass 1 copies) ---------------- */
typedef struct {
  char *arena;      /* pass 1: the device allocation of `need` bytes, filled from `used` on */
  size_t used;
  int pass;
  size_t need;
  int rc;
  const char *fn;   /* the entry point, for errors */
} fw_up;

static int fw_bf16_exact(const float *a, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t b;
    memcpy(&b, a + i, 4);
    if (b & 0xffffu) return 0;
  }
  return 1;
}

static void *fw_put(fw_up *u, const void *src, size_t bytes) {
  if (u->rc) return NULL;
  if (u->pass == 0) {
    u->need += fw_align(bytes);
    return NULL;
  }
  void *dst = u->arena + u->used;
  u->used += fw_align(bytes);
  cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* reported here, not by a later launch's check */
    u->rc = kd_fail(KD_ECUDA, "%s: weight upload: %s", u->fn, cudaGetErrorString(e));
  }
  return dst;
}

/* f32 host array -> device, as BF16 when every value is one (exact) and allow_bf16, else as f32 */
static const void *fw_put_f32(fw_up *u, const float *src, int64_t n, int allow_bf16, int *is_bf16) {
  *is_bf16 = allow_bf16 && fw_bf16_exact(src, n);
  if (!*is_bf16) return fw_put(u, src, sizeof(float) * (size_t)n);
  if (u->pass == 0) return fw_put(u, src, 2 * (size_t)n);
  uint16_t *tmp = (uint16_t *)malloc(2 * (size_t)n + 2);
  if (!tmp) {
    u->rc = kd_fail(KD_ENOMEM, "%s: out of host memory (%lld values)", u->fn, (long long)n);
    return NULL;
  }
  for (int64_t i = 0; i < n; i++) {
    uint32_t b;
    memcpy(&b, src + i, 4);
    tmp[i] = (uint16_t)(b >> 16);
  }
  const void *d = fw_put(u, tmp, 2 * (size_t)n);
  free(tmp);
  return d;
}

static const float *fw_vec(fw_up *u, const float *src, int64_t n) { return (const float *)fw_put(u, src, 4 * (size_t)n); }

static void fw_weight(fw_up *u, const kd_weight *hw, fw_w *dw) {
  dw->n_out = hw->n_out, dw->n_in = hw->n_in, dw->group = hw->group;
  int bf;
  if (hw->packed) {
    dw->w = fw_put(u, hw->packed, sizeof(int32_t) * (size_t)(hw->n_out * ((hw->n_in + 7) / 8)));
    const int64_t ns = hw->n_out * ((hw->n_in + hw->group - 1) / hw->group);
    if (hw->scales_bf16) /* BF16 scales from the host (the checkpoint's): uploaded as is */
      dw->scales = fw_put(u, hw->scales_bf16, 2 * (size_t)ns), bf = 1;
    else
      dw->scales = fw_put_f32(u, hw->scales, ns, 1, &bf);
    dw->kind = bf ? FW_INT4_BF16 : FW_INT4_F32;
  } else if (hw->bf16) { /* BF16 from the host (backend=cpu's loader layout): uploaded as is */
    dw->w = fw_put(u, hw->bf16, 2 * (size_t)(hw->n_out * hw->n_in));
    dw->kind = FW_BF16;
  } else {
    dw->w = fw_put_f32(u, hw->f32, hw->n_out * hw->n_in, 1, &bf);
    dw->kind = bf ? FW_BF16 : FW_F32;
  }
}

/* a dense matrix given as float32 src or BF16 bits src16 (exactly one set), uploaded as fw_weight does */
static void fw_dense(fw_up *u, const float *src, const uint16_t *src16, int64_t n_out, int64_t n_in, fw_w *dw) {
  kd_weight hw = {src, NULL, NULL, n_out, n_in, 0, src16, NULL};
  fw_weight(u, &hw, dw);
}

static void fw_mlp_up(fw_up *u, const kd_mlp *h, fw_mlp *d) {
  fw_weight(u, &h->gate, &d->gate);
  fw_weight(u, &h->up, &d->up);
  fw_weight(u, &h->down, &d->down);
}

/* one pass over the descriptor: pass 0 validates and sizes, pass 1 uploads (expert tables last, per layer) */
static int fw_upload(kd_model *m, fw_up *u) {
  const kd_model_desc *d = &m->d;
  int64_t D = d->hidden, L = d->kv_lora, R = d->rope_dim, V = d->vocab;
  int bf;
  const void *emb = d->embed_bf16 ? (bf = 1, fw_put(u, d->embed_bf16, 2 * (size_t)(V * D)))
                                  : fw_put_f32(u, d->embed, V * D, 1, &bf);
  m->embed_f32 = bf ? NULL : (const float *)emb;
  m->embed_bf16 = bf ? (const __nv_bfloat16 *)emb : NULL;
  m->final_norm = fw_vec(u, d->final_norm, D);
  fw_weight(u, &d->lm_head, &m->lm_head);
  for (int64_t i = 0; i < d->n_layers && !u->rc; i++) {
    const kd_layer *ly = &d->layers[i];
    fw_layer *fl = &m->layers[i];
    int64_t H = ly->heads, ql = ly->q_a.n_out;
    if (u->pass == 0) {
      /* the absorbed halves and the router: float32 or BF16, exactly one of each (uploaded as fw_weight does) */
      int ok = H > 0 && ql > 0 && ly->in_norm && ly->post_norm && ly->q_a_norm && ly->kv_a_norm &&
               !ly->w_uk_t != !ly->w_uk_t_bf16 && !ly->w_uv != !ly->w_uv_bf16 && kd_weight_ok(&ly->q_a, ql, D) &&
               kd_weight_ok(&ly->q_b, H * (d->nope + R), ql) && kd_weight_ok(&ly->kv_a, L + R, D) &&
               kd_weight_ok(&ly->o, D, H * d->v_head);
      if (ok && ly->is_moe) {
        ok = d->n_experts > 0 && d->top_k > 0 && d->top_k <= d->n_experts && !ly->router != !ly->router_bf16 &&
             ly->router_bias && ly->experts && d->n_group > 0 && d->n_experts % d->n_group == 0 && d->topk_group > 0 &&
             d->topk_group <= d->n_group;
        for (int64_t e = 0; ok && e < d->n_experts; e++) ok = kd_mlp_ok(&ly->experts[e], D);
        if (ok && ly->has_shared) ok = kd_mlp_ok(&ly->shared, D);
      } else if (ok) {
        ok = kd_mlp_ok(&ly->mlp, D);
      }
      if (!ok)
        return kd_fail(KD_EINVAL, "kd_model_create: layer %lld has a missing weight or one whose shape disagrees "
                                  "with the model sizes", (long long)i);
      if (ql > m->q_lora) m->q_lora = ql;
      if (H > m->Hmax) m->Hmax = H;
    }
    fl->heads = H, fl->is_moe = ly->is_moe, fl->has_shared = ly->has_shared;
    fl->in_norm = fw_vec(u, ly->in_norm, D), fl->post_norm = fw_vec(u, ly->post_norm, D);
    fl->q_a_norm = fw_vec(u, ly->q_a_norm, ql), fl->kv_a_norm = fw_vec(u, ly->kv_a_norm, L);
    fw_weight(u, &ly->q_a, &fl->q_a);
    fw_weight(u, &ly->q_b, &fl->q_b);
    fw_weight(u, &ly->kv_a, &fl->kv_a);
    fw_weight(u, &ly->o, &fl->o);
    fw_dense(u, ly->w_uk_t, ly->w_uk_t_bf16, H * L, d->nope, &fl->w_uk_t);
    fw_dense(u, ly->w_uv, ly->w_uv_bf16, H * d->v_head, L, &fl->w_uv);
    if (!ly->is_moe) {
      fw_mlp_up(u, &ly->mlp, &fl->mlp);
      if (ly->mlp.gate.n_out > m->inter_max) m->inter_max = ly->mlp.gate.n_out;
      if (ly->mlp.gate.n_out > m->gu_cols) m->gu_cols = ly->mlp.gate.n_out;
      continue;
    }
    fw_dense(u, ly->router, ly->router_bf16, d->n_experts, D, &fl->router);
    fl->router_bias = fw_vec(u, ly->router_bias, d->n_experts);
    if (ly->has_shared) {
      fw_mlp_up(u, &ly->shared, &fl->shared);
      if (ly->shared.gate.n_out > m->inter_max) m->inter_max = ly->shared.gate.n_out;
    }
    fw_mlp *table = (fw_mlp *)calloc((size_t)d->n_experts, sizeof(fw_mlp));
    if (!table) return kd_fail(KD_ENOMEM, "kd_model_create: out of host memory");
    fl->inter = 0;
    for (int64_t e = 0; e < d->n_experts; e++) {
      fw_mlp_up(u, &ly->experts[e], &table[e]);
      if (ly->experts[e].gate.n_out > fl->inter) fl->inter = ly->experts[e].gate.n_out;
    }
    if (fl->inter > m->inter_max) m->inter_max = fl->inter;
    { /* the MoE's g/u rows: S = N * top_k expert rows of width fl->inter, then N shared rows */
      int64_t cols = d->top_k * fl->inter + (ly->has_shared ? ly->shared.gate.n_out : 0);
      if (cols > m->gu_cols) m->gu_cols = cols;
    }
    fl->experts = (fw_mlp *)fw_put(u, table, sizeof(fw_mlp) * (size_t)d->n_experts);
    free(table);
    m->Emax = d->n_experts, m->kmax = d->top_k;
  }
  return u->rc;
}

static void fw_drop_graphs(kd_model *m) {
  for (int64_t i = 0; i < m->n_graphs; i++) cudaGraphExecDestroy(m->graphs[i].exec);
  m->n_graphs = 0;
}

static void fw_free_scratch(kd_model *m) {
  fw_drop_graphs(m);
  if (m->scratch) cudaFree(m->scratch);
  if (m->meta_d) cudaFree(m->meta_d);
  if (m->meta_h) cudaFreeHost(m->meta_h);
  if (m->host_reduce) cudaFreeHost(m->host_reduce);
  m->scratch = m->meta_d = m->meta_h = NULL;
  m->host_reduce = NULL;
  m->cap_rows = m->cap_hidden = 0;
}

static void fw_free_vis(kd_model *m) {
  if (m->vis_d) cudaFree(m->vis_d);
  if (m->vis_h) cudaFreeHost(m->vis_h);
  m->vis_d = m->vis_h = NULL;
  m->cap_vis = 0;
}

static void fw_free_pages(kd_model *m) {
  if (m->pages_d) cudaFree(m->pages_d);
  if (m->pages_h) cudaFreeHost(m->pages_h);
  m->pages_d = m->pages_h = NULL;
  m->cap_pages = 0;
}

extern "C" int kd_model_destroy(kd_model *m) {
  if (!m) return KD_OK;
  if (m->stream) cudaStreamSynchronize(m->stream);
  fw_free_scratch(m);
  fw_free_vis(m);
  fw_free_pages(m);
  if (m->nccl) fw_nccl.comm_destroy(m->nccl);
  if (m->kv) cudaFree(m->kv);
  if (m->arena) cudaFree(m->arena);
  if (m->stream) cudaStreamDestroy(m->stream);
  free(m->layers);
  free(m->inv_freq);
  free(m);
  return KD_OK;
}

extern "C" int kd_model_create(const kd_model_desc *desc, kd_model **out) {
  kd_clear_error();
  KD_CHECK_PTR("kd_model_create", desc);
  KD_CHECK_PTR("kd_model_create", out);
  *out = NULL;
  if (kd_device_count() <= 0) {
    char why[256];
    snprintf(why, sizeof why, "%s", kd_last_error()); /* kd_fail writes the buffer kd_last_error reads */
    return kd_fail(KD_ENODEV, "kd_model_create: no CUDA device (%s); use backend=cpu", why);
  }
  const kd_model_desc *d = desc;
  int64_t D = d->hidden, L = d->kv_lora, R = d->rope_dim;
  if (D <= 0 || d->vocab <= 0 || d->n_layers <= 0 || L <= 0 || R <= 0 || R % 2 || d->nope <= 0 || d->v_head <= 0)
    return kd_fail(KD_EINVAL, "kd_model_create: bad sizes (D=%lld V=%lld layers=%lld L=%lld R=%lld)",
                   (long long)D, (long long)d->vocab, (long long)d->n_layers, (long long)L, (long long)R);
  if (L > FW_ATT_THREADS * FW_ATT_MAX_DIMS)
    return kd_fail(KD_EINVAL, "kd_model_create: kv_lora_rank=%lld > %d supported by the CUDA attention kernel",
                   (long long)L, FW_ATT_THREADS * FW_ATT_MAX_DIMS);
  if ((!d->embed && !d->embed_bf16) || !d->final_norm || !d->layers || !d->inv_freq || !kd_weight_ok(&d->lm_head, d->vocab, D))
    return kd_fail(KD_EINVAL, "kd_model_create: embed, final_norm, lm_head [V, D], layers and inv_freq are required");
  kd_model *m = (kd_model *)calloc(1, sizeof(kd_model));
  if (!m) return kd_fail(KD_ENOMEM, "kd_model_create: out of memory");
  m->d = *d;
  m->d.layers = NULL; /* the caller's arrays are read during create only: the device holds the weights */
  m->d.embed = NULL;
  m->E = L + R;
  m->layers = (fw_layer *)calloc((size_t)d->n_layers, sizeof(fw_layer));
  m->inv_freq = (double *)malloc(sizeof(double) * (size_t)(R / 2));
  if (!m->layers || !m->inv_freq) {
    kd_model_destroy(m);
    return kd_fail(KD_ENOMEM, "kd_model_create: out of memory");
  }
  memcpy(m->inv_freq, d->inv_freq, sizeof(double) * (size_t)(R / 2));
  m->d.inv_freq = m->inv_freq;
  cudaError_t e = cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    kd_model_destroy(m);
    return kd_fail(KD_ECUDA, "kd_model_create: cudaStreamCreate: %s", cudaGetErrorString(e));
  }
  kd_model_desc full = *d; /* uploads read the caller's descriptor */
  kd_model_desc keep = m->d;
  m->d = full;
  fw_up u = {NULL, 0, 0, 0, 0, "kd_model_create"};
  int rc = fw_upload(m, &u);
  if (!rc) {
    e = cudaMalloc((void **)&m->arena, u.need ? u.need : 1);
    if (e != cudaSuccess) {
      cudaGetLastError(); /* reported here, not by a later launch's check */
      m->d = keep;
      kd_model_destroy(m);
      return kd_fail(KD_ENOMEM, "kd_model_create: cudaMalloc(%zu bytes of weights): %s; raise tp or use a larger "
                                "device", u.need, cudaGetErrorString(e));
    }
    m->arena_bytes = u.need;
    u.arena = m->arena;
    u.pass = 1;
    rc = fw_upload(m, &u);
    /* a pageable cudaMemcpy may return before its last DMA lands, and m->stream (non-blocking) does not wait for
     * the legacy stream: finish the upload before any forward reads the arena */
    if (!rc) rc = fw_err_in("kd_model_create", cudaDeviceSynchronize(), "weight upload");
  }
  m->d = keep;
  if (rc) {
    kd_model_destroy(m);
    return rc;
  }
  *out = m;
  return KD_OK;
}

/* ---- scratch and metadata of up to cap_rows rows ------------------------------------------------------ */
typedef struct {
  float *h, *x, *t, *qa, *q, *kva, *qf, *olat, *o, *rl, *work, *ew, *xs, *ys, *g, *u, *sh, *fo, *lg, *hid, *gather;
  int32_t *ex, *start, *src, *pos, *am;
  unsigned char *taken;
  /* metadata (device; the same offsets in the pinned staging) */
  int32_t *tokens;
  fw_row *rows;
  float *cs;
  int64_t *out_rows;
} fw_bufs;

static size_t fw_take(size_t *off, size_t bytes) {
  size_t at = *off;
  *off += fw_align(bytes);
  return at;
}

/* offsets of every buffer for N rows; base = NULL sizes only */
static void fw_layout(const kd_model *m, int64_t N, int64_t n_hidden, char *sbase, char *mbase, fw_bufs *b,
                      size_t *s_bytes, size_t *m_bytes) {
  const kd_model_desc *d = &m->d;
  int64_t D = d->hidden, L = d->kv_lora, R = d->rope_dim, E = m->E, H = m->Hmax, Ex = m->Emax, k = m->kmax;
  int64_t G = d->n_group > 0 ? d->n_group : 1, S = N * k, V = d->vocab;
  size_t o = 0;
#define FW_F(name, n) b->name = (float *)(sbase + fw_take(&o, sizeof(float) * (size_t)(n)))
#define FW_I(name, n) b->name = (int32_t *)(sbase + fw_take(&o, sizeof(int32_t) * (size_t)(n)))
  FW_F(h, N * D); FW_F(x, N * D); FW_F(t, N * D); FW_F(qa, N * m->q_lora); FW_F(q, N * H * (d->nope + R));
  FW_F(kva, N * E); FW_F(qf, N * H * E); FW_F(olat, N * H * L); FW_F(o, N * H * d->v_head);
  FW_F(rl, N * Ex); FW_F(work, N * (Ex + G)); FW_F(ew, S); FW_F(xs, S * D); FW_F(ys, S * D);
  FW_F(g, N * m->gu_cols); FW_F(u, N * m->gu_cols); FW_F(sh, N * D); FW_F(fo, N * D); FW_F(lg, N * V);
  FW_F(hid, N * (n_hidden ? n_hidden : 1) * D);
  FW_F(gather, m->nccl ? m->nccl_ranks * N * D : 1); /* the NCCL all-gather's [ranks, N * D] */
  FW_I(ex, S); FW_I(start, Ex + 1); FW_I(src, S); FW_I(pos, S); FW_I(am, N);
  b->taken = (unsigned char *)(sbase + fw_take(&o, (size_t)(N * (Ex > G ? Ex : G) + 1)));
#undef FW_F
#undef FW_I
  *s_bytes = o;
  o = 0;
  b->tokens = (int32_t *)(mbase + fw_take(&o, sizeof(int32_t) * (size_t)N));
  b->rows = (fw_row *)(mbase + fw_take(&o, sizeof(fw_row) * (size_t)N));
  b->cs = (float *)(mbase + fw_take(&o, sizeof(float) * (size_t)(N * R)));
  b->out_rows = (int64_t *)(mbase + fw_take(&o, sizeof(int64_t) * (size_t)N));
  *m_bytes = o;
}

/* grow-only: a larger forward reallocates and drops the graphs (they hold the old addresses) */
static int fw_reserve(kd_model *m, int64_t N, int64_t n_hidden) {
  if (N <= m->cap_rows && n_hidden <= m->cap_hidden) return KD_OK;
  int64_t rows = N > m->cap_rows ? N : m->cap_rows, hid = n_hidden > m->cap_hidden ? n_hidden : m->cap_hidden;
  cudaStreamSynchronize(m->stream);
  fw_free_scratch(m);
  fw_bufs b;
  size_t sb, mb;
  fw_layout(m, rows, hid, NULL, NULL, &b, &sb, &mb);
  cudaError_t e = cudaMalloc((void **)&m->scratch, sb);
  if (e == cudaSuccess) e = cudaMalloc((void **)&m->meta_d, mb);
  if (e == cudaSuccess) e = cudaMallocHost((void **)&m->meta_h, mb);
  if (e == cudaSuccess && m->d.all_reduce && !m->nccl)
    e = cudaMallocHost((void **)&m->host_reduce, sizeof(float) * (size_t)(rows * m->d.hidden));
  if (e != cudaSuccess) {
    fw_free_scratch(m);
    cudaGetLastError();
    return kd_fail(KD_ENOMEM, "kd_model_forward: scratch of %lld rows (%zu bytes): %s; lower serve.max_batch_tokens",
                   (long long)rows, sb + mb, cudaGetErrorString(e));
  }
  m->cap_rows = rows, m->cap_hidden = hid, m->meta_bytes = mb;
  return KD_OK;
}

/* grow-only visibility staging of `words` u64 (never invalidates a graph: rows point into it through metadata) */
static int fw_reserve_vis(kd_model *m, int64_t words) {
  if (words <= m->cap_vis) return KD_OK;
  cudaStreamSynchronize(m->stream);
  fw_free_vis(m);
  cudaError_t e = cudaMalloc((void **)&m->vis_d, sizeof(uint64_t) * (size_t)words);
  if (e == cudaSuccess) e = cudaMallocHost((void **)&m->vis_h, sizeof(uint64_t) * (size_t)words);
  if (e != cudaSuccess) {
    fw_free_vis(m);
    cudaGetLastError();
    return kd_fail(KD_ENOMEM, "kd_model_forward: visibility staging of %lld words: %s", (long long)words,
                   cudaGetErrorString(e));
  }
  m->cap_vis = words;
  return KD_OK;
}

/* grow-only page-table staging of n int32 (rows point into it through metadata, as the visibility) */
static int fw_reserve_pages(kd_model *m, int64_t n) {
  if (n <= m->cap_pages) return KD_OK;
  cudaStreamSynchronize(m->stream);
  fw_free_pages(m);
  cudaError_t e = cudaMalloc((void **)&m->pages_d, sizeof(int32_t) * (size_t)n);
  if (e == cudaSuccess) e = cudaMallocHost((void **)&m->pages_h, sizeof(int32_t) * (size_t)n);
  if (e != cudaSuccess) {
    fw_free_pages(m);
    cudaGetLastError();
    return kd_fail(KD_ENOMEM, "kd_model_forward: page-table staging of %lld entries: %s", (long long)n,
                   cudaGetErrorString(e));
  }
  m->cap_pages = n;
  return KD_OK;
}

/* ---- the kernel sequence of one forward (eager or under capture) --------------------------------------- */
/* out[T, n_out] = x[T, n_in] w^T on stream st (fn names the entry point in an error); rows in launches of at most
 * 65535 (grid.y's limit: a drafter context extend may be longer) */
static int fw_lin_on(cudaStream_t st, const char *fn, const fw_w *w, const float *x, float *out, int64_t T) {
  for (int64_t t0 = 0; t0 < T; t0 += 65535) {
    int64_t rows = T - t0 < 65535 ? T - t0 : 65535;
    dim3 grid((unsigned)((w->n_out + FW_WARPS - 1) / FW_WARPS), (unsigned)rows);
    fw_linear_kernel<<<grid, 32 * FW_WARPS, 0, st>>>(*w, x + t0 * w->n_in, w->n_in, out + t0 * w->n_out, w->n_out);
    FW_TRY(fw_err_in(fn, cudaGetLastError(), "linear"));
  }
  return KD_OK;
}

static int fw_lin(kd_model *m, const fw_w *w, const float *x, float *out, int64_t T) {
  return fw_lin_on(m->stream, "kd_model_forward", w, x, out, T);
}

static int fw_mlp_rows_on(cudaStream_t st, const char *fn, const fw_mlp *p, const float *x, float *y, int64_t n,
                          float *g, float *u) {
  int64_t I = p->gate.n_out;
  FW_TRY(fw_lin_on(st, fn, &p->gate, x, g, n));
  FW_TRY(fw_lin_on(st, fn, &p->up, x, u, n));
  FW_TRY(kd_silu_mul(g, u, g, n, I, st));
  return fw_lin_on(st, fn, &p->down, g, y, n);
}

static int fw_mlp_rows(kd_model *m, const fw_mlp *p, const float *x, float *y, int64_t n, float *g, float *u) {
  return fw_mlp_rows_on(m->stream, "kd_model_forward", p, x, y, n, g, u);
}

static int fw_reduce(kd_model *m, const fw_bufs *b, float *x, int64_t n) {
  if (m->nccl) { /* all-gather the partials on the stream, then add them in rank order: graph-capturable */
    FW_TRY(fw_nccl_err("kd_model_forward", fw_nccl.all_gather(x, b->gather, (size_t)n, FW_NCCL_FLOAT32, m->nccl,
                                                              m->stream), "ncclAllGather"));
    fw_ordered_sum_kernel<<<fw_blocks(n), 256, 0, m->stream>>>(b->gather, x, n, m->nccl_ranks);
    return fw_launched("ordered sum");
  }
  if (!m->d.all_reduce) return KD_OK;
  cudaError_t e = cudaMemcpyAsync(m->host_reduce, x, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost, m->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(m->stream);
  FW_TRY(fw_err(e, "all-reduce staging"));
  if (m->d.all_reduce(m->host_reduce, n, m->d.all_reduce_ctx))
    return kd_fail(KD_EINVAL, "kd_model_forward: the tensor-parallel all-reduce failed (see the rank's log)");
  return fw_err(cudaMemcpyAsync(x, m->host_reduce, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice, m->stream),
                "all-reduce staging");
}

static int fw_moe(kd_model *m, const fw_layer *ly, const fw_bufs *b, const float *x, float *out, int64_t N) {
  const kd_model_desc *d = &m->d;
  /* g/u: S expert rows of this layer's width I, then the shared expert's N rows (m->gu_cols per forward row) */
  int64_t D = d->hidden, E = d->n_experts, k = d->top_k, S = N * k, I = ly->inter, G = d->n_group;
  cudaStream_t st = m->stream;
  FW_TRY(fw_lin(m, &ly->router, x, b->rl, N));
  fw_route_kernel<<<(unsigned)((N + 127) / 128), 128, 0, st>>>(b->rl, ly->router_bias, b->work, b->taken, b->ex,
                                                               b->ew, N, E, G, d->topk_group, k, d->norm_topk_prob,
                                                               d->routed_scale);
  FW_TRY(fw_launched("routing"));
  fw_sort_kernel<<<1, 1, 0, st>>>(b->ex, b->start, b->src, b->pos, S, E, k);
  FW_TRY(fw_launched("expert sort"));
  fw_gather_kernel<<<fw_blocks(S * D), 256, 0, st>>>(x, b->src, b->xs, S, D);
  FW_TRY(fw_launched("expert gather"));
  dim3 gu((unsigned)((ly->inter + FW_WARPS - 1) / FW_WARPS), (unsigned)E);
  fw_experts_kernel<<<gu, 32 * FW_WARPS, 0, st>>>(ly->experts, b->start, b->xs, D, b->g, b->u, I, 0);
  FW_TRY(fw_launched("experts gate/up"));
  FW_TRY(kd_silu_mul(b->g, b->u, b->g, S, I, st));
  dim3 dn((unsigned)((D + FW_WARPS - 1) / FW_WARPS), (unsigned)E);
  fw_experts_kernel<<<dn, 32 * FW_WARPS, 0, st>>>(ly->experts, b->start, b->g, I, b->ys, NULL, D, 1);
  FW_TRY(fw_launched("experts down"));
  if (ly->has_shared) FW_TRY(fw_mlp_rows(m, &ly->shared, x, b->sh, N, b->g + S * I, b->u + S * I));
  fw_combine_kernel<<<fw_blocks(N * D), 256, 0, st>>>(b->ys, b->pos, b->ew, ly->has_shared ? b->sh : NULL, out, N, D,
                                                      k);
  return fw_launched("expert combine");
}

static int fw_layers(kd_model *m, const fw_bufs *b, int64_t N, int64_t n_out, int want_out, int want_argmax,
                     int64_t n_hidden, const int64_t *hidden_layers) {
  const kd_model_desc *d = &m->d;
  int64_t D = d->hidden, L = d->kv_lora, R = d->rope_dim, E = m->E, nope = d->nope, V = d->vocab;
  cudaStream_t st = m->stream;
  if (m->embed_bf16)
    fw_embed_kernel<<<fw_blocks(N * D), 256, 0, st>>>(m->embed_bf16, b->tokens, b->h, N, D);
  else
    fw_embed_kernel<<<fw_blocks(N * D), 256, 0, st>>>(m->embed_f32, b->tokens, b->h, N, D);
  FW_TRY(fw_launched("embed"));
  for (int64_t li = 0; li < d->n_layers; li++) {
    const fw_layer *ly = &m->layers[li];
    int64_t H = ly->heads, qw = nope + R;
    /* attention: h = h + o_proj(absorbed MLA(norm(h))) */
    FW_TRY(kd_rms_norm(b->h, ly->in_norm, b->x, N, D, d->eps, st));
    FW_TRY(fw_lin(m, &ly->q_a, b->x, b->qa, N));
    FW_TRY(kd_rms_norm(b->qa, ly->q_a_norm, b->qa, N, ly->q_a.n_out, d->eps, st));
    FW_TRY(fw_lin(m, &ly->q_b, b->qa, b->q, N));                      /* q: [N, H, nope+R] */
    FW_TRY(fw_lin(m, &ly->kv_a, b->x, b->kva, N));                    /* kv_a: [N, L+R] */
    fw_cache_write_kernel<<<(unsigned)N, FW_NORM_THREADS, 0, st>>>(b->kva, ly->kv_a_norm, b->rows, b->cs, li, L, R,
                                                                    d->eps);
    FW_TRY(fw_launched("latent cache write"));
    fw_q_rope_kernel<<<(unsigned)(N * H), 64, 0, st>>>(b->q, b->qf, b->cs, H, nope, L, R);
    FW_TRY(fw_launched("q rope"));
    dim3 gk((unsigned)(N * H), (unsigned)((L + FW_WARPS - 1) / FW_WARPS)); /* qf[:, :, :L] = W_uk[h]^T q_nope[h] */
    fw_head_linear_kernel<<<gk, 32 * FW_WARPS, 0, st>>>(ly->w_uk_t, L, b->q, H * qw, qw, b->qf, H * E, E, H);
    FW_TRY(fw_launched("absorbed q"));
    fw_attention_kernel<<<(unsigned)(N * H), FW_ATT_THREADS, 0, st>>>(b->qf, b->rows, b->olat, li, H, L, R,
                                                                       d->attn_scale);
    FW_TRY(fw_launched("MLA attention"));
    dim3 gv((unsigned)(N * H), (unsigned)((d->v_head + FW_WARPS - 1) / FW_WARPS));
    fw_head_linear_kernel<<<gv, 32 * FW_WARPS, 0, st>>>(ly->w_uv, d->v_head, b->olat, H * L, L, b->o, H * d->v_head,
                                                         d->v_head, H);
    FW_TRY(fw_launched("absorbed v"));
    FW_TRY(fw_lin(m, &ly->o, b->o, b->t, N));
    FW_TRY(fw_reduce(m, b, b->t, N * D));
    fw_add_kernel<<<fw_blocks(N * D), 256, 0, st>>>(b->h, b->t, N * D);
    FW_TRY(fw_launched("residual"));
    /* MLP / MoE: h = h + mlp(norm(h)) */
    FW_TRY(kd_rms_norm(b->h, ly->post_norm, b->x, N, D, d->eps, st));
    if (ly->is_moe)
      FW_TRY(fw_moe(m, ly, b, b->x, b->t, N));
    else
      FW_TRY(fw_mlp_rows(m, &ly->mlp, b->x, b->t, N, b->g, b->u));
    FW_TRY(fw_reduce(m, b, b->t, N * D));
    fw_add_kernel<<<fw_blocks(N * D), 256, 0, st>>>(b->h, b->t, N * D);
    FW_TRY(fw_launched("residual"));
    for (int64_t j = 0; j < n_hidden; j++)
      if (hidden_layers[j] == li)
        FW_TRY(fw_err(cudaMemcpy2DAsync(b->hid + j * D, sizeof(float) * (size_t)(n_hidden * D), b->h,
                                        sizeof(float) * (size_t)D, sizeof(float) * (size_t)D, (size_t)N,
                                        cudaMemcpyDeviceToDevice, st), "hidden copy"));
  }
  if (n_out == 0 || !want_out) return KD_OK;
  /* final norm + lm_head of the asked rows only (row-wise: the same bits as over all rows) */
  fw_gather_rows_kernel<<<fw_blocks(n_out * D), 256, 0, st>>>(b->h, b->out_rows, b->x, n_out, D);
  FW_TRY(fw_launched("output rows"));
  FW_TRY(kd_rms_norm(b->x, m->final_norm, b->fo, n_out, D, d->eps, st));
  FW_TRY(fw_lin(m, &m->lm_head, b->fo, b->lg, n_out));
  if (want_argmax) {
    fw_argmax_kernel<<<(unsigned)n_out, 256, 0, st>>>(b->lg, b->am, V);
    FW_TRY(fw_launched("argmax"));
  }
  return KD_OK;
}

/* ---- the paged latent arena --------------------------------------------------------------------------- */
/* grow or shrink a layer-major device arena [n_layers][n_pages][page_bytes]: the first min(old, new) pages of every
 * layer are copied into the resized layer blocks when keep is set (the page size is unchanged), new pages are
 * zeroed; waits for `st` (a queued kernel may read the old arena) */
static int fw_arena_resize(float **arena, int64_t old_pages, int64_t want_pages, int64_t n_layers, size_t page_bytes,
                           int keep, cudaStream_t st, const char *fn) {
  FW_TRY(fw_err_in(fn, cudaStreamSynchronize(st), "synchronize"));
  float *a = NULL;
  if (want_pages) {
    size_t layer = page_bytes * (size_t)want_pages;
    cudaError_t e = cudaMalloc((void **)&a, layer * (size_t)n_layers);
    if (e != cudaSuccess) {
      cudaGetLastError(); /* else the next forward's first launch check reports this OOM */
      return kd_fail(KD_ENOMEM, "%s: %zu bytes of device memory for %lld pages: %s; lower serve.kv_pool_tokens "
                                "(pipeline=plan backend=cuda prints what fits)", fn, layer * (size_t)n_layers,
                     (long long)want_pages, cudaGetErrorString(e));
    }
    int64_t kept = keep ? (old_pages < want_pages ? old_pages : want_pages) : 0;
    e = cudaMemset(a, 0, layer * (size_t)n_layers);
    if (e == cudaSuccess && kept) /* every layer's first pages: one strided copy */
      e = cudaMemcpy2D(a, layer, *arena, page_bytes * (size_t)old_pages, page_bytes * (size_t)kept, (size_t)n_layers,
                       cudaMemcpyDeviceToDevice);
    if (e != cudaSuccess) {
      cudaFree(a);
      return fw_err_in(fn, e, "arena copy");
    }
  }
  if (*arena) cudaFree(*arena);
  *arena = a;
  return KD_OK;
}

extern "C" int kd_model_pages(kd_model *m, int64_t n_pages, int64_t page_rows) {
  static const char *fn = "kd_model_pages";
  kd_clear_error();
  KD_CHECK_PTR(fn, m);
  if (n_pages < 0 || page_rows <= 0)
    return kd_fail(KD_EINVAL, "%s: n_pages=%lld, page_rows=%lld; give n_pages >= 0 and page_rows >= 1", fn,
                   (long long)n_pages, (long long)page_rows);
  size_t page = sizeof(float) * (size_t)(page_rows * m->E);   /* one layer's rows of a page */
  FW_TRY(fw_arena_resize(&m->kv, m->n_pages, n_pages, m->d.n_layers, page, page_rows == m->page_rows, m->stream, fn));
  m->n_pages = n_pages, m->page_rows = page_rows;
  return KD_OK;
}

/* a sequence's rows [start, start + n) inside its table of n_table pages, every page inside the arena */
static int fw_table_check(const char *fn, const int32_t *pages, int64_t n_table, int64_t start, int64_t n,
                          int64_t n_pages, int64_t page_rows) {
  int64_t zero = 0, bounds[2] = {0, n_table}, rows[2] = {0, start + n};
  if (start < 0 || n < 0) return kd_fail(KD_EINVAL, "%s: start=%lld n=%lld", fn, (long long)start, (long long)n);
  return kd_page_tables_check(fn, 1, pages, bounds, &zero, rows, n_pages, page_rows);
}

extern "C" int kd_cache_keep(kd_model *m, const int32_t *pages, int64_t n_table, int64_t start, const int64_t *rows,
                             int64_t n) {
  static const char *fn = "kd_cache_keep";
  kd_clear_error();
  KD_CHECK_PTR(fn, m);
  if (n && !rows) return kd_fail(KD_EINVAL, "%s: rows is NULL", fn);
  int64_t end = n ? rows[n - 1] + 1 : start;
  FW_TRY(fw_table_check(fn, pages, n_table, start, end - start, m->n_pages, m->page_rows));
  for (int64_t i = 0; i < n; i++)
    if (rows[i] < start || (i && rows[i] <= rows[i - 1]))
      return kd_fail(KD_EINVAL, "%s: rows must ascend from start=%lld", fn, (long long)start);
  int moved = 0;
  for (int64_t i = 0; i < n; i++) moved |= rows[i] != start + i;
  if (!moved) return KD_OK;
  /* the rows and the table travel in the metadata staging (out_rows: int64, then int32 page ids) */
  size_t rb = sizeof(int64_t) * (size_t)n, pb = sizeof(int32_t) * (size_t)n_table;
  FW_TRY(fw_reserve(m, (int64_t)((rb + pb) / sizeof(int64_t)) + 1, 0));
  memcpy(m->meta_h, rows, rb);
  memcpy(m->meta_h + rb, pages, pb);
  cudaError_t e = cudaMemcpyAsync(m->meta_d, m->meta_h, rb + pb, cudaMemcpyHostToDevice, m->stream);
  FW_TRY(fw_err_in(fn, e, "rows upload"));
  fw_keep_kernel<<<(unsigned)m->d.n_layers, 256, 0, m->stream>>>(m->kv, (const int32_t *)(m->meta_d + rb),
                                                                 m->page_rows, m->n_pages * m->page_rows, m->E,
                                                                 (const int64_t *)m->meta_d, start, n);
  FW_TRY(fw_err_in(fn, cudaGetLastError(), "row move kernel"));
  return fw_err_in(fn, cudaStreamSynchronize(m->stream), "synchronize"); /* the staging is reused by the next call */
}

/* rows of one sequence into HOST out [n_layers, n, L+R]: one copy per layer and page run */
extern "C" int kd_cache_gather(kd_model *m, const int32_t *pages, int64_t n_table, int64_t start, int64_t n,
                               float *out) {
  static const char *fn = "kd_cache_gather";
  kd_clear_error();
  KD_CHECK_PTR(fn, m);
  if (n && !out) return kd_fail(KD_EINVAL, "%s: out is NULL", fn);
  FW_TRY(fw_table_check(fn, pages, n_table, start, n, m->n_pages, m->page_rows));
  FW_TRY(fw_err_in(fn, cudaStreamSynchronize(m->stream), "synchronize")); /* rows written by a forward are complete */
  const int64_t E = m->E, P = m->page_rows;
  for (int64_t l = 0; l < m->d.n_layers; l++)
    for (int64_t i = 0, k; i < n; i = k) {
      k = (start + i) / P * P + P - start; /* the end of row start + i's page */
      if (k > n) k = n;
      cudaError_t e = cudaMemcpy(out + (l * n + i) * E, m->kv + kd_page_row(pages, P, m->n_pages * P, E, l, start + i),
                                 sizeof(float) * (size_t)((k - i) * E), cudaMemcpyDeviceToHost);
      FW_TRY(fw_err_in(fn, e, "rows download"));
    }
  return KD_OK;
}

/* ---- graphs ------------------------------------------------------------------------------------------ */
extern "C" int kd_model_set_graph_rows(kd_model *m, const int64_t *rows, int64_t n) {
  kd_clear_error();
  KD_CHECK_PTR("kd_model_set_graph_rows", m);
  if (n < 0 || n > FW_MAX_GRAPHS || (n && !rows))
    return kd_fail(KD_EINVAL, "kd_model_set_graph_rows: n=%lld buckets; give 0..%d row counts", (long long)n,
                   FW_MAX_GRAPHS);
  for (int64_t i = 0; i < n; i++)
    if (rows[i] <= 0)
      return kd_fail(KD_EINVAL, "kd_model_set_graph_rows: rows[%lld]=%lld must be >= 1", (long long)i,
                     (long long)rows[i]);
  cudaStreamSynchronize(m->stream);
  fw_drop_graphs(m);
  if (n) memcpy(m->graph_rows, rows, sizeof(int64_t) * (size_t)n);
  m->n_graph_rows = n;
  /* scratch for the largest bucket now: a later growth of the scratch (a bigger forward than any before) moves
   * every buffer and drops the graphs captured so far, so a verify block larger than the prefill would
   * otherwise re-capture the AR step's graph */
  int64_t big = 0;
  for (int64_t i = 0; i < n; i++)
    if (rows[i] > big) big = rows[i];
  if (big > 65535)
    return kd_fail(KD_EINVAL, "kd_model_set_graph_rows: bucket of %lld rows > 65535 rows per forward on CUDA",
                   (long long)big);
  if (big) {
    int rc = fw_reserve(m, big, m->cap_hidden);
    if (!rc) rc = fw_reserve_vis(m, big * ((big + 63) / 64));
    if (rc) {
      char why[256];
      snprintf(why, sizeof why, "%s", kd_last_error()); /* kd_fail writes the buffer kd_last_error reads */
      return kd_fail(rc, "kd_model_set_graph_rows: %s", why);
    }
  }
  return KD_OK;
}

/* Tensor parallel on the stream: every rank of the group calls this with rank 0's id (kd_nccl_unique_id) and the
 * same nranks (ncclCommInitRank is collective: it returns when all ranks have joined). From then on the forward's
 * two all-reduces per layer are an ncclAllGather plus the rank-ordered sum, on the model's stream, and graphs stay
 * on. id128 NULL (or nranks 0) drops the communicator: back to desc.all_reduce. */
extern "C" int kd_model_set_nccl(kd_model *m, const char *nccl_lib, const uint8_t *id128, int64_t nranks,
                                 int64_t rank) {
  static const char *fn = "kd_model_set_nccl";
  kd_clear_error();
  KD_CHECK_PTR(fn, m);
  if (id128 && nranks != 0 && (nranks < 1 || rank < 0 || rank >= nranks))
    return kd_fail(KD_EINVAL, "%s: rank=%lld of nranks=%lld", fn, (long long)rank, (long long)nranks);
  cudaStreamSynchronize(m->stream);
  int64_t rows = m->cap_rows, hid = m->cap_hidden;
  fw_free_scratch(m); /* the gather buffer's size changes: scratch (and the graphs) are made again below */
  if (m->nccl) {
    fw_nccl.comm_destroy(m->nccl);
    m->nccl = NULL, m->nccl_ranks = 0, m->nccl_rank = 0;
  }
  int rc = KD_OK;
  if (id128 && nranks != 0) {
    rc = fw_nccl_load(fn, nccl_lib);
    if (!rc) {
      fw_nccl_id id;
      memcpy(id.internal, id128, sizeof id.internal);
      fw_nccl_comm_t comm = NULL;
      rc = fw_nccl_err(fn, fw_nccl.comm_init_rank(&comm, (int)nranks, id, (int)rank), "ncclCommInitRank");
      if (!rc) m->nccl = comm, m->nccl_ranks = nranks, m->nccl_rank = rank;
    }
  }
  if (rows) { /* as large as before (set_graph_rows sized it for the largest bucket) */
    char why[256];
    snprintf(why, sizeof why, "%s", rc ? kd_last_error() : "");
    int r2 = fw_reserve(m, rows, hid);
    if (rc) return kd_fail(rc, "%s", why);
    return r2;
  }
  return rc;
}

extern "C" int kd_model_moe_stats(kd_model *m, int64_t *stats, int reset) {
  (void)reset;
  KD_CHECK_PTR("kd_model_moe_stats", m);
  KD_CHECK_PTR("kd_model_moe_stats", stats);
  return kd_fail(KD_EINVAL, "kd_model_moe_stats: the CUDA build routes on the device and does not count experts "
                            "per forward; measure the expert union with backend=cpu");
}

extern "C" int kd_model_graph_stats(kd_model *m, int64_t *stats, double *capture_seconds) {
  KD_CHECK_PTR("kd_model_graph_stats", m);
  KD_CHECK_PTR("kd_model_graph_stats", stats);
  stats[0] = m->n_graphs, stats[1] = m->replays, stats[2] = m->eager, stats[3] = m->n_graph_rows;
  if (capture_seconds) *capture_seconds = m->capture_s;
  return KD_OK;
}

static double fw_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the forward ------------------------------------------------------------------------------------- */
static int fw_check(kd_model *m, const kd_forward_args *a) {
  int rc = kd_forward_args_check(a, m->d.vocab, m->d.n_layers, m->n_pages, m->page_rows);
  if (rc) return rc;
  if (a->n_rows > 65535)
    return kd_fail(KD_EINVAL, "kd_model_forward: n_rows=%lld > 65535 rows per call on CUDA; split the batch "
                              "(serve.max_batch_tokens)", (long long)a->n_rows);
  if (a->n_hidden > FW_MAX_HIDDEN)
    return kd_fail(KD_EINVAL, "kd_model_forward: n_hidden=%lld > %d hidden layers per call on CUDA",
                   (long long)a->n_hidden, FW_MAX_HIDDEN);
  /* expert pruning is the CPU build's (its routing runs on the host): here no row is pruned, which is lossless too */
  if (a->row_value) memset(a->row_pruned, 0, (size_t)a->n_rows);
  return KD_OK;
}

/* the forward's metadata into the pinned staging: tokens, per-row cache/block/visibility, cos/sin, out rows */
static void fw_stage(kd_model *m, const kd_forward_args *a, fw_bufs *hb) {
  const kd_model_desc *d = &m->d;
  int64_t N = a->n_rows, R = d->rope_dim, half = R / 2, vis_off = 0; /* vis: into m->vis_h, rows point to vis_d */
  memcpy(hb->tokens, a->tokens, sizeof(int32_t) * (size_t)N);
  const uint64_t *vis = a->visibility;
  memcpy(m->pages_h, a->pages, sizeof(int32_t) * (size_t)a->page_start[a->n_seqs]);
  for (int64_t s = 0; s < a->n_seqs; s++) {
    int64_t r0 = a->row_start[s], T = a->row_start[s + 1] - r0, words = (T + 63) / 64, len = a->lengths[s];
    for (int64_t t = 0; t < T; t++) {
      fw_row *row = &hb->rows[r0 + t];
      row->arena = m->kv, row->pages = m->pages_d + a->page_start[s], row->page_rows = m->page_rows;
      row->layer_rows = m->n_pages * m->page_rows, row->dst = len + t, row->prefix = len;
      row->t = t, row->T = T, row->vis = vis ? m->vis_d + vis_off : NULL;
    }
    if (vis) {
      memcpy(m->vis_h + vis_off, vis, sizeof(uint64_t) * (size_t)(T * words));
      vis += T * words;
      vis_off += T * words;
    }
  }
  for (int64_t r = 0; r < N; r++) /* YaRN cos/sin (float64, rounded once), as the CPU build */
    for (int64_t i = 0; i < half; i++) {
      double ang = (double)a->positions[r] * m->inv_freq[i];
      hb->cs[r * R + i] = (float)(cos(ang) * d->rope_mscale);
      hb->cs[r * R + half + i] = (float)(sin(ang) * d->rope_mscale);
    }
  for (int64_t i = 0; i < a->n_out; i++) hb->out_rows[i] = a->out_rows ? a->out_rows[i] : i;
}

static fw_graph *fw_find_graph(kd_model *m, const fw_graph *key) {
  for (int64_t i = 0; i < m->n_graphs; i++) {
    fw_graph *g = &m->graphs[i];
    if (g->N == key->N && g->n_out == key->n_out && g->want_logits == key->want_logits &&
        g->want_argmax == key->want_argmax && g->n_hidden == key->n_hidden &&
        !memcmp(g->hidden, key->hidden, sizeof(int64_t) * (size_t)key->n_hidden))
      return g;
  }
  return NULL;
}

static int fw_graph_bucket(const kd_model *m, int64_t N) {
  if (m->d.all_reduce && !m->nccl) return 0; /* a host callback cannot be captured (NCCL on the stream can) */
  if (m->graphs_broken) return 0;
  for (int64_t i = 0; i < m->n_graph_rows; i++)
    if (m->graph_rows[i] == N) return 1;
  return 0;
}

static int fw_run(kd_model *m, const fw_bufs *b, const kd_forward_args *a, const fw_graph *key) {
  int want_out = (a->logits || a->argmax) ? 1 : 0;
  if (!fw_graph_bucket(m, a->n_rows)) {
    if (!m->said_eager && m->n_graph_rows) {
      fprintf(stderr, "kdtree cuda: a forward of %lld rows is outside the graph buckets; launched eagerly (said once)\n",
              (long long)a->n_rows);
      m->said_eager = 1;
    }
    m->eager++;
    return fw_layers(m, b, a->n_rows, a->n_out, want_out, a->argmax != NULL, a->n_hidden, a->hidden_layers);
  }
  fw_graph *g = fw_find_graph(m, key);
  if (!g) {
    if (m->n_graphs == FW_MAX_GRAPHS) { /* more output shapes than slots: eager, never an error */
      m->eager++;
      return fw_layers(m, b, a->n_rows, a->n_out, want_out, a->argmax != NULL, a->n_hidden, a->hidden_layers);
    }
    double t0 = fw_now();
    cudaError_t e = cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeThreadLocal);
    int rc = KD_OK;
    cudaGraph_t graph = NULL;
    if (e == cudaSuccess) {
      rc = fw_layers(m, b, a->n_rows, a->n_out, want_out, a->argmax != NULL, a->n_hidden, a->hidden_layers);
      e = cudaStreamEndCapture(m->stream, &graph);
    }
    if (rc && e == cudaSuccess) { /* the forward itself failed (its message is set) and the capture did not */
      if (graph) cudaGraphDestroy(graph);
      cudaGetLastError();
      return rc;
    }
    fw_graph ng = *key;
    const char *step = "capture";
    if (e == cudaSuccess) {
      step = "instantiate";
      e = cudaGraphInstantiate(&ng.exec, graph, 0);
    }
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess) { /* the device or driver refuses graphs (a launch inside an invalidated capture fails
                             * too): nothing captured ran, so run it eagerly; a real error shows again there */
      fprintf(stderr, "kdtree cuda: CUDA graph %s failed (%s); this model launches every forward eagerly from now "
                      "on (said once)\n", step, cudaGetErrorString(e));
      cudaGetLastError();
      kd_clear_error();
      m->graphs_broken = 1;
      m->eager++;
      return fw_layers(m, b, a->n_rows, a->n_out, want_out, a->argmax != NULL, a->n_hidden, a->hidden_layers);
    }
    m->graphs[m->n_graphs] = ng;
    g = &m->graphs[m->n_graphs++];
    m->capture_s += fw_now() - t0;
  } else {
    m->replays++;
  }
  return fw_err(cudaGraphLaunch(g->exec, m->stream), "graph launch");
}

extern "C" int kd_model_forward(kd_model *m, const kd_forward_args *a) {
  kd_clear_error();
  KD_CHECK_PTR("kd_model_forward", m);
  KD_CHECK_PTR("kd_model_forward", a);
  FW_TRY(fw_check(m, a));
  const kd_model_desc *d = &m->d;
  int64_t N = a->n_rows, D = d->hidden, V = d->vocab, n_out = a->n_out;
  int64_t vis_words = 0;
  for (int64_t s = 0; a->visibility && s < a->n_seqs; s++) {
    int64_t T = a->row_start[s + 1] - a->row_start[s];
    vis_words += T * ((T + 63) / 64);
  }
  FW_TRY(fw_reserve(m, N, a->n_hidden));
  FW_TRY(fw_reserve_vis(m, vis_words));
  FW_TRY(fw_reserve_pages(m, a->page_start[a->n_seqs]));
  fw_bufs hb, db;
  size_t sb, mb;
  fw_layout(m, m->cap_rows, m->cap_hidden, m->scratch, m->meta_h, &hb, &sb, &mb);
  fw_layout(m, m->cap_rows, m->cap_hidden, m->scratch, m->meta_d, &db, &sb, &mb);
  fw_stage(m, a, &hb);
  /* this forward's part of each metadata array only (the staging is sized for cap_rows, which only grows) */
  struct {
    void *dst;
    const void *src;
    size_t bytes;
  } up[] = {{db.tokens, hb.tokens, sizeof(int32_t) * (size_t)N},
            {db.rows, hb.rows, sizeof(fw_row) * (size_t)N},
            {db.cs, hb.cs, sizeof(float) * (size_t)(N * d->rope_dim)},
            {db.out_rows, hb.out_rows, sizeof(int64_t) * (size_t)n_out},
            {m->vis_d, m->vis_h, sizeof(uint64_t) * (size_t)vis_words},
            {m->pages_d, m->pages_h, sizeof(int32_t) * (size_t)a->page_start[a->n_seqs]}};
  for (size_t i = 0; i < sizeof up / sizeof up[0]; i++)
    if (up[i].bytes)
      FW_TRY(fw_err(cudaMemcpyAsync(up[i].dst, up[i].src, up[i].bytes, cudaMemcpyHostToDevice, m->stream),
                    "metadata upload"));
  fw_graph key;
  memset(&key, 0, sizeof key);
  key.N = N, key.n_out = n_out, key.want_logits = a->logits != NULL, key.want_argmax = a->argmax != NULL;
  key.n_hidden = a->n_hidden;
  if (a->n_hidden) memcpy(key.hidden, a->hidden_layers, sizeof(int64_t) * (size_t)a->n_hidden);
  int rc = fw_run(m, &db, a, &key);
  cudaError_t e = cudaSuccess;
  if (!rc && n_out && a->logits)
    e = cudaMemcpyAsync(a->logits, db.lg, sizeof(float) * (size_t)(n_out * V), cudaMemcpyDeviceToHost, m->stream);
  if (!rc && e == cudaSuccess && n_out && a->argmax)
    e = cudaMemcpyAsync(a->argmax, db.am, sizeof(int32_t) * (size_t)n_out, cudaMemcpyDeviceToHost, m->stream);
  if (!rc && e == cudaSuccess && a->n_hidden)
    e = cudaMemcpyAsync(a->hidden, db.hid, sizeof(float) * (size_t)(N * a->n_hidden * D), cudaMemcpyDeviceToHost,
                        m->stream);
  cudaError_t se = cudaStreamSynchronize(m->stream); /* the staging is reused by the next forward */
  if (rc) return rc;
  return fw_err(e != cudaSuccess ? e : se, "outputs");
}

/* ---- the DFlash drafter (kd_forward.c's kd_drafter_*, the same order of operations) ------------------------
 * Weights uploaded once into its own arena (embed / lm_head are the target's tensors: with desc.target the
 * drafter reads the target model's device copies, else it uploads its own), a paged K/V context arena on the
 * device (the target's page ids: kd_drafter_pages), grow-only device scratch, one stream. feats and logits are HOST arrays, as in the CPU build: one H2D
 * of the context rows per extend, one D2H of the block's logits per sequence. Its linears are fw_linear_kernel's
 * warp dots; the attention is one block per (query, head) over the cached + block keys (scores in scratch,
 * softmax, weighted values: kd_forward.c's formulas in a different summation order, so parity is within the
 * suite's tolerance, as the CPU build's). No CUDA graphs yet: a draft is ~20 launches per layer. */
typedef struct {
  const float *in_norm, *post_norm, *q_norm, *k_norm; /* device */
  fw_w q, k, v, o;
  fw_mlp mlp;
} fw_dlayer;

struct kd_drafter {
  kd_drafter_desc d; /* sizes only: the caller's pointers are read during create */
  fw_dlayer *layers; /* host array of device pointers */
  fw_w fc, lm_head;
  const float *hidden_norm, *final_norm, *embed_f32;
  const __nv_bfloat16 *embed_bf16;
  char *arena;
  size_t arena_bytes;
  float *k, *v;   /* kd_drafter_pages: device [n_layers][n_pages * page_rows][Hkv*hd] each */
  int64_t n_pages, page_rows, kvw, inter;
  cudaStream_t stream;
  char *scratch; /* device, grow-only */
  size_t scratch_bytes;
  char *host; /* host staging of rope tables and block tokens, grow-only */
  size_t host_bytes;
};

/* x [T, H, hd] in place: (a c - b s, b c + a s) over the two halves (kd_forward.c's kd_rope_half); grid T * H */
__global__ void fw_rope_half_kernel(float *__restrict__ x, const float *__restrict__ cs, int64_t H, int64_t hd) {
  const int64_t r = blockIdx.x / H, half = hd / 2;
  float *v = x + (int64_t)blockIdx.x * hd;
  const float *c = cs + r * hd, *s = c + half;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    float a = v[i], b = v[i + half];
    v[i] = a * c[i] + -b * s[i];
    v[i + half] = b * c[i] + a * s[i];
  }
}

/* the drafter's non-causal GQA: block u = (query t, head hh) over n cached (layer li of the arenas ka / va, through
 * the page table pt) + B block keys; p: ps floats per block */
__global__ void fw_dattn_kernel(const float *__restrict__ q, const float *__restrict__ ka, const float *__restrict__ va,
                                const int32_t *__restrict__ pt, int64_t page_rows, int64_t layer_rows, int64_t li,
                                const float *__restrict__ kb, const float *__restrict__ vb, int64_t n, int64_t B,
                                int64_t hq, int64_t hkv, int64_t hd, float scale, float *__restrict__ p, int64_t ps,
                                float *__restrict__ o) {
  __shared__ float red[FW_ATT_THREADS];
  const int64_t u = blockIdx.x, t = u / hq, hh = u % hq, W = hkv * hd, kvh = hh / (hq / hkv), S = n + B;
  const float *qr = q + (t * hq + hh) * hd;
  float *pr = p + u * ps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = FW_ATT_THREADS / 32;
  for (int64_t j = warp; j < S; j += nwarps) {
    const float *kr = (j < n ? ka + kd_page_row(pt, page_rows, layer_rows, W, li, j) : kb + (j - n) * W) + kvh * hd;
    float s = 0.0f;
    for (int64_t d = lane; d < hd; d += 32) s += qr[d] * kr[d];
    s = fw_warp_sum(s);
    if (lane == 0) pr[j] = s * scale;
  }
  __syncthreads();
  float m = -INFINITY;
  for (int64_t j = tid; j < S; j += FW_ATT_THREADS) m = fmaxf(m, pr[j]);
  red[tid] = m;
  __syncthreads();
  for (int s = FW_ATT_THREADS / 2; s >= 1; s >>= 1) {
    if (tid < s) red[tid] = fmaxf(red[tid], red[tid + s]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  float sum = 0.0f;
  for (int64_t j = tid; j < S; j += FW_ATT_THREADS) {
    float e = expf(pr[j] - m);
    pr[j] = e;
    sum += e;
  }
  red[tid] = sum;
  __syncthreads();
  for (int s = FW_ATT_THREADS / 2; s >= 1; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    __syncthreads();
  }
  sum = red[0];
  float *orow = o + (t * hq + hh) * hd;
  for (int64_t d = tid; d < hd; d += FW_ATT_THREADS) {
    float acc = 0.0f;
    for (int64_t j = 0; j < S; j++) {
      const float *vr = (j < n ? va + kd_page_row(pt, page_rows, layer_rows, W, li, j) : vb + (j - n) * W) + kvh * hd;
      acc += (pr[j] / sum) * vr[d];
    }
    orow[d] = acc;
  }
}

/* one pass over the drafter's descriptor: pass 0 sizes, pass 1 uploads (embed / lm_head: the target's, if given) */
static int fw_dupload(kd_drafter *dr, const kd_drafter_desc *d, fw_up *u) {
  int64_t D = d->hidden, hd = d->head_dim;
  if (d->target) {
    dr->embed_f32 = d->target->embed_f32, dr->embed_bf16 = d->target->embed_bf16;
    dr->lm_head = d->target->lm_head;
  } else {
    int bf;
    const void *emb = d->embed_bf16 ? (bf = 1, fw_put(u, d->embed_bf16, 2 * (size_t)(d->vocab * D)))
                                    : fw_put_f32(u, d->embed, d->vocab * D, 1, &bf);
    dr->embed_f32 = bf ? NULL : (const float *)emb;
    dr->embed_bf16 = bf ? (const __nv_bfloat16 *)emb : NULL;
    fw_weight(u, &d->lm_head, &dr->lm_head);
  }
  dr->hidden_norm = fw_vec(u, d->hidden_norm, D), dr->final_norm = fw_vec(u, d->final_norm, D);
  fw_weight(u, &d->fc, &dr->fc);
  for (int64_t i = 0; i < d->n_layers && !u->rc; i++) {
    const kd_drafter_layer *ly = &d->layers[i];
    fw_dlayer *fl = &dr->layers[i];
    fl->in_norm = fw_vec(u, ly->in_norm, D), fl->post_norm = fw_vec(u, ly->post_norm, D);
    fl->q_norm = fw_vec(u, ly->q_norm, hd), fl->k_norm = fw_vec(u, ly->k_norm, hd);
    fw_weight(u, &ly->q, &fl->q);
    fw_weight(u, &ly->k, &fl->k);
    fw_weight(u, &ly->v, &fl->v);
    fw_weight(u, &ly->o, &fl->o);
    fw_mlp_up(u, &ly->mlp, &fl->mlp);
  }
  return u->rc;
}

extern "C" int kd_drafter_destroy(kd_drafter *dr) {
  if (!dr) return KD_OK;
  if (dr->stream) cudaStreamSynchronize(dr->stream);
  if (dr->k) cudaFree(dr->k);
  if (dr->v) cudaFree(dr->v);
  if (dr->scratch) cudaFree(dr->scratch);
  if (dr->arena) cudaFree(dr->arena);
  if (dr->stream) cudaStreamDestroy(dr->stream);
  free(dr->host);
  free(dr->layers);
  free(dr);
  return KD_OK;
}

extern "C" int kd_drafter_create(const kd_drafter_desc *desc, kd_drafter **out) {
  kd_clear_error();
  KD_CHECK_PTR("kd_drafter_create", desc);
  KD_CHECK_PTR("kd_drafter_create", out);
  *out = NULL;
  if (kd_device_count() <= 0) {
    char why[256];
    snprintf(why, sizeof why, "%s", kd_last_error()); /* kd_fail writes the buffer kd_last_error reads */
    return kd_fail(KD_ENODEV, "kd_drafter_create: no CUDA device (%s); use backend=cpu", why);
  }
  const kd_drafter_desc *d = desc;
  int64_t D = d->hidden, hd = d->head_dim;
  FW_TRY(kd_drafter_desc_check(d));
  if (d->target && (d->target->d.vocab != d->vocab || d->target->d.hidden != D ||
                    d->target->lm_head.n_out != d->lm_head.n_out || d->target->lm_head.n_in != d->lm_head.n_in))
    return kd_fail(KD_EINVAL, "kd_drafter_create: desc.target's embed / lm_head (V=%lld, D=%lld) are not the "
                              "drafter's (V=%lld, D=%lld); pass the drafter's own target or NULL",
                   (long long)d->target->d.vocab, (long long)d->target->d.hidden, (long long)d->vocab, (long long)D);
  kd_drafter *dr = (kd_drafter *)calloc(1, sizeof(kd_drafter));
  if (!dr || !(dr->layers = (fw_dlayer *)calloc((size_t)d->n_layers, sizeof(fw_dlayer)))) {
    free(dr);
    return kd_fail(KD_ENOMEM, "kd_drafter_create: out of memory");
  }
  dr->d = *d;
  dr->d.layers = NULL, dr->d.embed = NULL, dr->d.hidden_norm = dr->d.final_norm = NULL, dr->d.target = NULL;
  dr->kvw = d->hkv * hd;
  for (int64_t i = 0; i < d->n_layers; i++)
    if (d->layers[i].mlp.gate.n_out > dr->inter) dr->inter = d->layers[i].mlp.gate.n_out;
  cudaError_t e = cudaStreamCreateWithFlags(&dr->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    cudaGetLastError();
    dr->stream = NULL;
    kd_drafter_destroy(dr);
    return kd_fail(KD_ECUDA, "kd_drafter_create: cudaStreamCreate: %s", cudaGetErrorString(e));
  }
  fw_up u = {NULL, 0, 0, 0, 0, "kd_drafter_create"};
  int rc = fw_dupload(dr, d, &u);
  if (!rc) {
    e = cudaMalloc((void **)&dr->arena, u.need ? u.need : 1);
    if (e != cudaSuccess) {
      cudaGetLastError();
      dr->arena = NULL;
      kd_drafter_destroy(dr);
      return kd_fail(KD_ENOMEM, "kd_drafter_create: cudaMalloc(%zu bytes of drafter weights): %s", u.need,
                     cudaGetErrorString(e));
    }
    dr->arena_bytes = u.need;
    u.arena = dr->arena;
    u.pass = 1;
    rc = fw_dupload(dr, d, &u);
    if (!rc) rc = fw_err_in("kd_drafter_create", cudaDeviceSynchronize(), "weight upload"); /* see kd_model_create */
  }
  if (rc) {
    kd_drafter_destroy(dr);
    return rc;
  }
  *out = dr;
  return KD_OK;
}

extern "C" int kd_drafter_pages(kd_drafter *dr, int64_t n_pages, int64_t page_rows) {
  static const char *fn = "kd_drafter_pages";
  kd_clear_error();
  KD_CHECK_PTR(fn, dr);
  if (n_pages < 0 || page_rows <= 0)
    return kd_fail(KD_EINVAL, "%s: n_pages=%lld, page_rows=%lld; give n_pages >= 0 and page_rows >= 1", fn,
                   (long long)n_pages, (long long)page_rows);
  size_t page = sizeof(float) * (size_t)(page_rows * dr->kvw);   /* one layer's rows of a page */
  int keep = page_rows == dr->page_rows;
  FW_TRY(fw_arena_resize(&dr->k, dr->n_pages, n_pages, dr->d.n_layers, page, keep, dr->stream, fn));
  int rc = fw_arena_resize(&dr->v, dr->n_pages, n_pages, dr->d.n_layers, page, keep, dr->stream, fn);
  if (rc) { /* K resized, V not: drop both (no sequence may use a half-sized arena) */
    if (dr->k) cudaFree(dr->k);
    dr->k = NULL, dr->n_pages = 0;
    return rc;
  }
  dr->n_pages = n_pages, dr->page_rows = page_rows;
  return KD_OK;
}

/* grow-only device scratch and host staging (a growth waits for the stream: a queued kernel may still read them) */
static int fw_dreserve(kd_drafter *dr, const char *fn, size_t dev_bytes, size_t host_bytes) {
  if (dev_bytes > dr->scratch_bytes) {
    cudaStreamSynchronize(dr->stream);
    if (dr->scratch) cudaFree(dr->scratch);
    dr->scratch = NULL, dr->scratch_bytes = 0;
    cudaError_t e = cudaMalloc((void **)&dr->scratch, dev_bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      dr->scratch = NULL;
      return kd_fail(KD_ENOMEM, "%s: drafter scratch of %zu bytes: %s", fn, dev_bytes, cudaGetErrorString(e));
    }
    dr->scratch_bytes = dev_bytes;
  }
  if (host_bytes > dr->host_bytes) {
    cudaStreamSynchronize(dr->stream);
    char *h = (char *)realloc(dr->host, host_bytes);
    if (!h) return kd_fail(KD_ENOMEM, "%s: out of host memory (%zu bytes)", fn, host_bytes);
    dr->host = h, dr->host_bytes = host_bytes;
  }
  return KD_OK;
}

/* k, v of T rows h [T, D] into kb, vb [T, Hkv*hd]: linear, k_norm, rope (kd_forward.c's kd_drafter_kv) */
static int fw_dkv(kd_drafter *dr, const char *fn, const fw_dlayer *ly, const float *h, float *kb, float *vb,
                  int64_t T, const float *cs) {
  const kd_drafter_desc *d = &dr->d;
  FW_TRY(fw_lin_on(dr->stream, fn, &ly->k, h, kb, T));
  FW_TRY(fw_lin_on(dr->stream, fn, &ly->v, h, vb, T));
  FW_TRY(kd_rms_norm(kb, ly->k_norm, kb, T * d->hkv, d->head_dim, d->eps, dr->stream));
  fw_rope_half_kernel<<<(unsigned)(T * d->hkv), 64, 0, dr->stream>>>(kb, cs, d->hkv, d->head_dim);
  return fw_err_in(fn, cudaGetLastError(), "rope");
}

extern "C" int kd_drafter_extend(kd_drafter *dr, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                                 const int64_t *lengths, const int64_t *row_start, const float *feats) {
  static const char *fn = "kd_drafter_extend";
  kd_clear_error();
  KD_CHECK_PTR("kd_drafter_extend", dr);
  if (n_seqs <= 0 || !row_start || row_start[0] != 0)
    return kd_fail(KD_EINVAL, "kd_drafter_extend: n_seqs=%lld with row_start from 0 required", (long long)n_seqs);
  FW_TRY(kd_page_tables_check(fn, n_seqs, pages, page_start, lengths, row_start, dr->n_pages, dr->page_rows));
  const kd_drafter_desc *d = &dr->d;
  int64_t N = row_start[n_seqs], D = d->hidden, W = dr->kvw, hd = d->head_dim, F = dr->fc.n_in;
  int64_t n_tab = page_start[n_seqs];
  if (N == 0) return KD_OK;
  KD_CHECK_PTR("kd_drafter_extend", feats);
  size_t o = 0, f_at = fw_take(&o, sizeof(float) * (size_t)(N * F));
  size_t ctx_at = fw_take(&o, sizeof(float) * (size_t)(N * D)), cs_at = fw_take(&o, sizeof(float) * (size_t)(N * hd));
  size_t kb_at = fw_take(&o, sizeof(float) * (size_t)(N * W)), vb_at = fw_take(&o, sizeof(float) * (size_t)(N * W));
  size_t pt_at = fw_take(&o, sizeof(int32_t) * (size_t)n_tab);
  FW_TRY(fw_dreserve(dr, fn, o, sizeof(float) * (size_t)(N * hd) + sizeof(int32_t) * (size_t)n_tab));
  char *sb = dr->scratch;
  float *fd = (float *)(sb + f_at), *ctx = (float *)(sb + ctx_at), *cs = (float *)(sb + cs_at);
  float *kb = (float *)(sb + kb_at), *vb = (float *)(sb + vb_at), *csh = (float *)dr->host;
  int32_t *pt = (int32_t *)(sb + pt_at), *pth = (int32_t *)(dr->host + sizeof(float) * (size_t)(N * hd));
  for (int64_t s = 0; s < n_seqs; s++)
    kd_rope_half_table(csh + row_start[s] * hd, lengths[s], row_start[s + 1] - row_start[s], hd, d->rope_theta);
  memcpy(pth, pages, sizeof(int32_t) * (size_t)n_tab);
  cudaStream_t st = dr->stream;
  FW_TRY(fw_err_in(fn, cudaMemcpyAsync(fd, feats, sizeof(float) * (size_t)(N * F), cudaMemcpyHostToDevice, st),
                   "context upload"));
  FW_TRY(fw_err_in(fn, cudaMemcpyAsync(cs, csh, sizeof(float) * (size_t)(N * hd), cudaMemcpyHostToDevice, st),
                   "rope upload"));
  FW_TRY(fw_err_in(fn, cudaMemcpyAsync(pt, pth, sizeof(int32_t) * (size_t)n_tab, cudaMemcpyHostToDevice, st),
                   "page table upload"));
  FW_TRY(fw_lin_on(st, fn, &dr->fc, fd, ctx, N)); /* ctx = hidden_norm(fc(feats)) */
  FW_TRY(kd_rms_norm(ctx, dr->hidden_norm, ctx, N, D, d->eps, st));
  for (int64_t li = 0; li < d->n_layers; li++) {
    FW_TRY(fw_dkv(dr, fn, &dr->layers[li], ctx, kb, vb, N, cs));
    for (int64_t s = 0; s < n_seqs; s++) { /* context rows lengths[s].. through the sequence's page table */
      int64_t r0 = row_start[s], T = row_start[s + 1] - r0;
      for (int64_t t0 = 0; t0 < T; t0 += 65535) { /* grid.x rows per launch: a long prompt's context too */
        unsigned rows = (unsigned)(T - t0 < 65535 ? T - t0 : 65535);
        int64_t lr = dr->n_pages * dr->page_rows;
        fw_page_scatter_kernel<<<rows, 128, 0, st>>>(kb + (r0 + t0) * W, dr->k, pt + page_start[s], dr->page_rows,
                                                     lr, W, li, lengths[s] + t0);
        fw_page_scatter_kernel<<<rows, 128, 0, st>>>(vb + (r0 + t0) * W, dr->v, pt + page_start[s], dr->page_rows,
                                                     lr, W, li, lengths[s] + t0);
        FW_TRY(fw_err_in(fn, cudaGetLastError(), "cache write"));
      }
    }
  }
  return fw_err_in(fn, cudaStreamSynchronize(st), "synchronize"); /* the host staging is reused by the next call */
}

extern "C" int kd_drafter_draft(kd_drafter *dr, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                                const int64_t *lengths, const int32_t *bonus, float *logits) {
  static const char *fn = "kd_drafter_draft";
  kd_clear_error();
  KD_CHECK_PTR("kd_drafter_draft", dr);
  KD_CHECK_PTR("kd_drafter_draft", logits);
  if (n_seqs <= 0 || !bonus)
    return kd_fail(KD_EINVAL, "kd_drafter_draft: n_seqs=%lld with bonus required", (long long)n_seqs);
  FW_TRY(kd_page_tables_check(fn, n_seqs, pages, page_start, lengths, NULL, dr->n_pages, dr->page_rows));
  const kd_drafter_desc *d = &dr->d;
  int64_t B = d->block_size, D = d->hidden, hd = d->head_dim, W = dr->kvw, QW = d->hq * hd, V = d->vocab, maxn = 0;
  int64_t n_tab = page_start[n_seqs];
  for (int64_t s = 0; s < n_seqs; s++) {
    if (bonus[s] < 0 || bonus[s] >= V)
      return kd_fail(KD_EINVAL, "kd_drafter_draft: bonus token %d outside the vocabulary of %lld", bonus[s],
                     (long long)V);
    if (lengths[s] > maxn) maxn = lengths[s];
  }
  int64_t I = dr->inter, ps = maxn + B;
  size_t o = 0;
#define FW_D(name, n) size_t name##_at = fw_take(&o, sizeof(float) * (size_t)(n))
  FW_D(x, B * D); FW_D(hb, B * D); FW_D(q, B * QW); FW_D(kb, B * W); FW_D(vb, B * W); FW_D(ob, B * QW);
  FW_D(t, B * D); FW_D(g, B * I); FW_D(u, B * I); FW_D(p, B * d->hq * ps); FW_D(fo, B * D); FW_D(lg, (B - 1) * V);
  FW_D(cs, n_seqs * B * hd); FW_D(tok, n_seqs * B); FW_D(pt, n_tab);
#undef FW_D
  size_t host_bytes = sizeof(float) * (size_t)(n_seqs * B * hd) + sizeof(int32_t) * (size_t)(n_seqs * B + n_tab);
  FW_TRY(fw_dreserve(dr, fn, o, host_bytes));
  char *sb = dr->scratch;
  float *x = (float *)(sb + x_at), *hb = (float *)(sb + hb_at), *q = (float *)(sb + q_at), *kb = (float *)(sb + kb_at);
  float *vb = (float *)(sb + vb_at), *ob = (float *)(sb + ob_at), *t = (float *)(sb + t_at), *g = (float *)(sb + g_at);
  float *u = (float *)(sb + u_at), *p = (float *)(sb + p_at), *fo = (float *)(sb + fo_at), *lg = (float *)(sb + lg_at);
  float *cs = (float *)(sb + cs_at);
  int32_t *tok = (int32_t *)(sb + tok_at), *pt = (int32_t *)(sb + pt_at);
  float *csh = (float *)dr->host;
  int32_t *tokh = (int32_t *)(dr->host + sizeof(float) * (size_t)(n_seqs * B * hd)), *pth = tokh + n_seqs * B;
  for (int64_t s = 0; s < n_seqs; s++) { /* block = [bonus, MASK x (B-1)] at positions n..n+B-1 */
    kd_rope_half_table(csh + s * B * hd, lengths[s], B, hd, d->rope_theta);
    for (int64_t r = 0; r < B; r++) tokh[s * B + r] = r ? d->mask_token : bonus[s];
  }
  memcpy(pth, pages, sizeof(int32_t) * (size_t)n_tab);
  cudaStream_t st = dr->stream;
  FW_TRY(fw_err_in(fn, cudaMemcpyAsync(cs, csh, sizeof(float) * (size_t)(n_seqs * B * hd), cudaMemcpyHostToDevice,
                                       st), "rope upload"));
  FW_TRY(fw_err_in(fn, cudaMemcpyAsync(tok, tokh, sizeof(int32_t) * (size_t)(n_seqs * B), cudaMemcpyHostToDevice, st),
                   "token upload"));
  FW_TRY(fw_err_in(fn, cudaMemcpyAsync(pt, pth, sizeof(int32_t) * (size_t)n_tab, cudaMemcpyHostToDevice, st),
                   "page table upload"));
  float scale = (float)(1.0 / sqrt((double)hd));
  for (int64_t s = 0; s < n_seqs; s++) {
    int64_t n = lengths[s];
    const float *css = cs + s * B * hd;
    if (dr->embed_bf16)
      fw_embed_kernel<<<fw_blocks(B * D), 256, 0, st>>>(dr->embed_bf16, tok + s * B, x, B, D);
    else
      fw_embed_kernel<<<fw_blocks(B * D), 256, 0, st>>>(dr->embed_f32, tok + s * B, x, B, D);
    FW_TRY(fw_err_in(fn, cudaGetLastError(), "embed"));
    for (int64_t li = 0; li < d->n_layers; li++) {
      const fw_dlayer *ly = &dr->layers[li];
      FW_TRY(kd_rms_norm(x, ly->in_norm, hb, B, D, d->eps, st));
      FW_TRY(fw_lin_on(st, fn, &ly->q, hb, q, B));
      FW_TRY(kd_rms_norm(q, ly->q_norm, q, B * d->hq, hd, d->eps, st));
      fw_rope_half_kernel<<<(unsigned)(B * d->hq), 64, 0, st>>>(q, css, d->hq, hd);
      FW_TRY(fw_err_in(fn, cudaGetLastError(), "rope"));
      FW_TRY(fw_dkv(dr, fn, ly, hb, kb, vb, B, css));
      fw_dattn_kernel<<<(unsigned)(B * d->hq), FW_ATT_THREADS, 0, st>>>(q, dr->k, dr->v, pt + page_start[s],
                                                                         dr->page_rows, dr->n_pages * dr->page_rows,
                                                                         li, kb, vb, n, B, d->hq, d->hkv, hd, scale,
                                                                         p, ps, ob);
      FW_TRY(fw_err_in(fn, cudaGetLastError(), "attention"));
      FW_TRY(fw_lin_on(st, fn, &ly->o, ob, t, B));
      fw_add_kernel<<<fw_blocks(B * D), 256, 0, st>>>(x, t, B * D);
      FW_TRY(fw_err_in(fn, cudaGetLastError(), "residual"));
      FW_TRY(kd_rms_norm(x, ly->post_norm, hb, B, D, d->eps, st));
      FW_TRY(fw_mlp_rows_on(st, fn, &ly->mlp, hb, t, B, g, u));
      fw_add_kernel<<<fw_blocks(B * D), 256, 0, st>>>(x, t, B * D);
      FW_TRY(fw_err_in(fn, cudaGetLastError(), "residual"));
    }
    FW_TRY(kd_rms_norm(x + D, dr->final_norm, fo, B - 1, D, d->eps, st)); /* rows 1..B-1 */
    FW_TRY(fw_lin_on(st, fn, &dr->lm_head, fo, lg, B - 1));
    FW_TRY(fw_err_in(fn, cudaMemcpyAsync(logits + s * (B - 1) * V, lg, sizeof(float) * (size_t)((B - 1) * V),
                                         cudaMemcpyDeviceToHost, st), "logits download"));
  }
  return fw_err_in(fn, cudaStreamSynchronize(st), "synchronize");
}
