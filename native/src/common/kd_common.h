/* Shared per-element math and helpers of both builds (libkdtree_cpu.so and libkdtree_cuda.so).
 * KD_HD functions compile as host code in the C build and as __host__ __device__ in the CUDA build, so the
 * CPU tests exercise the exact element formulas the GPU kernels use. Build with -ffp-contract=off (C) and
 * --fmad=false (CUDA): a multiply-add the compiler fused on its own would change a row's rounding depending on how
 * it was compiled. (The CPU build's linear dots fuse on purpose, written in the source: fmaf / fmadd intrinsics.) */
#ifndef KD_COMMON_H
#define KD_COMMON_H

#include <math.h>
#include <stdint.h>

#include "kdtree.h"

#if defined(__CUDACC__)
#define KD_HD __host__ __device__ __forceinline__
#else
#define KD_HD static inline
#endif

/* Fixed-order dot products: element k goes to lane k % KD_LANES (ascending k), lanes are combined by a fixed
 * pairwise tree. The order depends only on the row length, never on T, alignment or the ISA. */
#define KD_LANES 16

KD_HD float kd_lanes_sum(float *acc) {
  for (int w = KD_LANES / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; i++) acc[i] = acc[i] + acc[i + w];
  return acc[0];
}

/* The signed int4 value of element j (0..7) of a packed word: nibble q+8 in bits 4j..4j+3 (logical shift). */
KD_HD int kd_int4_at(uint32_t word, int j) { return (int)((word >> (4u * (unsigned)j)) & 15u) - 8; }

/* Dequantized weight: one rounding, exactly numpy's q.astype(float32) * scale. */
KD_HD float kd_int4_weight(uint32_t word, int j, float scale) { return (float)kd_int4_at(word, j) * scale; }

/* the CUDA kernels' silu (the device's expf); the CPU build runs the same formula with kd_expf (kd_exp.h), whose
 * AVX2 and portable paths agree bit for bit */
KD_HD float kd_silu_mul1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* Is block key k visible to the query whose packed row is `row`? */
KD_HD int kd_visible(const uint64_t *row, int64_t k) { return (int)((row[k >> 6] >> (k & 63)) & 1u); }

KD_HD float kd_rms_inv(float sum_sq, int64_t D, float eps) { return 1.0f / sqrtf(sum_sq / (float)D + eps); }

/* Paged arenas, layer-major [n_layers][n_pages * page_rows][width] (kdtree.h, kd_model_pages): row j of a sequence
 * whose page table is `pages`, counted in rows from its layer's base (arena + layer * n_pages * page_rows * width).
 * One table lookup per page_rows rows; a page's rows are contiguous, and so are consecutive pages' (a sequence
 * whose pages were taken together reads its keys in long runs). */
KD_HD int64_t kd_page_key(const int32_t *pages, int64_t page_rows, int64_t j) {
  return (int64_t)pages[j / page_rows] * page_rows + j % page_rows;
}
/* ... and as a float offset from the arena itself, for layer l (layer_rows = n_pages * page_rows) */
KD_HD int64_t kd_page_row(const int32_t *pages, int64_t page_rows, int64_t layer_rows, int64_t width, int64_t l,
                          int64_t j) {
  return (l * layer_rows + kd_page_key(pages, page_rows, j)) * width;
}

/* The MoE combine of T tokens, the reference's order: out[t] = (((0 + w_0 y_0) + w_1 y_1) + ...) + shared[t];
 * ys rows of token t's k slots at pos[t * k + j], weights[t * k + j]; shared [T, D] or NULL. */
KD_HD void kd_moe_combine(float *out, const float *ys, const int64_t *pos, const float *weights, const float *shared,
                          int64_t T, int64_t k, int64_t D) {
  for (int64_t t = 0; t < T; t++) {
    float *o = out + t * D;
    for (int64_t c = 0; c < D; c++) o[c] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
      float w = weights[t * k + j];
      const float *y = ys + pos[t * k + j] * D;
      for (int64_t c = 0; c < D; c++) o[c] = o[c] + w * y[c];
    }
    if (shared)
      for (int64_t c = 0; c < D; c++) o[c] = o[c] + shared[t * D + c];
  }
}

#define KD_CHECK_PTR(name, p) \
  if (!(p)) return kd_fail(KD_EINVAL, "%s: %s is NULL", name, #p)

/* ---- error reporting (host side) ---------------------------------------------------------------------- */
#ifdef __cplusplus
extern "C" {
#endif
int kd_fail(int status, const char *fmt, ...);  /* formats into the thread-local message, returns status */
void kd_clear_error(void);
/* Arguments of kd_moe_f32, checked the same way by both builds (routing arrays are host pointers in both):
 * KD_OK when valid (T == 0 needs no pointers), else the failing status with its message set. */
int kd_moe_check(const float *x, const int32_t *experts, const float *weights, const float *const *gate,
                 const float *const *up, const float *const *down, int64_t n_experts, const float *shared_gate,
                 const float *shared_up, const float *shared_down, const float *out, int64_t T, int64_t D,
                 int64_t I, int64_t Is, int64_t k);
/* n_seqs page tables (pages + page_start[n_seqs + 1]) with lengths into an arena of n_pages x page_rows rows: every
 * page id inside the arena, and room for adds[s] rows (row_start[s+1] - row_start[s]; NULL = 0) after lengths[s].
 * KD_OK, else KD_EINVAL with a message naming fn, the sequence and the fix. Both builds, target and drafter. */
int kd_page_tables_check(const char *fn, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                         const int64_t *lengths, const int64_t *row_start, int64_t n_pages, int64_t page_rows);
/* kd_model_forward's arguments, checked the same way by both builds (the CPU tests exercise the CUDA build's
 * checks too), against the model's arena of n_pages x page_rows rows. Each build adds its own limits after it
 * (CUDA: rows per call, hidden layers). */
int kd_forward_args_check(const kd_forward_args *a, int64_t vocab, int64_t n_layers, int64_t n_pages,
                          int64_t page_rows);
/* A kd_weight of [n_out, n_in] with its pointers (INT4: scales and a group that is a multiple of 8); a kd_mlp of
 * hidden D (gate/up [I, D], down [D, I], I > 0). 1 = valid. Both builds' model and drafter create use them. */
int kd_weight_ok(const kd_weight *w, int64_t n_out, int64_t n_in);
int kd_mlp_ok(const kd_mlp *p, int64_t D);
/* kd_drafter_create's descriptor checks (sizes, then every weight), the same in both builds: KD_OK or KD_EINVAL
 * with the message set. */
int kd_drafter_desc_check(const kd_drafter_desc *d);
/* rotate_half RoPE tables of T positions from `start` (kdtree/model/drafter.py's rope_cos_sin, float64 rounded
 * once): cs [T, hd] = [hd/2 cos | hd/2 sin] per row. */
void kd_rope_half_table(float *cs, int64_t start, int64_t T, int64_t hd, double theta);
#ifdef __cplusplus
}
#endif

#endif /* KD_COMMON_H */
