/* Host code shared by both builds: the thread-local error message and the tree ops (trees are tiny; the
 * CUDA build runs them on the host as well, on host pointers). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kd_common.h"
#include "kd_exp.h"

static _Thread_local char kd_err[512];

int kd_fail(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(kd_err, sizeof kd_err, fmt, ap);
  va_end(ap);
  return status;
}

void kd_clear_error(void) { kd_err[0] = 0; }

int kd_moe_check(const float *x, const int32_t *experts, const float *weights, const float *const *gate,
                 const float *const *up, const float *const *down, int64_t n_experts, const float *shared_gate,
                 const float *shared_up, const float *shared_down, const float *out, int64_t T, int64_t D,
                 int64_t I, int64_t Is, int64_t k) {
  if (T < 0 || D <= 0 || I < 0 || Is < 0 || k < 0 || n_experts < 0) return kd_fail(KD_EINVAL, "kd_moe_f32: bad size");
  if (T == 0) return KD_OK;
  KD_CHECK_PTR("kd_moe_f32", x);
  KD_CHECK_PTR("kd_moe_f32", out);
  if (k > 0) {
    KD_CHECK_PTR("kd_moe_f32", experts);
    KD_CHECK_PTR("kd_moe_f32", weights);
    KD_CHECK_PTR("kd_moe_f32", gate);
    KD_CHECK_PTR("kd_moe_f32", up);
    KD_CHECK_PTR("kd_moe_f32", down);
  }
  if (shared_gate && (!shared_up || !shared_down)) return kd_fail(KD_EINVAL, "kd_moe_f32: partial shared expert");
  for (int64_t i = 0; i < T * k; i++) {
    if (experts[i] < 0 || experts[i] >= n_experts)
      return kd_fail(KD_EINVAL, "kd_moe_f32: expert id %d outside [0, %lld)", experts[i], (long long)n_experts);
    if (!gate[experts[i]] || !up[experts[i]] || !down[experts[i]])
      return kd_fail(KD_EINVAL, "kd_moe_f32: expert %d has a NULL weight", experts[i]);
  }
  return KD_OK;
}

const char *kd_last_error(void) { return kd_err; }

int kd_version(void) { return KD_ABI_VERSION; }

/* ---- tree build: binary heap ordered by (score desc, counter asc) ------------------------------------ */
typedef struct {
  double score;      /* path score: parent's score + (double)logp[depth-1][rank] */
  double base;       /* the parent's path score (0 for depth 1), to score the next sibling */
  int64_t counter;   /* push order: ties pop FIFO */
  int32_t depth;     /* 1-based */
  int32_t rank;      /* column in logp/ids */
  int32_t parent;    /* output index of the parent node, -1 = root */
} kd_heap_node;

static int kd_heap_before(const kd_heap_node *a, const kd_heap_node *b) {
  return a->score > b->score || (a->score == b->score && a->counter < b->counter);
}

static void kd_heap_push(kd_heap_node *h, int64_t *n, kd_heap_node v) {
  int64_t i = (*n)++;
  while (i > 0) {
    int64_t p = (i - 1) / 2;
    if (!kd_heap_before(&v, &h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = v;
}

/* h[0] := v, sifted down among the n nodes (a pop + push in one pass). Counters are unique, so the order is
 * total and the pop sequence depends only on the set of nodes, never on how the heap got there. */
static void kd_heap_replace_top(kd_heap_node *h, int64_t n, kd_heap_node v) {
  int64_t i = 0;
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && kd_heap_before(&h[c + 1], &h[c])) c++;
    if (!kd_heap_before(&h[c], &v)) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = v;
}
static void kd_heap_pop(kd_heap_node *h, int64_t *n) {
  if (--(*n) > 0) kd_heap_replace_top(h, *n, h[*n]);
}

/* ---- draft top-k: one row of kd_draft_topk ----------------------------------------------------------------
 * max (NaN if any entry is NaN, as numpy's max), sum of exp(x - max) in double over eight fixed lanes (element v to
 * lane v % 8, lanes combined pairwise), then the selection. The AVX2 helpers run the same operations on eight
 * elements at a time and leave the tail to the scalar loops, so both paths give the same bits. */
/* The host code's SIMD dispatch, both builds (kd_exp.h): AVX2 + FMA present, and KDTREE_CPU_GENERIC=1 not set (it
 * forces the portable loops; the tests compare both paths bit for bit). */
int kd_host_avx2(void) {
  static int use = -1;
  if (use < 0) {
    const char *env = getenv("KDTREE_CPU_GENERIC");
#if defined(__x86_64__) && defined(__GNUC__)
    use = !(env && env[0] == '1') && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    (void)env;
    use = 0;
#endif
  }
  return use;
}

/* The CPU build's AVX-512 linear kernels: the CPU has AVX-512 F/BW/VL/DQ, kd_host_avx2() holds, and
 * KDTREE_CPU_ISA=avx2 is not set (it keeps the AVX2 kernels on an AVX-512 host; the tests compare all three paths,
 * which give the same bits). */
int kd_host_avx512(void) {
  static int use = -1;
  if (use < 0) {
    const char *env = getenv("KDTREE_CPU_ISA");
#if defined(__x86_64__) && defined(__GNUC__)
    use = kd_host_avx2() && !(env && strcmp(env, "avx2") == 0) && __builtin_cpu_supports("avx512f") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512dq");
#else
    (void)env;
    use = 0;
#endif
  }
  return use;
}

/* which of the host loops run: the CPU build's linears have all three; the CUDA build's host code (top-k, exp) has
 * AVX2 and portable loops only, so it never says avx512 */
const char *kd_host_kernels(void) {
#ifdef KD_CUDA_BUILD
  return kd_host_avx2() ? "avx2" : "generic";
#else
  return kd_host_avx512() ? "avx512" : kd_host_avx2() ? "avx2" : "generic";
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KD_TOPK_X86 1
/* elements [0, V - V % 8): the max and whether any is NaN; returns how many */
__attribute__((target("avx2"))) static int64_t kd_topk_max_avx2(const float *x, int64_t V, float *m, int *nan) {
  if (V < 8) return 0;
  __m256 mx = _mm256_loadu_ps(x), un = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
  int64_t v = 8;
  for (; v + 8 <= V; v += 8) {
    __m256 a = _mm256_loadu_ps(x + v);
    mx = _mm256_max_ps(mx, a);
    un = _mm256_or_ps(un, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  float t[8];
  _mm256_storeu_ps(t, mx);
  float r = t[0];
  for (int i = 1; i < 8; i++) r = t[i] > r ? t[i] : r;
  *m = r, *nan = _mm256_movemask_ps(un) != 0;
  return v;
}

/* acc[l] += exp(x[v] - m) for v in [0, V - V % 8), v % 8 == l, ascending v; returns how many */
__attribute__((target("avx2"))) static int64_t kd_topk_expsum_avx2(const float *x, int64_t V, float m, double *acc) {
  __m256d lo = _mm256_loadu_pd(acc), hi = _mm256_loadu_pd(acc + 4);
  __m256 mv = _mm256_set1_ps(m);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    __m256 e = kd_expf8_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + v), mv));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  _mm256_storeu_pd(acc, lo), _mm256_storeu_pd(acc + 4, hi);
  return v;
}

/* the first v >= v0 (a multiple of 8 from v0) whose val = (x[v] - m) - c > thr, or the end of the whole chunks */
__attribute__((target("avx2"))) static int64_t kd_topk_next_avx2(const float *x, int64_t v0, int64_t V, float m,
                                                                 float c, float thr) {
  __m256 mv = _mm256_set1_ps(m), cv = _mm256_set1_ps(c), tv = _mm256_set1_ps(thr);
  int64_t v = v0;
  for (; v + 8 <= V; v += 8) {
    __m256 val = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + v), mv), cv);
    int bits = _mm256_movemask_ps(_mm256_cmp_ps(val, tv, _CMP_GT_OQ));
    if (bits) return v + __builtin_ctz((unsigned)bits);
  }
  return v;
}
#endif

