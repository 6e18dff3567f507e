/* Internal to the CPU build (kd_cpu.c <-> kd_forward.c): the pieces the whole-model forward splits over OpenMP
 * threads. Not part of the public API (include/kdtree.h). */
#ifndef KD_CPU_INTERNAL_H
#define KD_CPU_INTERNAL_H
#include <stdint.h>

#include "kd_exp.h"

/* kdtree.h's kd_threads(): every parallel region asks for this many threads (num_threads clause). */
int kd_threads(void);

/* Weights (out x in) from which a linear is worth threads even for one row: K2-sized matrices (>= 1 M) use every
 * core. Smaller ones split only multi-row calls (kd_par_worth: the direct tiles). Each output element is computed by
 * one thread in the same order either way. (Processes are started by exec, never by a bare fork, so a started
 * OpenMP runtime is no hazard: kdtree.parallel.launch and the engine process both exec a new interpreter.) */
#define KD_PARALLEL_MIN_WEIGHTS (1 << 20)

/* Whether `macs` multiply-adds over `units` independent pieces are worth a parallel region: enough work (several
 * times a warm region's fork/join), at least two pieces, more than one thread, and not inside a region already. */
int kd_par_worth(int64_t macs, int64_t units);

/* Query rows [t0, t1) of kd_mla_attention, with the caller's scratch: keys [n_prefix + T], p [(n_prefix + T) * H].
 * pages NULL: kv holds the sequence's rows 0.. contiguously; else kv is one layer's base in a paged arena and row j
 * is key kd_page_key(pages, page_rows, j) (kd_common.h). */
void kd_mla_attention_rows(const float *q, const float *kv, const int32_t *pages, int64_t page_rows,
                           const uint64_t *visibility, float *out, int64_t t0, int64_t t1, int64_t T, int64_t H,
                           int64_t L, int64_t R, int64_t n_prefix, float scale, int64_t *keys, float *p);

/* dst[0..n) = BF16 bits src widened to float32, exactly (bits << 16); AVX2 eight at a time where in use */
void kd_bf16_widen(const uint16_t *src, float *dst, int64_t n);

/* p[i] = kd_expf(p[i]) for i < n, eight at a time where AVX2 is in use (kd_cpu.c) */
void kd_exp_inplace(float *p, int64_t n);

/* silu(g) * u with kd_expf: g / (1 + exp(-g)) * u */
static inline float kd_silu_mul_cpu(float g, float u) { return g / (1.0f + kd_expf(-g)) * u; }
/* the router's sigmoid */
static inline float kd_sigmoid_cpu(float x) { return 1.0f / (1.0f + kd_expf(-x)); }

#endif
