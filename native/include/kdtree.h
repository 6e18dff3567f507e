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

#define KD_ABI_VERSION 17  /* bump with every change of this header (an op added, a signature changed) */

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
int kd_set_threads(int n);          /* cpu: OpenMP threads of every parallel region, process-wide (0 = OpenMP's
                                       default: OMP_NUM_THREADS, else every core); cuda: accepted, no effect */
int kd_threads(void);               /* cpu: threads a parallel region uses now; cuda: 1 */
const char *kd_host_kernels(void);  /* the host SIMD kernels this process runs: "avx512" (CPU build's linears),
                                       "avx2" or "generic" (KDTREE_CPU_ISA / KDTREE_CPU_GENERIC and the CPU's flags) */

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

/* kd_tree_build's arguments in one struct, for a caller that builds tree after tree of one shape into the same
 * buffers (the Python wrapper keeps one per shape and thread): a call then passes one pointer, not eleven
 * (through cffi ~0.2 µs instead of ~0.9 µs, as long as the build itself at budget 64). n_nodes is the output. */
typedef struct {
  const float *logp;
  const int32_t *ids;
  int64_t n_depth, width, budget;
  int32_t *tokens, *parents, *depths;
  int64_t cap;
  uint64_t *visibility;
  int64_t n_nodes;
} kd_tree_job;
int kd_tree_build_job(kd_tree_job *job);

/* kd_tree_accept: from the root follow the first child (node order) whose token equals target_argmax at
 * the current row (row 0 = root, row i+1 = node i); path i32[n_nodes] receives the accepted node indices,
 * *path_len their count, *bonus the argmax at the last accepted row. */
int kd_tree_accept(const int32_t *parents, const int32_t *tokens, int64_t n_nodes, const int32_t *target_argmax,
                   int32_t *path, int64_t *path_len, int32_t *bonus);

/* kd_draft_topk: the drafter's block logits -> what kd_tree_build takes (kdtree.tree.draft_topk): each row's
 * log-softmax (z = x - max in float32, log of the sum of exp(z) accumulated in double, logp = z - that, float32)
 * and its `width` largest entries, descending, equal log-probs in ascending id, NaNs after every number (as
 * numpy's stable argsort of -logp). width is capped at V. logits f32[n_rows, V] (host); logp f32[n_rows, w],
 * ids i32[n_rows, w] with w = min(width, V). Log-probs can differ from numpy's in the last bit. */
int kd_draft_topk(const float *logits, int64_t n_rows, int64_t V, int64_t width, float *logp, int32_t *ids);

/* Grammar token bitmasks (llguidance's layout: bit (v % 32) of word v / 32 is token v; words = ceil(V / 32) per row),
 * host pointers in both builds. kd_token_bitmask_apply: logits[t, v] = -inf where row t's bit v is 0 (in place).
 * kd_masked_argmax: out[t] = the first v of the largest logits[t, v] among allowed tokens (numpy's argmax of the
 * masked row; -1 when row t allows none). logits f32[T, V], bitmask u32[T, words]. */
int kd_token_bitmask_apply(float *logits, const uint32_t *bitmask, int64_t T, int64_t V, int64_t words);
int kd_masked_argmax(const float *logits, const uint32_t *bitmask, int64_t T, int64_t V, int64_t words, int32_t *out);

/* ---- dense ops (f32 unless stated) ------------------------------------------------------------------- */
/* out[t, o] = sum_k w[o, k] x[t, k]; x [T, in], w [out, in], out [T, out] */
int kd_linear_f32(const float *x, const float *w, float *out, int64_t T, int64_t n_in, int64_t n_out,
                  void *stream);

/* BF16 weights: w holds bfloat16 bit patterns [out, in] (uint16), widened exactly (bits << 16) in registers or
 * into L1; computes exactly kd_linear_f32 on the widened float32 weight (same products, same order, every T). */
int kd_linear_bf16(const float *x, const uint16_t *w, float *out, int64_t T, int64_t n_in, int64_t n_out,
                   void *stream);