static void kd_draft_topk_row(const float *x, int64_t V, int64_t w, float *lp, int32_t *id) {
  float m = x[0];
  int64_t v = 0;
  int nan = 0;
#ifdef KD_TOPK_X86
  const int avx2 = kd_host_avx2();
  if (avx2) v = kd_topk_max_avx2(x, V, &m, &nan);
#endif
  for (; v < V; v++) {
    if (x[v] > m) m = x[v];
    if (x[v] != x[v]) nan = 1;
  }
  if (nan) m = NAN; /* numpy's max */
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  v = 0;
#ifdef KD_TOPK_X86
  if (avx2) v = kd_topk_expsum_avx2(x, V, m, acc);
#endif
  for (; v < V; v++) acc[v % 8] += (double)kd_expf(x[v] - m);
  for (int h = 4; h >= 1; h /= 2)
    for (int i = 0; i < h; i++) acc[i] += acc[i + h];
  float c = (float)log(acc[0]);
  /* selection: a sorted run of the best n <= w so far; scanning ids upward and entering only on a strictly
   * larger value keeps equal log-probs in ascending id; NaN never compares larger */
  int64_t n = 0;
  for (v = 0; v < V; v++) {
#ifdef KD_TOPK_X86
    if (avx2 && n == w && (v & 7) == 0) { /* skip whole chunks with nothing above the w-th best */
      v = kd_topk_next_avx2(x, v, V, m, c, lp[w - 1]);
      if (v >= V) break;
    }
#endif
    float val = (x[v] - m) - c;
    if (n == w && !(val > lp[w - 1])) continue;
    if (n < w && val != val) continue;
    int64_t j = n < w ? n++ : w - 1;
    while (j > 0 && val > lp[j - 1]) {
      lp[j] = lp[j - 1], id[j] = id[j - 1];
      j--;
    }
    lp[j] = val, id[j] = (int32_t)v;
  }
  for (v = 0; n < w && v < V; v++) { /* fewer than w numbers: the NaN entries follow, by id */
    float val = (x[v] - m) - c;
    if (val != val) lp[n] = val, id[n++] = (int32_t)v;
  }
}

int kd_draft_topk(const float *logits, int64_t n_rows, int64_t V, int64_t width, float *logp, int32_t *ids) {
  kd_clear_error();
  if (n_rows < 0 || V <= 0 || width <= 0)
    return kd_fail(KD_EINVAL, "kd_draft_topk: bad size (rows=%lld V=%lld width=%lld)", (long long)n_rows,
                   (long long)V, (long long)width);
  if (n_rows == 0) return KD_OK;
  KD_CHECK_PTR("kd_draft_topk", logits);
  KD_CHECK_PTR("kd_draft_topk", logp);
  KD_CHECK_PTR("kd_draft_topk", ids);
  int64_t w = width < V ? width : V;
#ifdef _OPENMP /* the CPU build: rows over the threads when the vocabulary is large (each row one thread's) */
#pragma omp parallel for schedule(static) num_threads(kd_threads()) if (V >= 32768 && n_rows > 1 && kd_threads() > 1)
#endif
  for (int64_t r = 0; r < n_rows; r++) kd_draft_topk_row(logits + r * V, V, w, logp + r * w, ids + r * w);
  return KD_OK;
}

