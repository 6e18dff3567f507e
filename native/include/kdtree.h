/* kdtree native kernels: one C ABI, built twice (libkdtree_cpu.so, libkdtree_cuda.so).
 *
 * Conventions
 *   - Every op returns KD_OK (0) or a negative KD_E* status; kd_last_error() then holds a one-line message
 *     (thread-local, valid until the next failing call on the same thread).
 *   - Arrays are dense, row-major, C-contiguous; shapes are given explicitly as int64_t.
 *   - Batch invariance: every row t of every op is computed with the same sequence of float operations
 *     whatever T is (fixed reduction order per row, never a T-dependent split), so a tree node whose
 *     ancestors equal the AR context gets bit-identical results to the AR step (docs/engine-contracts.md).
 *   - Tree ops (kd_tree_build, kd_tree_accept) always take HOST pointers, in both builds.
 *   - Dense ops in libkdtree_cuda.so take DEVICE pointers and a cudaStream_t passed as void*
 *     (NULL = the legacy default stream); they are asynchronous on that stream. In libkdtree_cpu.so the
 *     stream argument is ignored and pointers are host pointers.
 *   - Memory helpers (kd_malloc/kd_free/kd_memcpy_*) let a caller without torch move numpy data to the
 *     device; in the CPU build they are malloc/free/memcpy.
 */
#ifndef KDTREE_H
#define KDTREE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KD_ABI_VERSION 2   /* bump with every change of this header (an op added, a signature changed) */

#define KD_OK 0
#define KD_EINVAL -1   /* bad argument (shape, size, NULL pointer) */
#define KD_ENODEV -2   /* no CUDA device / driver */
#define KD_ECUDA -3    /* a CUDA runtime call failed */
#define KD_ENOMEM -4   /* allocation failed */

/* ---- library ---------------------------------------------------------------------------------------- */
int kd_version(void);               /* KD_ABI_VERSION the library was built with */
const char *kd_backend(void);       /* "cpu" or "cuda" */
const char *kd_last_error(void);    /* thread-local message of the last failing call ("" if none) */
int kd_device_count(void);          /* cpu: 1; cuda: number of devices, 0 if none (reason in kd_last_error) */

/* ---- memory (cuda: device memory; cpu: host memory) --------------------------------------------------- */
int kd_malloc(void **ptr, size_t bytes);
int kd_free(void *ptr);
int kd_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream);
int kd_memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream);
int kd_synchronize(void *stream);

/* ---- tree ops (host pointers in both builds) ------------------------------------------------------------
 * kd_tree_build: best-first heap over path scores (sum of float32 logp along the path, accumulated in
 * double), ordered by (score desc, push counter asc). Start with (depth 1, rank 0); pop a node, append it;
 * push its next sibling (rank+1 < width) then its first child (depth < n_depth). Stop after `budget` pops.
 *   logp f32[n_depth, width] (each row sorted descending), ids i32[n_depth, width]
 *   budget <= cap; out: tokens/parents/depths i32[cap], *n_nodes = min(budget, nodes of the full tree
 *   width + width^2 + ... + width^n_depth); visibility (capacity (cap+1)*ceil((cap+1)/64) u64, or NULL to skip)
 *   receives u64[n_nodes+1, ceil((n_nodes+1)/64)] over [root, nodes] (row 0 = root sees itself; row i+1 = node i
 *   sees the root, its ancestors and itself). parents: -1 = root; parents precede children.
 */
int kd_tree_build(const float *logp, const int32_t *ids, int64_t n_depth, int64_t width, int64_t budget,
                  int32_t *tokens, int32_t *parents, int32_t *depths, int64_t cap, uint64_t *visibility,
                  int64_t *n_nodes);

/* kd_tree_accept: from the root follow the first child (node order) whose token equals target_argmax at
 * the current row (row 0 = root, row i+1 = node i); path i32[n_nodes] receives the accepted node indices,
 * *path_len their count, *bonus the argmax at the last accepted row. */
int kd_tree_accept(const int32_t *parents, const int32_t *tokens, int64_t n_nodes, const int32_t *target_argmax,
                   int32_t *path, int64_t *path_len, int32_t *bonus);