/* W4A16 (compressed-tensors pack-quantized): packed int32 [out, ceil(in/8)], element k of a row in bits
 * 4*(k%8).. of word k/8 holding q+8 (q in -8..7); scales f32 [out, ceil(in/group)]; w = q * scale.
 * Computes exactly kd_linear_f32 on the dequantized float32 weight (same products, same order). */
int kd_linear_w4a16(const float *x, const int32_t *packed, const float *scales, float *out, int64_t T,
                    int64_t n_in, int64_t n_out, int64_t group, void *stream);
/* kd_linear_w4a16 with the scales as BF16 bits [out, ceil(in/group)] (the checkpoint's dtype: half the scale bytes),
 * widened exactly where they are read: the same result, bit for bit, as kd_linear_w4a16 on the widened scales. */
int kd_linear_w4a16_bf16_scales(const float *x, const int32_t *packed, const uint16_t *scales, float *out, int64_t T,
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
/* kd_head_linear_f32 over BF16 weights (uint16 bits, widened exactly): the same bits as kd_head_linear_f32 over the
 * widened values, half the bytes streamed (K2's kv_b_proj is BF16). */
int kd_head_linear_bf16(const float *x, int64_t xs_t, int64_t xs_h, const uint16_t *w, float *out, int64_t os_t,
                        int64_t os_h, int64_t T, int64_t H, int64_t n_in, int64_t n_out, void *stream);

/* ---- whole-model forward (cpu: src/cpu/kd_forward.c; cuda: src/cuda/kd_forward.cu) -------------------------
 * A model is registered once: the caller fills descriptors with pointers into its loaded arrays (which it keeps
 * alive for the model's life; INT4 weights stay packed), kd_model_create copies the descriptors (never the
 * weights). The library owns ONE paged latent-cache arena (kd_model_pages) and grow-only scratch sized by the
 * largest forward so far: nothing is allocated per token once warm.
 *
 * Paged latent cache: the arena is n_pages pages of page_rows rows of every layer, layer-major f32 [n_layers]
 * [n_pages * page_rows][L+R] (page p is rows p * page_rows .. of each layer's block, so consecutive pages are
 * consecutive rows). A sequence's cache is a PAGE TABLE (int32 page ids, chosen by the caller: kdtree/model/pages.py
 * owns which page is free and who holds it) and a length: its row j of layer l is row pages[j / page_rows] *
 * page_rows + j % page_rows of layer l's block (kd_page_row). The library keeps no per-sequence state.
 * Pages may appear in several tables (a prefix cache hit maps the cached pages, zero-copy): a forward writes only
 * rows [length, length + T) of each sequence, so a page shared read-only lies wholly below every sharer's length.
 *
 * A forward takes rows of one or more sequences (rows grouped per sequence); a row sees its own sequence's cache
 * rows and the block rows of its sequence allowed by that sequence's visibility (block-diagonal), so a row's
 * logits never depend on the other rows or sequences in the call (every kernel is row-wise, fixed order), nor on
 * which pages hold its cache rows. One call at a time per model (its scratch is shared); callers serialise (the
 * engine's one worker does). */
typedef struct {
  const float *f32;        /* f32 [n_out, n_in], or NULL when packed or bf16 is set */
  const int32_t *packed;   /* W4A16 [n_out, ceil(n_in/8)] (kd_linear_w4a16), or NULL */
  const float *scales;     /* f32 [n_out, ceil(n_in/group)] with packed, or NULL when scales_bf16 is set */
  int64_t n_out, n_in, group;
  const uint16_t *bf16;    /* BF16 bits [n_out, n_in] (kd_linear_bf16: the same bits as f32 of the widened values),
                              or NULL; exactly one of f32 / packed / bf16 is set */
  const uint16_t *scales_bf16; /* with packed: the scales as BF16 bits (kd_linear_w4a16_bf16_scales), or NULL */
} kd_weight;

typedef struct {
  kd_weight gate, up, down;   /* [I, D], [I, D], [D, I] */
} kd_mlp;

typedef struct {
  const float *in_norm, *post_norm;   /* [D] */
  kd_weight q_a;                      /* [q_lora, D] */
  const float *q_a_norm;              /* [q_lora] */
  kd_weight q_b;                      /* [H*(nope+R), q_lora] */
  kd_weight kv_a;                     /* [L+R, D] */
  const float *kv_a_norm;             /* [L] */
  const float *w_uk_t;                /* [H, L, nope]: q_nope -> latent (absorbed), or NULL when w_uk_t_bf16 is set */
  const float *w_uv;                  /* [H, v, L]: latent -> v (absorbed), or NULL when w_uv_bf16 is set */
  const uint16_t *w_uk_t_bf16;        /* the same as BF16 bits (kv_b_proj as stored; kd_head_linear_bf16), or NULL */
  const uint16_t *w_uv_bf16;          /* exactly one of w_uk_t / w_uk_t_bf16 and of w_uv / w_uv_bf16 is set */
  kd_weight o;                        /* [D, H*v] */
  int64_t heads;                      /* local heads (tensor parallel splits heads) */
  int32_t is_moe;
  kd_mlp mlp;                         /* dense layer (is_moe == 0) */
  const float *router;                /* f32 [E, D], or NULL when router_bf16 is set */
  const uint16_t *router_bf16;        /* the same as BF16 bits (as K2.6 stores it; kd_linear_bf16), or NULL */
  const float *router_bias;           /* f32 [E] (e_score_correction_bias) */
  const kd_mlp *experts;              /* [E], copied at create */
  int32_t has_shared;
  kd_mlp shared;
} kd_layer;

/* all_reduce (tensor parallel; NULL at tp 1): sum x f32[n] over the ranks in place, the same bits on every rank;
 * returns 0, else non-zero (the forward then fails with KD_EINVAL). Called after o_proj and after the MLP/MoE. */
typedef int (*kd_all_reduce_fn)(float *x, int64_t n, void *ctx);

typedef struct {
  int64_t vocab, hidden, n_layers, kv_lora, rope_dim, nope, v_head;
  int64_t n_experts, top_k, n_group, topk_group;
  int32_t norm_topk_prob;
  float routed_scale, eps, attn_scale;
  const double *inv_freq;             /* [rope_dim/2] YaRN inverse frequencies, copied at create */
  double rope_mscale;                 /* cos/sin = (float)(cos|sin(pos * inv_freq) * mscale) */
  const float *embed;                 /* [V, D] */
  const float *final_norm;            /* [D] */
  kd_weight lm_head;                  /* [V, D] */
  const kd_layer *layers;             /* [n_layers], copied at create */
  kd_all_reduce_fn all_reduce;
  void *all_reduce_ctx;
  const uint16_t *embed_bf16;         /* [V, D] BF16 bits instead of embed (rows widened exactly), or NULL */
} kd_model_desc;

typedef struct kd_model kd_model;

typedef struct {
  int64_t n_rows;
  const int32_t *tokens;       /* [n_rows] */
  const int32_t *positions;    /* [n_rows] */
  int64_t n_seqs;
  const int32_t *pages;        /* every sequence's page table, concatenated in sequence order */
  const int64_t *page_start;   /* [n_seqs + 1]: sequence s's table is pages[page_start[s] .. page_start[s+1]) */
  const int64_t *lengths;      /* [n_seqs]: its cache rows before this forward; its T_s new rows go after them
                                  (length + T_s <= its table's pages x page_rows; the caller advances the length) */
  const int64_t *row_start;    /* [n_seqs + 1]: rows of sequence s are row_start[s] .. row_start[s+1]-1 */
  const uint64_t *visibility;  /* per sequence u64[T_s, ceil(T_s/64)], concatenated in sequence order; NULL = causal */
  int64_t n_out;               /* rows whose logits / argmax are returned */
  const int64_t *out_rows;     /* [n_out] row indices, or NULL = rows 0..n_out-1 */
  float *logits;               /* [n_out, V] or NULL */
  int32_t *argmax;             /* [n_out] (ties -> lowest id) or NULL */
  int64_t n_hidden;
  const int64_t *hidden_layers;/* [n_hidden] */
  float *hidden;               /* [n_rows, n_hidden * D]: residual stream after each listed layer, concatenated */
  /* Lossless expert pruning of draft rows (CPU build; NULL = none). row_value[r] = the tokens row r and the rows that
   * see it (its subtree) are expected to commit (+inf: never pruned -- a tree's root, AR and prefill rows);
   * expert_cost = a routed expert's bytes over an AR step's bytes (the tokens a row must be worth to bring one more
   * expert into a layer's weight stream). At each MoE layer the live rows are taken by descending value (then
   * ascending row); a row whose experts not yet chosen cost more than its value is pruned, with every row of its
   * sequence whose visibility shows it, and takes no routed expert from then on. row_pruned[r] = 1 for the pruned
   * rows: their logits mean nothing, the caller treats them as rejected drafts -- the other rows' results are the
   * same bits as without pruning (a row's computation never depends on another row's). */
  const float *row_value;      /* [n_rows] or NULL */
  float expert_cost;
  uint8_t *row_pruned;         /* [n_rows] out; required with row_value */
} kd_forward_args;

int kd_model_create(const kd_model_desc *desc, kd_model **out);
int kd_model_destroy(kd_model *m);
/* Write each sequence's new latent rows through its page table and run every layer; outputs as asked in args. */
int kd_model_forward(kd_model *m, const kd_forward_args *args);
/* The arena: n_pages pages of page_rows rows (0 pages = none). With page_rows unchanged the pages below
 * min(old, new) n_pages keep their rows (copied into the resized layer blocks: the caller grows the arena without
 * moving a sequence); a new page_rows drops every row. Between forwards only. */
int kd_model_pages(kd_model *m, int64_t n_pages, int64_t page_rows);
/* Tree compaction within one sequence's pages: its rows `rows` (ascending, >= start, inside its table) moved to
 * start, start + 1, .. in every layer (the accepted path's rows; the caller sets length = start + n). */
int kd_cache_keep(kd_model *m, const int32_t *pages, int64_t n_table, int64_t start, const int64_t *rows, int64_t n);
/* Rows [start, start + n) of one sequence, every layer, into HOST out f32 [n_layers, n, L+R] (tests, tools). */
int kd_cache_gather(kd_model *m, const int32_t *pages, int64_t n_table, int64_t start, int64_t n, float *out);

/* CUDA build (src/cuda/kd_forward.cu): the same calls on HOST arrays (descriptors, forward args and outputs), with
 * the model on the device: kd_model_create uploads every weight once (f32 tensors whose values are all exact
 * bfloat16 are kept as BF16 and widened exactly in the kernels; INT4 stays packed, scales BF16 when exact), so the
 * caller's arrays are not needed after it returns. The arena and scratch are device memory; page tables and
 * lengths are HOST arrays (staged with the forward's metadata). all_reduce gets a pinned host copy of x. The drafter's
 * forward runs on the device too (its feats and logits stay HOST arrays); desc.target shares the target's embed
 * and lm_head. */

/* CUDA graphs: forwards of exactly rows[i] rows (i < n <= 16) are captured once per output shape (n_out, logits,
 * argmax, hidden layers) and replayed; other row counts launch eagerly (stderr says so once). Replaces the previous
 * set and drops captured graphs. No graphs while all_reduce is set. The CPU build accepts and ignores the set. */
int kd_model_set_graph_rows(kd_model *m, const int64_t *rows, int64_t n);
/* stats i64[4]: graphs captured, graph replays, eager forwards, buckets set; *capture_seconds: time spent
 * capturing (may be NULL). The CPU build reports zeros (no graphs). */
int kd_model_graph_stats(kd_model *m, int64_t *stats, double *capture_seconds);
/* The MoE tax: stats i64[n_layers * 3], per layer (0 for dense layers): MoE forwards, the distinct routed experts
 * they used summed over those forwards (each streams the union of its rows' experts), rows summed; reset != 0 zeroes
 * them after the copy. The CUDA build answers KD_EINVAL (it routes on the device). */
int kd_model_moe_stats(kd_model *m, int64_t *stats, int reset);

/* Roofs of this host, for the forward-cost curve (pipeline=bench_forward): kd_roof_read sums n floats from p
 * (a streaming read: its bytes / its time is the read roof); kd_roof_fma runs independent fused multiply-adds on
 * registers per thread, in the widest registers the CPU build's kernels use (AVX-512 where they run it: 16 lanes,
 * iters / 2 x KD_ROOF_CHAINS of them; else 8 lanes, iters x KD_ROOF_CHAINS): 2 x 8 x KD_ROOF_CHAINS flops per
 * iteration per thread either way. Both use
 * `threads` threads (<= 0: kd_threads()) and return a value that keeps the work alive. Host code in both builds. */
#define KD_ROOF_CHAINS 12
double kd_roof_read(const float *p, int64_t n, int threads);
double kd_roof_fma(int64_t iters, int threads);

/* Tensor parallel on the device (CUDA build): the forward's all-reduce as an NCCL all-gather on its stream plus a
 * rank-ordered sum kernel, ((p0 + p1) + p2) + ... elementwise (kdtree/parallel/comm.py's order: the host hook's
 * bits, independent of the row count), so CUDA graphs stay on. NCCL is loaded at run time: dlopen of nccl_lib, or
 * "libnccl.so.2" when NULL / empty. kd_nccl_unique_id writes rank 0's 128-byte id; every rank then calls
 * kd_model_set_nccl with it (collective); id128 NULL drops the communicator (back to desc.all_reduce). The CPU
 * build answers KD_EINVAL. */
int kd_nccl_unique_id(const char *nccl_lib, uint8_t *id128);
int kd_model_set_nccl(kd_model *m, const char *nccl_lib, const uint8_t *id128, int64_t nranks, int64_t rank);

/* DFlash block drafter (kdtree/model/drafter.py): shares the target's embed and lm_head pointers. */
typedef struct {
  const float *in_norm, *post_norm;          /* [D] */
  kd_weight q, k, v, o;                      /* [Hq*hd, D], [Hkv*hd, D], [Hkv*hd, D], [D, Hq*hd] */
  const float *q_norm, *k_norm;              /* [hd] */
  kd_mlp mlp;
} kd_drafter_layer;

typedef struct {
  int64_t vocab, hidden, n_layers, hq, hkv, head_dim, block_size;
  int32_t mask_token;
  float eps;
  double rope_theta;
  kd_weight fc;                              /* [D, n_target_layers * D] */
  const float *hidden_norm, *final_norm;     /* [D] */
  const float *embed;                        /* [V, D] (the target's) */
  kd_weight lm_head;                         /* [V, D] (the target's) */
  const kd_drafter_layer *layers;            /* [n_layers], copied at create */
  const kd_model *target;                    /* CUDA: the target whose DEVICE embed / lm_head these are (it must
                                                outlive the drafter), so they are not uploaded twice; NULL = the
                                                drafter's own copies. The CPU build reads embed / lm_head above. */
  const uint16_t *embed_bf16;                /* [V, D] BF16 bits instead of embed, or NULL */
} kd_drafter_desc;

typedef struct kd_drafter kd_drafter;

int kd_drafter_create(const kd_drafter_desc *desc, kd_drafter **out);
int kd_drafter_destroy(kd_drafter *d);
/* The drafter's context K/V in a paged arena of its own, f32 [n_layers][n_pages * page_rows][Hkv*hd] for K and V,
 * indexed by the SAME page ids as its target's latent arena: a sequence's drafter context rows live in the pages of
 * its target cache (row j = position j's context), so a prefix cache hit maps both with one page table. Sizing as
 * kd_model_pages. Sequences: page tables (pages + page_start, as kd_forward_args) and context lengths. */
int kd_drafter_pages(kd_drafter *d, int64_t n_pages, int64_t page_rows);
/* Append context rows to each sequence after lengths[s]: feats f32[sum T_s, fc.n_in] (rows grouped per sequence as
 * row_start); the caller advances the lengths. */
int kd_drafter_extend(kd_drafter *d, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                      const int64_t *lengths, const int64_t *row_start, const float *feats);
/* One block forward per sequence after its lengths[s] context rows: logits f32[n_seqs, B-1, V] of the tokens after
 * bonus[s]. */
int kd_drafter_draft(kd_drafter *d, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                     const int64_t *lengths, const int32_t *bonus, float *logits);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_H */