/* ---- tree build, fast path: one FIFO queue per (depth, rank) ---------------------------------------------
 * Where every row is non-increasing and its first entry <= 0 (so no NaN and no positive logp), every push scores
 * <= the node just popped (a child adds logp <= 0; a sibling adds the next, smaller logp to the same base; float
 * addition is monotone) and gets a larger counter, so the heap pops in (score desc, counter asc) order. The nodes
 * at (depth d, rank r) are then pushed in that order too: the (d, 0) nodes as their parents pop (bases
 * non-increasing), the (d, r+1) nodes as the (d, r) nodes pop, which by induction is the order they were pushed
 * in, so their bases are non-increasing and base + logp[d][r+1] is too. Each (d, r) queue is sorted, and the best
 * node in the heap is the best queue head: a sorted array of the non-empty queues' heads (at most depth * width,
 * in practice ~10-20) replaces the heap over every pushed node. The order is total (unique counters), so the pops
 * are the same nodes in the same order, ties included.
 * A family = the children of one node (or of the root); its live entry is its next unpopped child. The families of
 * a depth form a list in creation order, along which their ranks are non-increasing: the (d, r) queue is the run
 * [head[d][r], head[d][r-1]) of that list (head[d][-1] = the list's end, a sentinel that the next new family of
 * the depth fills in). */
typedef struct {
  double base;     /* the parent's path score */
  uint32_t cnt;    /* push counter of the family's live entry */
  int32_t parent;  /* output index of the parent, -1 = root */
  int32_t next;    /* the next family of the same depth */
  int32_t pad_;
} kd_tree_family;

#define KD_TREE_QMAX 256 /* depth * width limit of the fast path */
#define KD_TREE_FAMS 600 /* families on the stack; more are allocated */

/* a queue head: {score's bits, cnt << 32 | depth << 16 | rank}, moved as one 16-byte value */
typedef uint64_t kd_qhead __attribute__((vector_size(16)));
static inline double kd_qhead_score(kd_qhead e) {
  uint64_t b = e[0];
  double s;
  memcpy(&s, &b, sizeof s);
  return s;
}
static inline kd_qhead kd_qhead_make(double s, uint64_t meta) {
  uint64_t b;
  memcpy(&b, &s, sizeof b);
  return (kd_qhead){b, meta};
}
/* heads a[0..k) sorted worst to best; x enters from the best end (it is never better than the node just popped,
 * so it usually stops after a few steps). Equal scores: the lower counter (the meta's high half) is better. */
static inline void kd_qhead_insert(kd_qhead *a, int *k, kd_qhead x) {
  const double s = kd_qhead_score(x);
  const uint64_t m = x[1];
  int j = (*k)++;
  while (j > 0 && (kd_qhead_score(a[j - 1]) > s || (kd_qhead_score(a[j - 1]) == s && a[j - 1][1] < m))) {
    a[j] = a[j - 1];
    j--;
  }
  a[j] = x;
}

static int kd_tree_queues_ok(const float *logp, int64_t n_depth, int64_t width) {
  if (n_depth > KD_TREE_QMAX || width > KD_TREE_QMAX || n_depth * width > KD_TREE_QMAX) return 0;
  int ok = 1;
  for (int64_t d = 0; d < n_depth; d++) {
    const float *row = logp + d * width;
    ok &= row[0] <= 0.0f; /* false for NaN */
    for (int64_t r = 0; r + 1 < width; r++) ok &= row[r + 1] <= row[r];
  }
  return ok;
}

/* the fast path; returns the node count, or -1 when out of memory */
static int64_t kd_tree_build_queues(const float *logp, const int32_t *ids, int64_t n_depth, int64_t width,
                                    int64_t budget, int32_t *tokens, int32_t *parents, int32_t *depths) {
  const int D = (int)n_depth, W = (int)width;
  int32_t head[KD_TREE_QMAX], end[KD_TREE_QMAX];
  kd_qhead a[KD_TREE_QMAX];
  kd_tree_family local[KD_TREE_FAMS];
  const int64_t pool_n = (int64_t)D + 1 + budget; /* D list ends + the root's family + at most one per pop */
  kd_tree_family *fam =
      pool_n <= KD_TREE_FAMS ? local : (kd_tree_family *)malloc(sizeof(kd_tree_family) * (size_t)pool_n);
  if (!fam) return -1;
  for (int d = 0; d < D; d++) {
    end[d] = d;
    for (int r = 0; r < W; r++) head[d * W + r] = d;
  }
  int32_t npool = D;
  uint32_t counter = 0;
  int k = 0;
  int64_t n = 0;
  fam[end[0]] = (kd_tree_family){0.0, counter++, -1, npool, 0}; /* the root's family: depth 1 */
  end[0] = npool++;
  a[k++] = kd_qhead_make((double)logp[0], 0);
  while (n < budget && k > 0) {
    const kd_qhead t = a[--k]; /* the best head */
    const double score = kd_qhead_score(t);
    const uint64_t dr = t[1] & 0xffffffffu;
    const int d = (int)(dr >> 16), r = (int)(dr & 0xffff), q = d * W + r;
    const int32_t f = head[q];
    const int32_t i = (int32_t)n++;
    tokens[i] = ids[q];
    parents[i] = fam[f].parent;
    depths[i] = d + 1;
    const double base = fam[f].base;
    const int32_t nf = fam[f].next;
    head[q] = nf;
    if (nf != (r ? head[q - 1] : end[d])) /* the queue's next family */
      kd_qhead_insert(a, &k, kd_qhead_make(fam[nf].base + (double)logp[q], (uint64_t)fam[nf].cnt << 32 | dr));
    if (r + 1 < W) { /* the sibling (pushed before the child): the family moves to the end of queue (d, r+1) */
      const uint32_t c = counter++;
      fam[f].cnt = c;
      if (head[q + 1] == f) /* the queue was empty: the family is its head */
        kd_qhead_insert(a, &k, kd_qhead_make(base + (double)logp[q + 1], (uint64_t)c << 32 | (dr + 1)));
    }
    if (d + 1 < D) { /* the first child: a new family at the end of depth d+2's list */
      const uint32_t c = counter++;
      const int32_t g = end[d + 1];
      fam[g] = (kd_tree_family){score, c, i, npool, 0};
      end[d + 1] = npool++;
      if (head[(d + 1) * W] == g)
        kd_qhead_insert(a, &k, kd_qhead_make(score + (double)logp[(int64_t)(d + 1) * W],
                                             (uint64_t)c << 32 | (uint64_t)(d + 1) << 16));
    }
  }
  if (fam != local) free(fam);
  return n;
}