/* ---- dense ops (f32 unless stated) ------------------------------------------------------------------- */
/* out[t, o] = sum_k w[o, k] x[t, k]; x [T, in], w [out, in], out [T, out] */
int kd_linear_f32(const float *x, const float *w, float *out, int64_t T, int64_t n_in, int64_t n_out,
                  void *stream);

/* W4A16 (compressed-tensors pack-quantized): packed int32 [out, ceil(in/8)], element k of a row in bits
 * 4*(k%8).. of word k/8 holding q+8 (q in -8..7); scales f32 [out, ceil(in/group)]; w = q * scale.
 * Computes exactly kd_linear_f32 on the dequantized float32 weight (same products, same order). */
int kd_linear_w4a16(const float *x, const int32_t *packed, const float *scales, float *out, int64_t T,
                    int64_t n_in, int64_t n_out, int64_t group, void *stream);

/* fp16 / bf16 activations variant (CUDA build only; the CPU build returns KD_EINVAL). act_dtype: 1 = fp16,
 * 2 = bf16. x [T, in] of that dtype; out f32 [T, out]. */
#define KD_DTYPE_F16 1
#define KD_DTYPE_BF16 2
int kd_linear_w4a16_half(const void *x, int act_dtype, const int32_t *packed, const float *scales, float *out,
                         int64_t T, int64_t n_in, int64_t n_out, int64_t group, void *stream);

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w ; x, out [T, D], w [D] */
int kd_rms_norm(const float *x, const float *w, float *out, int64_t T, int64_t D, float eps, void *stream);

/* out = gate / (1 + exp(-gate)) * up ; all [T, I] */
int kd_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t I, void *stream);

/* Tree-verify MLA-absorb attention over a latent cache.
 *   q [T, H, L+R], kv [S, L+R] with S = n_prefix + T, visibility u64 [T, ceil(T/64)] or NULL = causal,
 *   out [T, H, L]. Query t sees every cache row [0, n_prefix) and block row n_prefix+k iff bit k%64 of
 *   visibility[t, k/64]; visible keys are processed in ascending position order:
 *   s_j = scale * q[t,h,:]·kv[j,:], p = softmax(s), out[t,h,:] = sum_j p_j kv[j, :L].
 *   A query row with no visible key gets zeros. */
int kd_mla_attention(const float *q, const float *kv, const uint64_t *visibility, float *out, int64_t T,
                     int64_t H, int64_t L, int64_t R, int64_t n_prefix, float scale, void *stream);

/* Fused MoE layer, float32 weights: routed experts grouped by expert, then the shared expert.
 *   x [T, D]; experts i32 [T, k] (descending choice order) and weights f32 [T, k] are HOST arrays in both
 *   builds; gate, up, down are host arrays of n_experts weight pointers (f32 [I, D], [I, D], [D, I]; device
 *   pointers in the CUDA build); shared_gate/up/down f32 [Is, D], [Is, D], [D, Is] or all NULL; out [T, D].
 *   y_j = down_e(silu(gate_e x[t]) * up_e x[t]) for e = experts[t, j], each a kd_linear_f32 row;
 *   out[t] = (((0 + weights[t,0] y_0) + weights[t,1] y_1) + ...) + shared(x[t]). A token's result does not
 *   depend on T or on which other tokens chose the same experts. */
int kd_moe_f32(const float *x, const int32_t *experts, const float *weights, const float *const *gate,
               const float *const *up, const float *const *down, int64_t n_experts, const float *shared_gate,
               const float *shared_up, const float *shared_down, float *out, int64_t T, int64_t D, int64_t I,
               int64_t Is, int64_t k, void *stream);

/* Per-head linear (the MLA absorb products): out[t, h, o] = sum_i w[h, o, i] x[t, h, i] for t < T, h < H, with
 * kd_linear_f32's row arithmetic. Row (t, h) of x starts at x + t*xs_t + h*xs_h, of out at out + t*os_t + h*os_h
 * (strides in floats; each row's n_in / n_out elements contiguous); w [H, n_out, n_in]. */
int kd_head_linear_f32(const float *x, int64_t xs_t, int64_t xs_h, const float *w, float *out, int64_t os_t,
                       int64_t os_h, int64_t T, int64_t H, int64_t n_in, int64_t n_out, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_H */