/* the general path (any rows: unsorted, positive, NaN): a heap over every pushed node */
static int64_t kd_tree_build_heap(const float *logp, const int32_t *ids, int64_t n_depth, int64_t width,
                                  int64_t budget, int32_t *tokens, int32_t *parents, int32_t *depths) {
  /* every pop pushes at most 2 and removes 1: the heap never holds more than budget + 1 nodes; a decode
   * round's budget (<= ~500) lives on the stack, no allocation per call */
  kd_heap_node local[512];
  kd_heap_node *heap = budget + 2 <= 512 ? local : (kd_heap_node *)malloc(sizeof(kd_heap_node) * (size_t)(budget + 2));
  if (!heap) return -1;
  int64_t hn = 0, counter = 0, n = 0;
  kd_heap_node first = {(double)logp[0], 0.0, counter++, 1, 0, -1};
  kd_heap_push(heap, &hn, first);
  while (n < budget && hn > 0) {
    kd_heap_node v = heap[0]; /* the best node: popped below, or replaced by its sibling / first child */
    int64_t i = n++;
    tokens[i] = ids[(int64_t)(v.depth - 1) * width + v.rank];
    parents[i] = v.parent;
    depths[i] = v.depth;
    int has_sibling = v.rank + 1 < width, has_child = v.depth < n_depth;
    kd_heap_node s, c;
    if (has_sibling) /* pushed before the child: the lower counter */
      s = (kd_heap_node){v.base + (double)logp[(int64_t)(v.depth - 1) * width + v.rank + 1], v.base, counter++,
                         v.depth, v.rank + 1, v.parent};
    if (has_child)
      c = (kd_heap_node){v.score + (double)logp[(int64_t)v.depth * width], v.score, counter++, v.depth + 1, 0,
                         (int32_t)i};
    if (has_sibling) {
      kd_heap_replace_top(heap, hn, s);
      if (has_child) kd_heap_push(heap, &hn, c);
    } else if (has_child) {
      kd_heap_replace_top(heap, hn, c);
    } else {
      kd_heap_pop(heap, &hn);
    }
  }
  if (heap != local) free(heap);
  return n;
}

/* ---- tree build: the visibility rows ---------------------------------------------------------------------
 * row i+1 = its parent's row | bit i+1, every word written once (no memset pass). Rows of K <= 16 words run a
 * loop specialised for K, whole 16 (32 with AVX2) byte words; the row's bit comes in through a one-hot mask
 * (kd_vis_onehot[16 + w - bw] is all ones at the bit's word bw), so no word is written twice: a later row loading
 * its parent's row as whole vectors then reads back what single stores wrote. */
typedef uint64_t kd_vis2 __attribute__((vector_size(16)));
static const uint64_t kd_vis_onehot[32] = {[16] = ~(uint64_t)0};

static inline __attribute__((always_inline)) void kd_vis_rows(const int32_t *parents, int64_t n, uint64_t *vis,
                                                              const int64_t K) {
  for (int64_t i = 0; i < n; i++) {
    uint64_t *row = vis + (i + 1) * K;
    const uint64_t *up = vis + ((int64_t)parents[i] + 1) * K; /* parents precede children */
    const uint64_t bit = (uint64_t)1 << ((i + 1) & 63), *m = kd_vis_onehot + 16 - ((i + 1) >> 6);
    const kd_vis2 b2 = {bit, bit};
    int64_t w = 0;
    for (; w + 2 <= K; w += 2) {
      kd_vis2 x, mm;
      memcpy(&x, up + w, sizeof x);
      memcpy(&mm, m + w, sizeof mm);
      x |= mm & b2;
      memcpy(row + w, &x, sizeof x);
    }
    if (K & 1) row[K - 1] = up[K - 1] | (m[K - 1] & bit);
  }
}

#define KD_VIS_CASES(F)                                                                                            \
  F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15) F(16)

#ifdef KD_TOPK_X86
typedef uint64_t kd_vis4 __attribute__((vector_size(32)));
static inline __attribute__((always_inline, target("avx2"))) void kd_vis_rows_avx2(const int32_t *parents,
                                                                                  int64_t n, uint64_t *vis,
                                                                                  const int64_t K) {
  for (int64_t i = 0; i < n; i++) {
    uint64_t *row = vis + (i + 1) * K;
    const uint64_t *up = vis + ((int64_t)parents[i] + 1) * K;
    const uint64_t bit = (uint64_t)1 << ((i + 1) & 63), *m = kd_vis_onehot + 16 - ((i + 1) >> 6);
    const kd_vis4 b4 = {bit, bit, bit, bit};
    int64_t w = 0;
    for (; w + 4 <= K; w += 4) {
      kd_vis4 x, mm;
      memcpy(&x, up + w, sizeof x);
      memcpy(&mm, m + w, sizeof mm);
      x |= mm & b4;
      memcpy(row + w, &x, sizeof x);
    }
    if (K & 2) {
      kd_vis2 x, mm;
      memcpy(&x, up + w, sizeof x);
      memcpy(&mm, m + w, sizeof mm);
      x |= mm & (kd_vis2){bit, bit};
      memcpy(row + w, &x, sizeof x);
    }
    if (K & 1) row[K - 1] = up[K - 1] | (m[K - 1] & bit);
  }
}

__attribute__((target("avx2"))) static int kd_vis_avx2(const int32_t *parents, int64_t n, uint64_t *vis,
                                                       int64_t words) {
  switch (words) {
#define KD_VIS_AVX2_CASE(K)                                                                                        \
  case K: kd_vis_rows_avx2(parents, n, vis, K); return 1;
    KD_VIS_CASES(KD_VIS_AVX2_CASE)
#undef KD_VIS_AVX2_CASE
    default: return 0;
  }
}
#endif

static void kd_tree_visibility(const int32_t *parents, int64_t n, uint64_t *vis) {
  const int64_t words = (n + 1 + 63) / 64;
  vis[0] = 1u; /* row 0: the root sees itself */
  for (int64_t w = 1; w < words; w++) vis[w] = 0;
#ifdef KD_TOPK_X86
  if (kd_host_avx2() && kd_vis_avx2(parents, n, vis, words)) return;
#endif
  switch (words) {
#define KD_VIS_CASE(K)                                                                                             \
  case K: kd_vis_rows(parents, n, vis, K); return;
    KD_VIS_CASES(KD_VIS_CASE)
#undef KD_VIS_CASE
    default:
      for (int64_t i = 0; i < n; i++) {
        uint64_t *row = vis + (i + 1) * words;
        const uint64_t *up = vis + ((int64_t)parents[i] + 1) * words;
        for (int64_t w = 0; w < words; w++) row[w] = up[w];
        row[(i + 1) >> 6] |= (uint64_t)1 << ((i + 1) & 63);
      }
  }
}

int kd_tree_build(const float *logp, const int32_t *ids, int64_t n_depth, int64_t width, int64_t budget,
                  int32_t *tokens, int32_t *parents, int32_t *depths, int64_t cap, uint64_t *visibility,
                  int64_t *n_nodes) {
  kd_clear_error();
  if (!n_nodes) return kd_fail(KD_EINVAL, "kd_tree_build: n_nodes is NULL");
  *n_nodes = 0;
  if (n_depth < 0 || width < 0 || budget < 0)
    return kd_fail(KD_EINVAL, "kd_tree_build: negative size (depth=%lld width=%lld budget=%lld)",
                   (long long)n_depth, (long long)width, (long long)budget);
  if (budget > cap)
    return kd_fail(KD_EINVAL, "kd_tree_build: budget=%lld exceeds the output capacity cap=%lld",
                   (long long)budget, (long long)cap);
  if (budget > INT32_MAX - 1) return kd_fail(KD_EINVAL, "kd_tree_build: budget=%lld too large", (long long)budget);
  if (n_depth == 0 || width == 0 || budget == 0) {
    if (visibility) visibility[0] = 1u;
    return KD_OK;
  }
  if (!logp || !ids || !tokens || !parents || !depths)
    return kd_fail(KD_EINVAL, "kd_tree_build: NULL input or output pointer");
  const int64_t n = kd_tree_queues_ok(logp, n_depth, width)
                        ? kd_tree_build_queues(logp, ids, n_depth, width, budget, tokens, parents, depths)
                        : kd_tree_build_heap(logp, ids, n_depth, width, budget, tokens, parents, depths);
  if (n < 0) return kd_fail(KD_ENOMEM, "kd_tree_build: out of memory (budget=%lld)", (long long)budget);
  *n_nodes = n;
  if (visibility) kd_tree_visibility(parents, n, visibility);
  return KD_OK;
}

static int kd_bitmask_args(const char *op, const void *logits, const uint32_t *bitmask, int64_t T, int64_t V,
                           int64_t words) {
  kd_clear_error();
  if (T < 0 || V < 1 || words < (V + 31) / 32)
    return kd_fail(KD_EINVAL, "%s: T=%lld V=%lld words=%lld (need words >= ceil(V/32))", op, (long long)T,
                   (long long)V, (long long)words);
  if (T > 0 && (!logits || !bitmask)) return kd_fail(KD_EINVAL, "%s: NULL pointer", op);
  return KD_OK;
}

int kd_token_bitmask_apply(float *logits, const uint32_t *bitmask, int64_t T, int64_t V, int64_t words) {
  int rc = kd_bitmask_args("kd_token_bitmask_apply", logits, bitmask, T, V, words);
  if (rc) return rc;
  for (int64_t t = 0; t < T; t++) {
    float *x = logits + t * V;
    const uint32_t *m = bitmask + t * words;
    for (int64_t w = 0; w * 32 < V; w++) {
      uint32_t bits = m[w];
      if (bits == 0xffffffffu) continue;
      int64_t end = (w + 1) * 32 < V ? (w + 1) * 32 : V;
      for (int64_t v = w * 32; v < end; v++)
        if (!((bits >> (v - w * 32)) & 1u)) x[v] = -INFINITY;
    }
  }
  return KD_OK;
}

int kd_masked_argmax(const float *logits, const uint32_t *bitmask, int64_t T, int64_t V, int64_t words, int32_t *out) {
  int rc = kd_bitmask_args("kd_masked_argmax", logits, bitmask, T, V, words);
  if (rc) return rc;
  if (T > 0 && !out) return kd_fail(KD_EINVAL, "kd_masked_argmax: NULL pointer");
  for (int64_t t = 0; t < T; t++) {
    const float *x = logits + t * V;
    const uint32_t *m = bitmask + t * words;
    int64_t best = -1;
    float bv = 0.0f;
    for (int64_t w = 0; w * 32 < V; w++) {
      uint32_t bits = m[w];
      while (bits) { /* the allowed tokens of this word, ascending */
        int b = __builtin_ctz(bits);
        bits &= bits - 1;
        int64_t v = w * 32 + b;
        if (v >= V) break;
        float xv = x[v];
        if (best < 0 || xv > bv || (isnan(xv) && !isnan(bv))) { /* numpy: the first NaN wins, then the max */
          best = v;
          bv = xv;
          if (isnan(xv)) break;
        }
      }
      if (best >= 0 && isnan(bv)) break;
    }
    out[t] = (int32_t)best;
  }
  return KD_OK;
}

int kd_tree_accept(const int32_t *parents, const int32_t *tokens, int64_t n_nodes, const int32_t *target_argmax,
                   int32_t *path, int64_t *path_len, int32_t *bonus) {
  kd_clear_error();
  if (!path_len || !bonus || !target_argmax || (n_nodes > 0 && (!parents || !tokens || !path)))
    return kd_fail(KD_EINVAL, "kd_tree_accept: NULL pointer");
  if (n_nodes < 0) return kd_fail(KD_EINVAL, "kd_tree_accept: n_nodes=%lld < 0", (long long)n_nodes);
  int64_t cur = -1, k = 0;
  for (;;) {
    int32_t want = target_argmax[cur + 1];
    int64_t next = -1;
    for (int64_t i = cur + 1; i < n_nodes; i++) /* children come after their parent */
      if (parents[i] == cur && tokens[i] == want) {
        next = i;
        break;
      }
    if (next < 0) break;
    path[k++] = (int32_t)next;
    cur = next;
  }
  *path_len = k;
  *bonus = target_argmax[cur + 1];
  return KD_OK;
}

int kd_tree_build_job(kd_tree_job *j) {
  if (!j) {
    kd_clear_error();
    return kd_fail(KD_EINVAL, "kd_tree_build_job: job is NULL");
  }
  return kd_tree_build(j->logp, j->ids, j->n_depth, j->width, j->budget, j->tokens, j->parents, j->depths, j->cap,
                       j->visibility, &j->n_nodes);
}

/* ---- weight and drafter-descriptor checks, the drafter's RoPE table (both builds) --------------------------- */
int kd_weight_ok(const kd_weight *w, int64_t n_out, int64_t n_in) {
  if (w->n_out != n_out || w->n_in != n_in) return 0;
  if (w->packed)
    return (w->scales != NULL) != (w->scales_bf16 != NULL) && w->group > 0 && w->group % 8 == 0 && !w->f32 && !w->bf16;
  return (w->f32 != NULL) != (w->bf16 != NULL); /* exactly one of f32 / bf16 */
}

int kd_mlp_ok(const kd_mlp *p, int64_t D) {
  int64_t I = p->gate.n_out;
  return I > 0 && kd_weight_ok(&p->gate, I, D) && kd_weight_ok(&p->up, I, D) && kd_weight_ok(&p->down, D, I);
}

int kd_drafter_desc_check(const kd_drafter_desc *d) {
  int64_t D = d->hidden, hd = d->head_dim;
  if (D <= 0 || d->vocab <= 0 || d->n_layers <= 0 || d->hq <= 0 || d->hkv <= 0 || d->hq % d->hkv || hd <= 0 ||
      hd % 2 || d->block_size < 2)
    return kd_fail(KD_EINVAL, "kd_drafter_create: bad sizes (D=%lld Hq=%lld Hkv=%lld hd=%lld block=%lld)",
                   (long long)D, (long long)d->hq, (long long)d->hkv, (long long)hd, (long long)d->block_size);
  int ok = d->layers && (d->embed || d->embed_bf16) && d->hidden_norm && d->final_norm && kd_weight_ok(&d->lm_head, d->vocab, D) &&
           d->fc.n_out == D && d->fc.n_in > 0 && kd_weight_ok(&d->fc, D, d->fc.n_in);
  for (int64_t i = 0; ok && i < d->n_layers; i++) {
    const kd_drafter_layer *ly = &d->layers[i];
    ok = ly->in_norm && ly->post_norm && ly->q_norm && ly->k_norm && kd_weight_ok(&ly->q, d->hq * hd, D) &&
         kd_weight_ok(&ly->k, d->hkv * hd, D) && kd_weight_ok(&ly->v, d->hkv * hd, D) &&
         kd_weight_ok(&ly->o, D, d->hq * hd) && kd_mlp_ok(&ly->mlp, D);
  }
  if (!ok) return kd_fail(KD_EINVAL, "kd_drafter_create: a weight is missing or its shape disagrees with the sizes");
  return KD_OK;
}

void kd_rope_half_table(float *cs, int64_t start, int64_t T, int64_t hd, double theta) {
  int64_t half = hd / 2;
  for (int64_t r = 0; r < T; r++)
    for (int64_t i = 0; i < half; i++) {
      double inv = 1.0 / pow(theta, (double)(2 * i) / (double)hd), ang = (double)(start + r) * inv;
      cs[r * hd + i] = (float)cos(ang);
      cs[r * hd + half + i] = (float)sin(ang);
    }
}

/* ---- kd_model_forward's argument checks (both builds) ------------------------------------------------ */
int kd_page_tables_check(const char *fn, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                         const int64_t *lengths, const int64_t *row_start, int64_t n_pages, int64_t page_rows) {
  if (n_seqs <= 0 || !pages || !page_start || !lengths)
    return kd_fail(KD_EINVAL, "%s: n_seqs=%lld with pages, page_start and lengths required", fn, (long long)n_seqs);
  if (n_pages <= 0 || page_rows <= 0)
    return kd_fail(KD_EINVAL, "%s: no latent-cache arena (%lld pages of %lld rows); size it first (kd_model_pages / "
                              "kd_drafter_pages)", fn, (long long)n_pages, (long long)page_rows);
  if (page_start[0] != 0)
    return kd_fail(KD_EINVAL, "%s: page_start[0]=%lld must be 0", fn, (long long)page_start[0]);
  for (int64_t s = 0; s < n_seqs; s++) {
    int64_t n_table = page_start[s + 1] - page_start[s], add = row_start ? row_start[s + 1] - row_start[s] : 0;
    if (n_table < 0 || lengths[s] < 0 || add < 0)
      return kd_fail(KD_EINVAL, "%s: sequence %lld has a page table of %lld pages, length %lld, %lld new rows", fn,
                     (long long)s, (long long)n_table, (long long)lengths[s], (long long)add);
    if (lengths[s] + add > n_table * page_rows)
      return kd_fail(KD_EINVAL, "%s: sequence %lld's page table of %lld pages (%lld rows) cannot hold %lld + %lld "
                                "rows; give it more pages", fn, (long long)s, (long long)n_table,
                     (long long)(n_table * page_rows), (long long)lengths[s], (long long)add);
    for (int64_t i = page_start[s]; i < page_start[s + 1]; i++)
      if (pages[i] < 0 || pages[i] >= n_pages)
        return kd_fail(KD_EINVAL, "%s: sequence %lld's page table holds page %d outside the arena of %lld pages", fn,
                       (long long)s, pages[i], (long long)n_pages);
  }
  return KD_OK;
}

int kd_forward_args_check(const kd_forward_args *a, int64_t vocab, int64_t n_layers, int64_t n_pages,
                          int64_t page_rows) {
  if (a->n_rows <= 0 || !a->tokens || !a->positions || a->n_seqs <= 0 || !a->row_start)
    return kd_fail(KD_EINVAL, "kd_model_forward: n_rows=%lld, n_seqs=%lld and tokens/positions/row_start "
                              "are required", (long long)a->n_rows, (long long)a->n_seqs);
  if (a->row_start[0] != 0 || a->row_start[a->n_seqs] != a->n_rows)
    return kd_fail(KD_EINVAL, "kd_model_forward: row_start must run from 0 to n_rows=%lld", (long long)a->n_rows);
  for (int64_t s = 0; s < a->n_seqs; s++)
    if (a->row_start[s + 1] <= a->row_start[s])
      return kd_fail(KD_EINVAL, "kd_model_forward: sequence %lld has %lld rows", (long long)s,
                     (long long)(a->row_start[s + 1] - a->row_start[s]));
  int rc = kd_page_tables_check("kd_model_forward", a->n_seqs, a->pages, a->page_start, a->lengths, a->row_start,
                                n_pages, page_rows);
  if (rc) return rc;
  for (int64_t i = 0; i < a->n_rows; i++)
    if (a->tokens[i] < 0 || a->tokens[i] >= vocab || a->positions[i] < 0)
      return kd_fail(KD_EINVAL, "kd_model_forward: row %lld has token %d (vocab %lld) at position %d", (long long)i,
                     a->tokens[i], (long long)vocab, a->positions[i]);
  if (a->n_out < 0 || a->n_out > a->n_rows)
    return kd_fail(KD_EINVAL, "kd_model_forward: n_out=%lld out of range", (long long)a->n_out);
  for (int64_t i = 0; a->out_rows && i < a->n_out; i++)
    if (a->out_rows[i] < 0 || a->out_rows[i] >= a->n_rows)
      return kd_fail(KD_EINVAL, "kd_model_forward: out_rows[%lld]=%lld outside [0, %lld)", (long long)i,
                     (long long)a->out_rows[i], (long long)a->n_rows);
  if (a->n_hidden < 0 || (a->n_hidden && (!a->hidden_layers || !a->hidden)))
    return kd_fail(KD_EINVAL, "kd_model_forward: n_hidden=%lld needs hidden_layers and hidden", (long long)a->n_hidden);
  if (a->row_value && (!a->row_pruned || !(a->expert_cost >= 0.0f)))
    return kd_fail(KD_EINVAL, "kd_model_forward: row_value needs row_pruned and an expert_cost >= 0 (got %g)",
                   (double)a->expert_cost);
  for (int64_t j = 0; j < a->n_hidden; j++) /* a layer that never comes would leave its column unwritten */
    if (a->hidden_layers[j] < 0 || a->hidden_layers[j] >= n_layers)
      return kd_fail(KD_EINVAL, "kd_model_forward: hidden_layers[%lld]=%lld is not a layer of this model (0..%lld)",
                     (long long)j, (long long)a->hidden_layers[j], (long long)(n_layers - 1));
  return KD_OK;
}

/* ---- roofs of this host (kdtree.h: kd_roof_read, kd_roof_fma) ------------------------------------------------ */
#if defined(__x86_64__) && defined(__GNUC__)
/* four streams side by side (quarters of the range, a cache line of each in turn): the linear kernels read a
 * panel's weight rows this way, and a core keeps more lines in flight over several streams than over one (a
 * single stream measured 4-5 % slower here) */
__attribute__((target("avx2"))) static double kd_roof_read_avx2(const float *p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int64_t q = n / 4 / 16 * 16;
  const float *p0 = p, *p1 = p + q, *p2 = p + 2 * q, *p3 = p + 3 * q;
  for (int64_t i = 0; i < q; i += 16) {
    a0 = _mm256_add_ps(a0, _mm256_add_ps(_mm256_loadu_ps(p0 + i), _mm256_loadu_ps(p0 + i + 8)));
    a1 = _mm256_add_ps(a1, _mm256_add_ps(_mm256_loadu_ps(p1 + i), _mm256_loadu_ps(p1 + i + 8)));
    a2 = _mm256_add_ps(a2, _mm256_add_ps(_mm256_loadu_ps(p2 + i), _mm256_loadu_ps(p2 + i + 8)));
    a3 = _mm256_add_ps(a3, _mm256_add_ps(_mm256_loadu_ps(p3 + i), _mm256_loadu_ps(p3 + i + 8)));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  double s = 0;
  for (int j = 0; j < 8; j++) s += lanes[j];
  for (int64_t i = 4 * q; i < n; i++) s += p[i];
  return s;
}

__attribute__((target("avx2,fma"))) static double kd_roof_fma_avx2(int64_t iters, float seed) {
  __m256 acc[KD_ROOF_CHAINS];
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int c = 0; c < KD_ROOF_CHAINS; c++) acc[c] = _mm256_set1_ps(seed + (float)c);
  for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int c = 0; c < KD_ROOF_CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  float lanes[8];
  __m256 s = acc[0];
  for (int c = 1; c < KD_ROOF_CHAINS; c++) s = _mm256_add_ps(s, acc[c]);
  _mm256_storeu_ps(lanes, s);
  double out = 0;
  for (int j = 0; j < 8; j++) out += lanes[j];
  return out;
}

/* kd_roof_fma_avx2's FMAs in 16-lane registers: iters / 2 iterations do the same floating-point operations */
__attribute__((target("avx512f,fma"))) static double kd_roof_fma_avx512(int64_t iters, float seed) {
  __m512 acc[KD_ROOF_CHAINS];
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int c = 0; c < KD_ROOF_CHAINS; c++) acc[c] = _mm512_set1_ps(seed + (float)c);
  for (int64_t i = 0; i < iters / 2; i++)
#pragma GCC unroll 12
    for (int c = 0; c < KD_ROOF_CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < KD_ROOF_CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
  return (double)_mm512_reduce_add_ps(s);
}
#endif

static double kd_roof_read_plain(const float *p, int64_t n) {
  float acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += p[i + j];
  double s = 0;
  for (int j = 0; j < 8; j++) s += acc[j];
  for (; i < n; i++) s += p[i];
  return s;
}

/* threads <= 0: kd_threads(); a build without OpenMP (the CUDA library's host code) runs one */
static int kd_roof_threads(int threads) {
#ifdef _OPENMP
  return threads > 0 ? threads : kd_threads();
#else
  (void)threads;
  return 1;
#endif
}

double kd_roof_read(const float *p, int64_t n, int threads) {
  if (!p || n <= 0) return 0.0;
  int nt = kd_roof_threads(threads);
  double total = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) reduction(+ : total)
#endif
  for (int t = 0; t < nt; t++) {
    int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
#if defined(__x86_64__) && defined(__GNUC__)
    total += kd_host_avx2() ? kd_roof_read_avx2(p + lo, hi - lo) : kd_roof_read_plain(p + lo, hi - lo);
#else
    total += kd_roof_read_plain(p + lo, hi - lo);
#endif
  }
  return total;
}

double kd_roof_fma(int64_t iters, int threads) {
  if (iters <= 0) return 0.0;
  int nt = kd_roof_threads(threads);
  double total = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) reduction(+ : total)
#endif
  for (int t = 0; t < nt; t++) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (kd_host_avx512()) { /* the FMA peak of the widest registers the kernels use */
      total += kd_roof_fma_avx512(iters, (float)t);
      continue;
    }
    if (kd_host_avx2()) {
      total += kd_roof_fma_avx2(iters, (float)t);
      continue;
    }
#endif
    float acc[KD_ROOF_CHAINS * 8];
    for (int c = 0; c < KD_ROOF_CHAINS * 8; c++) acc[c] = (float)(t + c);
    for (int64_t i = 0; i < iters; i++)
      for (int c = 0; c < KD_ROOF_CHAINS * 8; c++) acc[c] = acc[c] * 0.999999f + 1e-7f;
    for (int c = 0; c < KD_ROOF_CHAINS * 8; c++) total += acc[c];
  }
  return total;
}
