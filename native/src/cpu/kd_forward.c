/* Whole-model forwards of the CPU build (libkdtree_cpu.so): the K2 target (kdtree/model/k2.py, K2Model.forward)
 * and the DFlash drafter (kdtree/model/drafter.py, extend / draft), one library call each.
 *
 * The layer loops read like the numpy reference beside them and call the public dense kernels (kd_linear_f32,
 * kd_linear_w4a16, kd_rms_norm, kd_silu_mul, kd_head_linear_f32, kd_mla_attention), so every row keeps their
 * fixed reduction order: a row's result never depends on the other rows or sequences in the call. What is new
 * here is element-wise or per-row glue (YaRN rope, sigmoid routing, the MoE combine, argmax), written in the
 * numpy reference's operation order. Weights are the caller's (pointers registered once); latent caches and
 * scratch are owned here; scratch only grows, so a warm decode loop allocates nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "kd_common.h"
#include "kd_cpu_internal.h"

/* ---- small helpers ------------------------------------------------------------------------------------- */
typedef struct {
  void *p;
  size_t cap;
} kd_buf;

/* grow-only scratch: contents are not kept across a growth */
static void *kd_reserve(kd_buf *b, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (b->cap < bytes) {
    free(b->p);
    b->p = malloc(bytes);
    b->cap = b->p ? bytes : 0;
  }
  return b->p;
}

#define KD_TRY(expr)          \
  do {                        \
    int rc_ = (expr);         \
    if (rc_) return rc_;      \
  } while (0)

/* row `tok` of an embedding table [V, D], float32 or BF16 (widened exactly) -> dst [D] */
static void kd_embed_row(const float *f32, const uint16_t *bf16, int64_t tok, int64_t D, float *dst) {
  if (bf16)
    kd_bf16_widen(bf16 + tok * D, dst, D);
  else
    memcpy(dst, f32 + tok * D, sizeof(float) * (size_t)D);
}

static int kd_lin(const kd_weight *w, const float *x, float *out, int64_t T) {
  if (w->packed && w->scales_bf16)
    return kd_linear_w4a16_bf16_scales(x, w->packed, w->scales_bf16, out, T, w->n_in, w->n_out, w->group, NULL);
  if (w->packed)
    return kd_linear_w4a16(x, w->packed, w->scales, out, T, w->n_in, w->n_out, w->group, NULL);
  if (w->bf16) return kd_linear_bf16(x, w->bf16, out, T, w->n_in, w->n_out, NULL);
  return kd_linear_f32(x, w->f32, out, T, w->n_in, w->n_out, NULL);
}

/* numpy's float32 sum of a short contiguous row (pairwise_sum for n <= 128): sequential below 8 elements, else
 * eight partial sums combined ((0+1)+(2+3))+((4+5)+(6+7)), then the tail -- the reference's routing weights sum */
static float kd_np_sum(const float *a, int64_t n) {
  if (n < 8) {
    float r = 0.0f;
    for (int64_t i = 0; i < n; i++) r += a[i];
    return r;
  }
  float r[8];
  for (int j = 0; j < 8; j++) r[j] = a[j];
  int64_t i = 8;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) r[j] += a[i + j];
  float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
  for (; i < n; i++) res += a[i];
  return res;
}

/* index of the first maximum among the entries not yet taken (a stable descending sort's next pick) */
static int64_t kd_pick_max(const float *v, unsigned char *taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  if (best >= 0) taken[best] = 1;
  return best;
}

/* ---- the target model ------------------------------------------------------------------------------------ */
struct kd_model {
  kd_model_desc d;
  kd_layer *layers;
  kd_mlp **experts;     /* per layer copies */
  double *inv_freq;
  float *arena;         /* kd_model_pages: [n_pages][n_layers][page_rows][L+R], the latent rows of every sequence */
  int64_t n_pages, page_rows;
  int64_t E, q_lora, inter; /* latent row width, q_lora, largest MLP intermediate */
  kd_buf h, x, t, qa, q, kva, qf, olat, o, cs, rl, ex, ew, cnt, pos, xs, ys, g, u, sh, fo, lg, taken, attn, work, tg,
      prune;
  int64_t *moe_stats; /* [n_layers][3]: MoE forwards, distinct routed experts summed, rows summed (kd_model_moe_stats) */
};

int kd_model_destroy(kd_model *m) {
  if (!m) return KD_OK;
  if (m->experts)
    for (int64_t i = 0; i < m->d.n_layers; i++) free(m->experts[i]);
  free(m->experts);
  free(m->moe_stats);
  free(m->layers);
  free(m->inv_freq);
  free(m->arena);
  kd_buf *bufs[] = {&m->h, &m->x, &m->t, &m->qa, &m->q, &m->kva, &m->qf, &m->olat, &m->o, &m->cs, &m->rl, &m->ex,
                    &m->ew, &m->cnt, &m->pos, &m->xs, &m->ys, &m->g, &m->u, &m->sh, &m->fo, &m->lg, &m->taken, &m->attn,
                    &m->work, &m->tg, &m->prune};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]->p);
  free(m);
  return KD_OK;
}

int kd_model_create(const kd_model_desc *desc, kd_model **out) {
  kd_clear_error();
  KD_CHECK_PTR("kd_model_create", desc);
  KD_CHECK_PTR("kd_model_create", out);
  *out = NULL;
  const kd_model_desc *d = desc;
  int64_t D = d->hidden, L = d->kv_lora, R = d->rope_dim;
  if (D <= 0 || d->vocab <= 0 || d->n_layers <= 0 || L <= 0 || R <= 0 || R % 2 || d->nope <= 0 || d->v_head <= 0)
    return kd_fail(KD_EINVAL, "kd_model_create: bad sizes (D=%lld V=%lld layers=%lld L=%lld R=%lld)",
                   (long long)D, (long long)d->vocab, (long long)d->n_layers, (long long)L, (long long)R);
  if ((!d->embed && !d->embed_bf16) || !d->final_norm || !d->layers || !d->inv_freq || !kd_weight_ok(&d->lm_head, d->vocab, D))
    return kd_fail(KD_EINVAL, "kd_model_create: embed, final_norm, lm_head [V, D], layers and inv_freq are required");
  kd_model *m = (kd_model *)calloc(1, sizeof(kd_model));
  if (!m) return kd_fail(KD_ENOMEM, "kd_model_create: out of memory");
  m->d = *d;
  m->E = L + R;
  m->layers = (kd_layer *)malloc(sizeof(kd_layer) * (size_t)d->n_layers);
  m->experts = (kd_mlp **)calloc((size_t)d->n_layers, sizeof(kd_mlp *));
  m->inv_freq = (double *)malloc(sizeof(double) * (size_t)(R / 2));
  m->moe_stats = (int64_t *)calloc((size_t)d->n_layers * 3, sizeof(int64_t));
  if (!m->layers || !m->experts || !m->inv_freq || !m->moe_stats) {
    kd_model_destroy(m);
    return kd_fail(KD_ENOMEM, "kd_model_create: out of memory");
  }
  memcpy(m->layers, d->layers, sizeof(kd_layer) * (size_t)d->n_layers);
  memcpy(m->inv_freq, d->inv_freq, sizeof(double) * (size_t)(R / 2));
  m->d.layers = m->layers;
  m->d.inv_freq = m->inv_freq;
  for (int64_t i = 0; i < d->n_layers; i++) {
    kd_layer *ly = &m->layers[i];
    int64_t H = ly->heads, ql = ly->q_a.n_out;
    /* the absorbed halves and the router: float32 or BF16, exactly one of each */
    int ok = H > 0 && ql > 0 && ly->in_norm && ly->post_norm && ly->q_a_norm && ly->kv_a_norm &&
             !ly->w_uk_t != !ly->w_uk_t_bf16 && !ly->w_uv != !ly->w_uv_bf16 && kd_weight_ok(&ly->q_a, ql, D) &&
             kd_weight_ok(&ly->q_b, H * (d->nope + R), ql) && kd_weight_ok(&ly->kv_a, L + R, D) &&
             kd_weight_ok(&ly->o, D, H * d->v_head);
    if (ok && ly->is_moe) {
      ok = d->n_experts > 0 && d->top_k > 0 && d->top_k <= d->n_experts && !ly->router != !ly->router_bf16 &&
           ly->router_bias && ly->experts && d->n_group > 0 && d->n_experts % d->n_group == 0 && d->topk_group > 0 &&
           d->topk_group <= d->n_group;
      if (ok) {
        m->experts[i] = (kd_mlp *)malloc(sizeof(kd_mlp) * (size_t)d->n_experts);
        if (!m->experts[i]) {
          kd_model_destroy(m);
          return kd_fail(KD_ENOMEM, "kd_model_create: out of memory");
        }
        memcpy(m->experts[i], ly->experts, sizeof(kd_mlp) * (size_t)d->n_experts);
        ly->experts = m->experts[i];
        for (int64_t e = 0; e < d->n_experts && ok; e++) {
          ok = kd_mlp_ok(&ly->experts[e], D);
          if (ok && ly->experts[e].gate.n_out > m->inter) m->inter = ly->experts[e].gate.n_out;
        }
      }
      if (ok && ly->has_shared) {
        ok = kd_mlp_ok(&ly->shared, D);
        if (ok && ly->shared.gate.n_out > m->inter) m->inter = ly->shared.gate.n_out;
      }
    } else if (ok) {
      ok = kd_mlp_ok(&ly->mlp, D);
      if (ok && ly->mlp.gate.n_out > m->inter) m->inter = ly->mlp.gate.n_out;
    }
    if (!ok) {
      kd_model_destroy(m);
      return kd_fail(KD_EINVAL, "kd_model_create: layer %lld has a missing weight or one whose shape disagrees "
                                "with the model sizes", (long long)i);
    }
    if (ql > m->q_lora) m->q_lora = ql;
  }
  *out = m;
  return KD_OK;
}

/* grow or shrink a layer-major arena [n_layers][n_pages * page_rows][width] (kd_model_pages, kd_drafter_pages): the
 * first min(old, new) pages of every layer keep their rows when the page size is unchanged, new pages start zeroed */
static int kd_arena_resize(float **arena, int64_t *n_pages, int64_t *page_rows, int64_t want_pages, int64_t want_rows,
                           int64_t n_layers, int64_t width, const char *fn) {
  if (want_pages < 0 || want_rows <= 0)
    return kd_fail(KD_EINVAL, "%s: n_pages=%lld, page_rows=%lld; give n_pages >= 0 and page_rows >= 1", fn,
                   (long long)want_pages, (long long)want_rows);
  size_t page = (size_t)(want_rows * width), layer = page * (size_t)want_pages;
  int64_t keep = want_rows == *page_rows ? (*n_pages < want_pages ? *n_pages : want_pages) : 0;
  float *a = want_pages ? (float *)calloc(layer * (size_t)n_layers, sizeof(float)) : NULL;
  if (want_pages && !a)
    return kd_fail(KD_ENOMEM, "%s: out of memory for %lld pages of %lld rows (%zu bytes); lower serve.kv_pool_tokens",
                   fn, (long long)want_pages, (long long)want_rows, sizeof(float) * layer * (size_t)n_layers);
  for (int64_t l = 0; l < n_layers && keep; l++) /* each layer's first pages, into the resized layer block */
    memcpy(a + (size_t)l * layer, *arena + (size_t)l * page * (size_t)*n_pages, sizeof(float) * page * (size_t)keep);
  free(*arena);
  *arena = a, *n_pages = want_pages, *page_rows = want_rows;
  return KD_OK;
}

int kd_model_pages(kd_model *m, int64_t n_pages, int64_t page_rows) {
  kd_clear_error();
  KD_CHECK_PTR("kd_model_pages", m);
  return kd_arena_resize(&m->arena, &m->n_pages, &m->page_rows, n_pages, page_rows, m->d.n_layers, m->E,
                         "kd_model_pages");
}

/* a sequence's rows [start, start + n) must lie in its table of n_table pages, every page inside the arena */
static int kd_table_check(const char *fn, const int32_t *pages, int64_t n_table, int64_t start, int64_t n,
                          int64_t n_pages, int64_t page_rows) {
  int64_t zero = 0, bounds[2] = {0, n_table}, rows[2] = {0, start + n};
  if (start < 0 || n < 0) return kd_fail(KD_EINVAL, "%s: start=%lld n=%lld", fn, (long long)start, (long long)n);
  return kd_page_tables_check(fn, 1, pages, bounds, &zero, rows, n_pages, page_rows);
}

int kd_cache_keep(kd_model *m, const int32_t *pages, int64_t n_table, int64_t start, const int64_t *rows, int64_t n) {
  kd_clear_error();
  KD_CHECK_PTR("kd_cache_keep", m);
  if (n && !rows) return kd_fail(KD_EINVAL, "kd_cache_keep: rows is NULL");
  int64_t end = n ? rows[n - 1] + 1 : start;
  KD_TRY(kd_table_check("kd_cache_keep", pages, n_table, start, end - start, m->n_pages, m->page_rows));
  for (int64_t i = 0; i < n; i++)
    if (rows[i] < start || (i && rows[i] <= rows[i - 1]))
      return kd_fail(KD_EINVAL, "kd_cache_keep: rows must ascend from start=%lld", (long long)start);
  /* ascending rows >= start: row i moves down to start + i <= rows[i], never over a row still to move */
  int64_t lr = m->n_pages * m->page_rows;
  for (int64_t l = 0; l < m->d.n_layers; l++)
    for (int64_t i = 0; i < n; i++)
      if (rows[i] != start + i)
        memcpy(m->arena + kd_page_row(pages, m->page_rows, lr, m->E, l, start + i),
               m->arena + kd_page_row(pages, m->page_rows, lr, m->E, l, rows[i]), sizeof(float) * (size_t)m->E);
  return KD_OK;
}

int kd_cache_gather(kd_model *m, const int32_t *pages, int64_t n_table, int64_t start, int64_t n, float *out) {
  kd_clear_error();
  KD_CHECK_PTR("kd_cache_gather", m);
  if (n && !out) return kd_fail(KD_EINVAL, "kd_cache_gather: out is NULL");
  KD_TRY(kd_table_check("kd_cache_gather", pages, n_table, start, n, m->n_pages, m->page_rows));
  int64_t lr = m->n_pages * m->page_rows;
  for (int64_t l = 0; l < m->d.n_layers; l++)
    for (int64_t i = 0; i < n; i++)
      memcpy(out + (l * n + i) * m->E, m->arena + kd_page_row(pages, m->page_rows, lr, m->E, l, start + i),
             sizeof(float) * (size_t)m->E);
  return KD_OK;
}

/* no CUDA graphs on the CPU: the bucket set is accepted and ignored, the counts are zeros */
int kd_model_set_graph_rows(kd_model *m, const int64_t *rows, int64_t n) {
  (void)rows;
  KD_CHECK_PTR("kd_model_set_graph_rows", m);
  if (n < 0) return kd_fail(KD_EINVAL, "kd_model_set_graph_rows: n=%lld must be >= 0", (long long)n);
  return KD_OK;
}

/* NCCL on the stream is the CUDA build's: the CPU build's tensor parallel is desc.all_reduce */
int kd_nccl_unique_id(const char *nccl_lib, uint8_t *id128) {
  (void)nccl_lib, (void)id128;
  return kd_fail(KD_EINVAL, "kd_nccl_unique_id: NCCL is the CUDA build's; the CPU build reduces through all_reduce");
}
int kd_model_set_nccl(kd_model *m, const char *nccl_lib, const uint8_t *id128, int64_t nranks, int64_t rank) {
  (void)m, (void)nccl_lib, (void)id128, (void)nranks, (void)rank;
  return kd_fail(KD_EINVAL, "kd_model_set_nccl: NCCL is the CUDA build's; the CPU build reduces through all_reduce");
}

int kd_model_moe_stats(kd_model *m, int64_t *stats, int reset) {
  KD_CHECK_PTR("kd_model_moe_stats", m);
  KD_CHECK_PTR("kd_model_moe_stats", stats);
  memcpy(stats, m->moe_stats, sizeof(int64_t) * (size_t)(m->d.n_layers * 3));
  if (reset) memset(m->moe_stats, 0, sizeof(int64_t) * (size_t)(m->d.n_layers * 3));
  return KD_OK;
}

int kd_model_graph_stats(kd_model *m, int64_t *stats, double *capture_seconds) {
  KD_CHECK_PTR("kd_model_graph_stats", m);
  KD_CHECK_PTR("kd_model_graph_stats", stats);
  for (int i = 0; i < 4; i++) stats[i] = 0;
  if (capture_seconds) *capture_seconds = 0.0;
  return KD_OK;
}

/* x [T, R] rotated in place by interleaved pairs: (x0 c - x1 s, x1 c + x0 s), as k2.rope_apply (x*C + swap(x)*S) */
static void kd_rope_interleaved(float *x, const float *cs, int64_t half) {
  const float *c = cs, *s = cs + half;
  for (int64_t i = 0; i < half; i++) {
    float x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * c[i] + x1 * -s[i];
    x[2 * i + 1] = x1 * c[i] + x0 * s[i];
  }
}

/* scores (sigmoid), bias -> experts/weights of one token (k2.route_rows, noaux_tc, group-limited if n_group > 1) */
static void kd_route(const kd_model_desc *d, const float *s, const float *bias, float *choice, float *gscore,
                     unsigned char *taken, int32_t *ex, float *ew) {
  int64_t E = d->n_experts, G = d->n_group, per = E / G, k = d->top_k;
  for (int64_t e = 0; e < E; e++) choice[e] = s[e] + bias[e];
  if (G > 1) {
    int64_t top = per < 2 ? per : 2;
    for (int64_t g = 0; g < G; g++) { /* sum of the group's best two (sorted descending, summed as numpy) */
      memset(taken, 0, (size_t)per);
      float r = 0.0f;
      for (int64_t j = 0; j < top; j++) r += choice[g * per + kd_pick_max(choice + g * per, taken, per)];
      gscore[g] = r;
    }
    memset(taken, 0, (size_t)G);
    for (int64_t j = 0; j < d->topk_group; j++) kd_pick_max(gscore, taken, G);
    for (int64_t g = 0; g < G; g++)
      if (!taken[g])
        for (int64_t j = 0; j < per; j++) choice[g * per + j] = 0.0f; /* HF masks with 0.0 */
  }
  memset(taken, 0, (size_t)E);
  for (int64_t j = 0; j < k; j++) {
    ex[j] = (int32_t)kd_pick_max(choice, taken, E);
    ew[j] = s[ex[j]];
  }
  if (d->norm_topk_prob) {
    float den = kd_np_sum(ew, k) + 1e-20f;
    for (int64_t j = 0; j < k; j++) ew[j] = ew[j] / den;
  }
  for (int64_t j = 0; j < k; j++) ew[j] = ew[j] * d->routed_scale;
}

/* gate/up/silu/down of n rows x -> y (scratch g, u of n x I) */
static int kd_mlp_rows(const kd_mlp *p, const float *x, float *y, int64_t n, float *g, float *u) {
  if (n == 0) return KD_OK;
  int64_t I = p->gate.n_out;
  KD_TRY(kd_lin(&p->gate, x, g, n));
  KD_TRY(kd_lin(&p->up, x, u, n));
  KD_TRY(kd_silu_mul(g, u, g, n, I, NULL));
  return kd_lin(&p->down, g, y, n);
}

/* MoE work unit i (scratch g, u): with a shared expert, unit 0 is it (every row: the largest piece, first), then
 * the routed experts over their gathered rows xs[cnt[e]..cnt[e+1]) -> ys */
static int kd_moe_unit(const kd_layer *ly, int64_t i, const float *x, float *sh, int64_t N, const float *xs, float *ys,
                       const int64_t *cnt, int64_t D, float *g, float *u) {
  int64_t e = ly->has_shared ? i - 1 : i;
  if (e < 0) return kd_mlp_rows(&ly->shared, x, sh, N, g, u);
  return kd_mlp_rows(&ly->experts[e], xs + cnt[e] * D, ys + cnt[e] * D, cnt[e + 1] - cnt[e], g, u);
}

/* ---- lossless expert pruning (kd_forward_args.row_value) --------------------------------------------------------
 * A forward's draft rows, each worth the tokens its subtree is expected to commit, may each bring experts into a MoE
 * layer that no other row needs: the layer then streams those experts for that row alone (MoE-Spec's and EVICT's
 * tax). Pruning a row whose new experts cost more than it is worth leaves its descendants nothing to see, so they go
 * too; the rows that stay compute exactly what they would have (every kernel is row-wise), and a pruned draft is
 * only a draft the accept walk does not follow. */
typedef struct {
  const kd_forward_args *a;
  int64_t *order;       /* [N] rows by descending value, then ascending row (an ancestor before its subtree) */
  int64_t *seq;         /* [N] row -> its sequence */
  uint8_t *dead;        /* [N] */
  unsigned char *chosen;/* [E] experts of this layer's weight stream so far */
} kd_prune;

static int kd_prune_begin(kd_model *m, const kd_forward_args *a, kd_prune *p) {
  int64_t N = a->n_rows, E = m->d.n_experts;
  memset(p, 0, sizeof *p);
  if (!a->row_value) return KD_OK;
  p->a = a;
  char *b = (char *)kd_reserve(&m->prune, (size_t)(2 * N) * sizeof(int64_t) + (size_t)N + (size_t)E);
  if (!b) return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (pruning, %lld rows)", (long long)N);
  p->order = (int64_t *)b, p->seq = p->order + N, p->dead = (uint8_t *)(p->seq + N), p->chosen = p->dead + N;
  memset(p->dead, 0, (size_t)N);
  for (int64_t s = 0; s < a->n_seqs; s++)
    for (int64_t r = a->row_start[s]; r < a->row_start[s + 1]; r++) p->seq[r] = s;
  for (int64_t i = 0; i < N; i++) { /* insertion sort: pruned forwards are tree verifies of tens of rows */
    int64_t j = i;
    float v = a->row_value[i];
    for (; j > 0 && a->row_value[p->order[j - 1]] < v; j--) p->order[j] = p->order[j - 1];
    p->order[j] = i;
  }
  return KD_OK;
}

/* row r and every row of its sequence that sees it (its subtree) */
static void kd_prune_subtree(kd_prune *p, int64_t r) {
  const kd_forward_args *a = p->a;
  int64_t s = p->seq[r], r0 = a->row_start[s], T = a->row_start[s + 1] - r0, words = (T + 63) / 64, vo = 0;
  for (int64_t q = 0; q < s && a->visibility; q++) {
    int64_t Tq = a->row_start[q + 1] - a->row_start[q];
    vo += Tq * ((Tq + 63) / 64);
  }
  for (int64_t q = r; q < r0 + T; q++)
    if (q == r || (a->visibility ? kd_visible(a->visibility + vo + (q - r0) * words, r - r0) : 1)) p->dead[q] = 1;
}

/* this MoE layer's choice: rows in value order keep their experts while each new expert is worth its bytes */
static void kd_prune_layer(kd_prune *p, const int32_t *ex, int64_t k, int64_t E) {
  const kd_forward_args *a = p->a;
  memset(p->chosen, 0, (size_t)E);
  for (int64_t i = 0; i < a->n_rows; i++) {
    int64_t r = p->order[i], fresh = 0;
    if (p->dead[r]) continue;
    for (int64_t j = 0; j < k; j++) fresh += !p->chosen[ex[r * k + j]]; /* a row's top-k experts are distinct */
    if (fresh && !(a->row_value[r] >= (float)fresh * a->expert_cost)) {
      kd_prune_subtree(p, r);
      continue;
    }
    for (int64_t j = 0; j < k; j++) p->chosen[ex[r * k + j]] = 1;
  }
}

/* MoE of N rows (k2.K2Model._moe): router, routing, experts grouped by expert (slot order kept), then per token
 * out = (((0 + w_0 y_0) + w_1 y_1) + ...) + shared(x) */
static int kd_moe_rows(kd_model *m, const kd_layer *ly, const float *x, float *out, int64_t N, kd_prune *pr) {
  const kd_model_desc *d = &m->d;
  int64_t D = d->hidden, E = d->n_experts, k = d->top_k, S = N * k, I = m->inter;
  float *rl = (float *)kd_reserve(&m->rl, sizeof(float) * (size_t)(N * E + E + d->n_group));
  int32_t *ex = (int32_t *)kd_reserve(&m->ex, sizeof(int32_t) * (size_t)S);
  float *ew = (float *)kd_reserve(&m->ew, sizeof(float) * (size_t)S);
  int64_t *cnt = (int64_t *)kd_reserve(&m->cnt, sizeof(int64_t) * (size_t)(E + 1));
  int64_t *pos = (int64_t *)kd_reserve(&m->pos, sizeof(int64_t) * (size_t)S);
  float *xs = (float *)kd_reserve(&m->xs, sizeof(float) * (size_t)(S * D));
  float *ys = (float *)kd_reserve(&m->ys, sizeof(float) * (size_t)(S * D));
  int64_t rows = S > N ? S : N;
  float *g = (float *)kd_reserve(&m->g, sizeof(float) * (size_t)(rows * I));
  float *u = (float *)kd_reserve(&m->u, sizeof(float) * (size_t)(rows * I));
  float *sh = (float *)kd_reserve(&m->sh, sizeof(float) * (size_t)(N * D));
  unsigned char *taken = (unsigned char *)kd_reserve(&m->taken, (size_t)(E > d->n_group ? E : d->n_group));
  if (!rl || !ex || !ew || !cnt || !pos || !xs || !ys || !g || !u || !sh || !taken)
    return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (MoE scratch, %lld rows)", (long long)N);
  float *choice = rl + N * E, *gscore = choice + E;
  KD_TRY(ly->router ? kd_linear_f32(x, ly->router, rl, N, D, E, NULL)
                    : kd_linear_bf16(x, ly->router_bf16, rl, N, D, E, NULL));
  for (int64_t i = 0; i < N * E; i++) rl[i] = kd_sigmoid_cpu(rl[i]);
  for (int64_t t = 0; t < N; t++)
    kd_route(d, rl + t * E, ly->router_bias, choice, gscore, taken, ex + t * k, ew + t * k);
  const uint8_t *dead = NULL;
  if (pr && pr->a) {
    kd_prune_layer(pr, ex, k, E);
    dead = pr->dead;
  }
  memset(cnt, 0, sizeof(int64_t) * (size_t)(E + 1));
  for (int64_t i = 0; i < S; i++) cnt[ex[i] + 1] += !(dead && dead[i / k]);
  for (int64_t e = 0; e < E; e++) cnt[e + 1] += cnt[e];
  for (int64_t i = 0; i < S; i++) {
    if (dead && dead[i / k]) { /* a pruned row takes no expert (its row of out is zeroed below) */
      pos[i] = 0, ew[i] = 0.0f;
      continue;
    }
    int64_t p = cnt[ex[i]]++;
    pos[i] = p;
    memcpy(xs + p * D, x + (i / k) * D, sizeof(float) * (size_t)D);
  }
  for (int64_t e = E; e > 0; e--) cnt[e] = cnt[e - 1];
  cnt[0] = 0;
  /* the experts (and the shared expert) are independent MLPs over their own rows: a multi-row call runs them on
   * the threads, each with its own g/u scratch (an MLP's linears then stay on its thread: same bits) */
  int64_t units = E + (ly->has_shared ? 1 : 0), busy = 0;
  for (int64_t e = 0; e < E; e++) busy += cnt[e + 1] > cnt[e];
  int64_t *st = m->moe_stats + (ly - m->layers) * 3; /* the union of this forward's experts: bytes it streams */
  st[0] += 1, st[1] += busy, st[2] += N;
  if (ly->has_shared) busy++;
  /* K2-sized experts (each linear >= KD_PARALLEL_MIN_WEIGHTS) run one after another, each linear split over every
   * thread: an AR step's three experts would leave a thread idle for a third of the layer, and a verify's shared
   * expert (all rows) is several routed ones' work. Small experts run side by side, one per thread. */
  if (I * D < KD_PARALLEL_MIN_WEIGHTS && kd_par_worth((S + (ly->has_shared ? N : 0)) * 3 * D * I, busy)) {
    int nt = kd_threads();
    float *tg = (float *)kd_reserve(&m->tg, sizeof(float) * (size_t)(nt * 2 * rows * I));
    if (!tg) return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (MoE thread scratch, %lld rows)", (long long)N);
    int rc = KD_OK;
    char msg[256] = "";
#pragma omp parallel num_threads(nt)
    {
      float *tgi = tg + (size_t)omp_get_thread_num() * (size_t)(2 * rows * I), *tui = tgi + rows * I;
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < units; i++) {
        int r = kd_moe_unit(ly, i, x, sh, N, xs, ys, cnt, D, tgi, tui);
        if (r)
#pragma omp critical(kd_moe_fail)
          if (rc == KD_OK) rc = r, snprintf(msg, sizeof msg, "%s", kd_last_error()); /* the thread's own message */
      }
    }
    if (rc) return kd_fail(rc, "%s", msg);
  } else {
    for (int64_t i = 0; i < units; i++) KD_TRY(kd_moe_unit(ly, i, x, sh, N, xs, ys, cnt, D, g, u));
  }
  kd_moe_combine(out, ys, pos, ew, ly->has_shared ? sh : NULL, N, k, D);
  for (int64_t t = 0; dead && t < N; t++)
    if (dead[t]) memset(out + t * D, 0, sizeof(float) * (size_t)D);
  return KD_OK;
}

/* row r of kd_attention_rows (voff: per row its sequence and visibility offset; keys: S int64 then S * H floats) */
static void kd_attention_row(kd_model *m, const kd_forward_args *a, int64_t li, int64_t H, const float *qf,
                             float *olat, const int64_t *voff, int64_t *keys, int64_t S, int64_t r) {
  const kd_model_desc *d = &m->d;
  int64_t L = d->kv_lora, E = m->E, s = voff[2 * r], r0 = a->row_start[s], T = a->row_start[s + 1] - r0;
  kd_mla_attention_rows(qf + r0 * H * E, m->arena + li * m->n_pages * m->page_rows * E, a->pages + a->page_start[s],
                        m->page_rows, a->visibility ? a->visibility + voff[2 * r + 1] : NULL, olat + r0 * H * L,
                        r - r0, r - r0 + 1, T, H, L, d->rope_dim, a->lengths[s], d->attn_scale, keys,
                        (float *)(keys + S));
}

/* Layer li's absorbed MLA attention of every row, each sequence over its own cache (block-diagonal visibility):
 * one work item per query row; a multi-row call splits them over the threads (a row is one computation: same bits) */
static int kd_attention_rows(kd_model *m, const kd_forward_args *a, int64_t li, int64_t H, const float *qf,
                             float *olat) {
  const kd_model_desc *d = &m->d;
  int64_t N = a->n_rows, L = d->kv_lora, E = m->E, S = 0, macs = 0;
  int64_t *voff = (int64_t *)kd_reserve(&m->work, sizeof(int64_t) * (size_t)(2 * N)); /* per row: seq, vis offset */
  if (!voff) return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (attention, %lld rows)", (long long)N);
  for (int64_t s = 0, vo = 0; s < a->n_seqs; s++) {
    int64_t r0 = a->row_start[s], T = a->row_start[s + 1] - r0, n = a->lengths[s] + T;
    for (int64_t r = r0; r < r0 + T; r++) voff[2 * r] = s, voff[2 * r + 1] = vo;
    if (a->visibility) vo += T * ((T + 63) / 64);
    if (n > S) S = n;
    macs += T * H * n * (E + L);
  }
  int par = kd_par_worth(macs, N);
  int nt = par ? kd_threads() : 1;
  size_t per = ((size_t)S * sizeof(int64_t) + (size_t)(S * H) * sizeof(float) + 63) / 64 * 64; /* keys + p */
  char *scr = (char *)kd_reserve(&m->attn, per * (size_t)nt);
  if (!scr) return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (attention scratch, %lld keys)", (long long)S);
  if (par) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t r = 0; r < N; r++)
      kd_attention_row(m, a, li, H, qf, olat, voff, (int64_t *)(scr + per * (size_t)omp_get_thread_num()), S, r);
  } else {
    for (int64_t r = 0; r < N; r++) kd_attention_row(m, a, li, H, qf, olat, voff, (int64_t *)scr, S, r);
  }
  return KD_OK;
}

static int kd_reduce(kd_model *m, float *x, int64_t n) {
  if (!m->d.all_reduce) return KD_OK;
  if (m->d.all_reduce(x, n, m->d.all_reduce_ctx))
    return kd_fail(KD_EINVAL, "kd_model_forward: the tensor-parallel all-reduce failed (see the rank's log)");
  return KD_OK;
}

int kd_model_forward(kd_model *m, const kd_forward_args *a) {
  kd_clear_error();
  KD_CHECK_PTR("kd_model_forward", m);
  KD_CHECK_PTR("kd_model_forward", a);
  KD_TRY(kd_forward_args_check(a, m->d.vocab, m->d.n_layers, m->n_pages, m->page_rows));
  const kd_model_desc *d = &m->d;
  int64_t N = a->n_rows, D = d->hidden, L = d->kv_lora, R = d->rope_dim, E = m->E, nope = d->nope;
  int64_t half = R / 2, Hmax = 0;
  for (int64_t i = 0; i < d->n_layers; i++)
    if (m->layers[i].heads > Hmax) Hmax = m->layers[i].heads;
  float *h = (float *)kd_reserve(&m->h, sizeof(float) * (size_t)(N * D));
  float *x = (float *)kd_reserve(&m->x, sizeof(float) * (size_t)(N * D));
  float *t = (float *)kd_reserve(&m->t, sizeof(float) * (size_t)(N * D));
  float *qa = (float *)kd_reserve(&m->qa, sizeof(float) * (size_t)(N * m->q_lora));
  float *q = (float *)kd_reserve(&m->q, sizeof(float) * (size_t)(N * Hmax * (nope + R)));
  float *kva = (float *)kd_reserve(&m->kva, sizeof(float) * (size_t)(N * E));
  float *qf = (float *)kd_reserve(&m->qf, sizeof(float) * (size_t)(N * Hmax * E));
  float *olat = (float *)kd_reserve(&m->olat, sizeof(float) * (size_t)(N * Hmax * L));
  float *o = (float *)kd_reserve(&m->o, sizeof(float) * (size_t)(N * Hmax * d->v_head));
  float *cs = (float *)kd_reserve(&m->cs, sizeof(float) * (size_t)(N * R)); /* per row: cos[R/2], sin[R/2] */
  if (!h || !x || !t || !qa || !q || !kva || !qf || !olat || !o || !cs)
    return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (%lld rows)", (long long)N);
  kd_prune prune;
  KD_TRY(kd_prune_begin(m, a, &prune));

  /* YaRN cos/sin of each row's position (float64, rounded once: rope.RotaryTable), shared by the layers */
  for (int64_t r = 0; r < N; r++)
    for (int64_t i = 0; i < half; i++) {
      double ang = (double)a->positions[r] * m->inv_freq[i];
      cs[r * R + i] = (float)(cos(ang) * d->rope_mscale);
      cs[r * R + half + i] = (float)(sin(ang) * d->rope_mscale);
    }
  for (int64_t r = 0; r < N; r++) kd_embed_row(d->embed, d->embed_bf16, a->tokens[r], D, h + r * D);

  for (int64_t li = 0; li < d->n_layers; li++) {
    const kd_layer *ly = &m->layers[li];
    int64_t H = ly->heads, qw = nope + R;
    /* attention: h = h + o_proj(absorbed MLA(norm(h))) */
    KD_TRY(kd_rms_norm(h, ly->in_norm, x, N, D, d->eps, NULL));
    KD_TRY(kd_lin(&ly->q_a, x, qa, N));
    KD_TRY(kd_rms_norm(qa, ly->q_a_norm, qa, N, ly->q_a.n_out, d->eps, NULL));
    KD_TRY(kd_lin(&ly->q_b, qa, q, N));                                  /* q: [N, H, nope+R] */
    KD_TRY(kd_lin(&ly->kv_a, x, kva, N));                                /* kv_a: [N, L+R] */
    for (int64_t s = 0; s < a->n_seqs; s++) { /* new latent rows [norm(c), rope(k_pe)] after the cache's rows */
      const int32_t *pages = a->pages + a->page_start[s];
      for (int64_t r = a->row_start[s], j = a->lengths[s]; r < a->row_start[s + 1]; r++, j++) {
        float *kv = m->arena + kd_page_row(pages, m->page_rows, m->n_pages * m->page_rows, E, li, j); /* its row j */
        KD_TRY(kd_rms_norm(kva + r * E, ly->kv_a_norm, kv, 1, L, d->eps, NULL));
        memcpy(kv + L, kva + r * E + L, sizeof(float) * (size_t)R);
        kd_rope_interleaved(kv + L, cs + r * R, half);
      }
    }
    for (int64_t r = 0; r < N; r++) /* q_full[:, :, L:] = rope(q_pe) */
      for (int64_t hh = 0; hh < H; hh++) {
        float *dst = qf + (r * H + hh) * E + L;
        memcpy(dst, q + (r * H + hh) * qw + nope, sizeof(float) * (size_t)R);
        kd_rope_interleaved(dst, cs + r * R, half);
      }
    /* q_full[:, :, :L] = W_uk[h]^T q_nope[h] */
    KD_TRY(ly->w_uk_t ? kd_head_linear_f32(q, H * qw, qw, ly->w_uk_t, qf, H * E, E, N, H, nope, L, NULL)
                      : kd_head_linear_bf16(q, H * qw, qw, ly->w_uk_t_bf16, qf, H * E, E, N, H, nope, L, NULL));
    KD_TRY(kd_attention_rows(m, a, li, H, qf, olat));
    KD_TRY(ly->w_uv ? kd_head_linear_f32(olat, H * L, L, ly->w_uv, o, H * d->v_head, d->v_head, N, H, L, d->v_head,
                                         NULL)
                    : kd_head_linear_bf16(olat, H * L, L, ly->w_uv_bf16, o, H * d->v_head, d->v_head, N, H, L,
                                          d->v_head, NULL));
    KD_TRY(kd_lin(&ly->o, o, t, N));
    KD_TRY(kd_reduce(m, t, N * D));
    for (int64_t i = 0; i < N * D; i++) h[i] = h[i] + t[i];
    /* MLP / MoE: h = h + mlp(norm(h)) */
    KD_TRY(kd_rms_norm(h, ly->post_norm, x, N, D, d->eps, NULL));
    if (ly->is_moe) {
      KD_TRY(kd_moe_rows(m, ly, x, t, N, &prune));
    } else {
      int64_t I = ly->mlp.gate.n_out;
      float *g = (float *)kd_reserve(&m->g, sizeof(float) * (size_t)(N * I));
      float *u = (float *)kd_reserve(&m->u, sizeof(float) * (size_t)(N * I));
      if (!g || !u) return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (MLP, %lld rows)", (long long)N);
      KD_TRY(kd_mlp_rows(&ly->mlp, x, t, N, g, u));
    }
    KD_TRY(kd_reduce(m, t, N * D));
    for (int64_t i = 0; i < N * D; i++) h[i] = h[i] + t[i];
    for (int64_t j = 0; j < a->n_hidden; j++)
      if (a->hidden_layers[j] == li)
        for (int64_t r = 0; r < N; r++)
          memcpy(a->hidden + (r * a->n_hidden + j) * D, h + r * D, sizeof(float) * (size_t)D);
  }

  if (prune.a) memcpy(a->row_pruned, prune.dead, (size_t)N);

  /* final norm + lm_head of the asked rows only (row-wise: the same bits as over all rows) */
  int64_t n_out = a->n_out, V = d->vocab;
  if (n_out == 0 || (!a->logits && !a->argmax)) return KD_OK;
  float *fo = (float *)kd_reserve(&m->fo, sizeof(float) * (size_t)(n_out * D));
  float *lg = a->logits ? a->logits : (float *)kd_reserve(&m->lg, sizeof(float) * (size_t)(n_out * V));
  if (!fo || !lg) return kd_fail(KD_ENOMEM, "kd_model_forward: out of memory (%lld logits rows)", (long long)n_out);
  for (int64_t i = 0; i < n_out; i++) {
    int64_t r = a->out_rows ? a->out_rows[i] : i;
    memcpy(x + i * D, h + r * D, sizeof(float) * (size_t)D); /* x is free now and holds N >= n_out rows */
  }
  KD_TRY(kd_rms_norm(x, d->final_norm, fo, n_out, D, d->eps, NULL));
  KD_TRY(kd_lin(&d->lm_head, fo, lg, n_out));
  if (a->argmax)
    for (int64_t i = 0; i < n_out; i++) {
      const float *row = lg + i * V;
      int64_t best = 0;
      for (int64_t v = 1; v < V; v++)
        if (row[v] > row[best]) best = v;
      a->argmax[i] = (int32_t)best;
    }
  return KD_OK;
}

/* ---- the DFlash drafter ---------------------------------------------------------------------------------- */
struct kd_drafter {
  kd_drafter_desc d;
  kd_drafter_layer *layers;
  float *k, *v;         /* kd_drafter_pages: [n_layers][n_pages * page_rows][Hkv*hd] each, the target's page ids */
  int64_t n_pages, page_rows, kvw; /* kvw = Hkv * hd */
  kd_buf ctx, x, hbuf, q, kb, vb, o, t, g, u, p, cs, fo;
};

int kd_drafter_destroy(kd_drafter *dr) {
  if (!dr) return KD_OK;
  free(dr->layers);
  free(dr->k), free(dr->v);
  kd_buf *bufs[] = {&dr->ctx, &dr->x, &dr->hbuf, &dr->q, &dr->kb, &dr->vb, &dr->o, &dr->t, &dr->g, &dr->u, &dr->p,
                    &dr->cs, &dr->fo};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]->p);
  free(dr);
  return KD_OK;
}

int kd_drafter_create(const kd_drafter_desc *desc, kd_drafter **out) {
  kd_clear_error();
  KD_CHECK_PTR("kd_drafter_create", desc);
  KD_CHECK_PTR("kd_drafter_create", out);
  *out = NULL;
  const kd_drafter_desc *d = desc;
  int rc = kd_drafter_desc_check(d);
  if (rc) return rc;
  kd_drafter *dr = (kd_drafter *)calloc(1, sizeof(kd_drafter));
  if (!dr || !(dr->layers = (kd_drafter_layer *)malloc(sizeof(kd_drafter_layer) * (size_t)d->n_layers))) {
    free(dr);
    return kd_fail(KD_ENOMEM, "kd_drafter_create: out of memory");
  }
  dr->d = *d;
  memcpy(dr->layers, d->layers, sizeof(kd_drafter_layer) * (size_t)d->n_layers);
  dr->d.layers = dr->layers;
  dr->kvw = d->hkv * d->head_dim;
  *out = dr;
  return KD_OK;
}

int kd_drafter_pages(kd_drafter *dr, int64_t n_pages, int64_t page_rows) {
  kd_clear_error();
  KD_CHECK_PTR("kd_drafter_pages", dr);
  int64_t np = dr->n_pages, pr = dr->page_rows, nl = dr->d.n_layers;
  KD_TRY(kd_arena_resize(&dr->k, &np, &pr, n_pages, page_rows, nl, dr->kvw, "kd_drafter_pages"));
  np = dr->n_pages, pr = dr->page_rows;
  int rc = kd_arena_resize(&dr->v, &np, &pr, n_pages, page_rows, nl, dr->kvw, "kd_drafter_pages");
  if (rc) { /* K resized, V not: drop both (no sequence may use a half-sized arena) */
    free(dr->k), dr->k = NULL, dr->n_pages = 0;
    return rc;
  }
  dr->n_pages = np, dr->page_rows = pr;
  return KD_OK;
}

/* K or V row j of layer li of the sequence whose page table is pages (its drafter context) */
static inline float *kd_dctx_row(const kd_drafter *dr, float *base, const int32_t *pages, int64_t li, int64_t j) {
  return base + kd_page_row(pages, dr->page_rows, dr->n_pages * dr->page_rows, dr->kvw, li, j);
}

/* x [T, H, hd] rotated in place: x*cos + rotate_half(x)*sin (drafter.apply_rope_half) */
static void kd_rope_half(float *x, const float *cs, int64_t T, int64_t H, int64_t hd) {
  int64_t half = hd / 2;
  for (int64_t r = 0; r < T; r++)
    for (int64_t hh = 0; hh < H; hh++) {
      float *v = x + (r * H + hh) * hd;
      const float *c = cs + r * hd, *s = c + half;
      for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] + -b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
}

/* k, v of T rows h [T, D] at positions start.. into kd, vd [T, Hkv*hd] (drafter._kv) */
static int kd_drafter_kv(kd_drafter *dr, const kd_drafter_layer *ly, const float *h, float *kd, float *vd, int64_t T,
                         const float *cs) {
  const kd_drafter_desc *d = &dr->d;
  KD_TRY(kd_lin(&ly->k, h, kd, T));
  KD_TRY(kd_lin(&ly->v, h, vd, T));
  KD_TRY(kd_rms_norm(kd, ly->k_norm, kd, T * d->hkv, d->head_dim, d->eps, NULL));
  kd_rope_half(kd, cs, T, d->hkv, d->head_dim);
  return KD_OK;
}

int kd_drafter_extend(kd_drafter *dr, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                      const int64_t *lengths, const int64_t *row_start, const float *feats) {
  kd_clear_error();
  KD_CHECK_PTR("kd_drafter_extend", dr);
  if (n_seqs <= 0 || !row_start || row_start[0] != 0)
    return kd_fail(KD_EINVAL, "kd_drafter_extend: n_seqs=%lld with row_start from 0 required", (long long)n_seqs);
  KD_TRY(kd_page_tables_check("kd_drafter_extend", n_seqs, pages, page_start, lengths, row_start, dr->n_pages,
                              dr->page_rows));
  const kd_drafter_desc *d = &dr->d;
  int64_t N = row_start[n_seqs], D = d->hidden, W = dr->kvw;
  if (N == 0) return KD_OK;
  KD_CHECK_PTR("kd_drafter_extend", feats);
  float *ctx = (float *)kd_reserve(&dr->ctx, sizeof(float) * (size_t)(N * D));
  float *cs = (float *)kd_reserve(&dr->cs, sizeof(float) * (size_t)(N * d->head_dim));
  float *kb = (float *)kd_reserve(&dr->kb, sizeof(float) * (size_t)(N * W));
  float *vb = (float *)kd_reserve(&dr->vb, sizeof(float) * (size_t)(N * W));
  if (!ctx || !cs || !kb || !vb) return kd_fail(KD_ENOMEM, "kd_drafter_extend: out of memory (%lld rows)", (long long)N);
  KD_TRY(kd_lin(&d->fc, feats, ctx, N));                               /* ctx = hidden_norm(fc(feats)) */
  KD_TRY(kd_rms_norm(ctx, d->hidden_norm, ctx, N, D, d->eps, NULL));
  for (int64_t s = 0; s < n_seqs; s++)
    kd_rope_half_table(cs + row_start[s] * d->head_dim, lengths[s], row_start[s + 1] - row_start[s], d->head_dim,
                       d->rope_theta);
  for (int64_t li = 0; li < d->n_layers; li++) {
    KD_TRY(kd_drafter_kv(dr, &dr->layers[li], ctx, kb, vb, N, cs));
    for (int64_t s = 0; s < n_seqs; s++) { /* context row lengths[s] + i of sequence s, through its page table */
      const int32_t *pt = pages + page_start[s];
      for (int64_t r = row_start[s], j = lengths[s]; r < row_start[s + 1]; r++, j++) {
        memcpy(kd_dctx_row(dr, dr->k, pt, li, j), kb + r * W, sizeof(float) * (size_t)W);
        memcpy(kd_dctx_row(dr, dr->v, pt, li, j), vb + r * W, sizeof(float) * (size_t)W);
      }
    }
  }
  return KD_OK;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KD_FWD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KD_FWD_CLONES
#endif

/* drafter attention score: 8 lane-wise partial sums (vectorised without reordering any lane), fixed combine */
KD_FWD_CLONES static float kd_fdot(const float *a, const float *b, int64_t n) {
  float acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
  float r = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) r += a[i] * b[i];
  return r;
}

/* query t, head hh of the drafter's non-causal GQA over n cached (layer li, through the page table pt) + B block
 * keys/values (p: S scratch floats) */
static void kd_drafter_attention_head(const kd_drafter *dr, const float *q, const int32_t *pt, int64_t li,
                                      const float *kb, const float *vb, int64_t n, float *o, float *p, int64_t t,
                                      int64_t hh) {
  const kd_drafter_desc *d = &dr->d;
  int64_t B = d->block_size, hd = d->head_dim, W = d->hkv * hd, group = d->hq / d->hkv, S = n + B;
  float scale = (float)(1.0 / sqrt((double)hd));
  const float *qr = q + (t * d->hq + hh) * hd;
  int64_t kvh = hh / group;
  float m = -INFINITY, sum = 0.0f;
  for (int64_t j = 0; j < S; j++) {
    const float *kr = (j < n ? kd_dctx_row(dr, dr->k, pt, li, j) : kb + (j - n) * W) + kvh * hd;
    p[j] = kd_fdot(qr, kr, hd) * scale;
    if (p[j] > m) m = p[j];
  }
  for (int64_t j = 0; j < S; j++) p[j] = p[j] - m;
  kd_exp_inplace(p, S);
  for (int64_t j = 0; j < S; j++) sum += p[j];
  float *orow = o + (t * d->hq + hh) * hd;
  for (int64_t i = 0; i < hd; i++) orow[i] = 0.0f;
  for (int64_t j = 0; j < S; j++) {
    const float *vr = (j < n ? kd_dctx_row(dr, dr->v, pt, li, j) : vb + (j - n) * W) + kvh * hd;
    float w = p[j] / sum;
    for (int64_t i = 0; i < hd; i++) orow[i] += w * vr[i];
  }
}

/* non-causal GQA of B queries over n cached + B block keys/values: o [B, Hq*hd]. Each (query, head) is one
 * computation, so a long context splits them over the threads (p: nt x ps scratch floats) with the same bits. */
static void kd_drafter_attention(const kd_drafter *dr, const float *q, const int32_t *pt, int64_t li,
                                 const float *kb, const float *vb, int64_t n, float *o, float *p, int64_t ps,
                                 int nt) {
  const kd_drafter_desc *d = &dr->d;
  int64_t units = d->block_size * d->hq;
  if (nt > 1 && kd_par_worth(units * (n + d->block_size) * d->head_dim * 2, units)) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t u = 0; u < units; u++)
      kd_drafter_attention_head(dr, q, pt, li, kb, vb, n, o, p + (size_t)omp_get_thread_num() * (size_t)ps,
                                u / d->hq, u % d->hq);
    return;
  }
  for (int64_t u = 0; u < units; u++) kd_drafter_attention_head(dr, q, pt, li, kb, vb, n, o, p, u / d->hq, u % d->hq);
}

int kd_drafter_draft(kd_drafter *dr, int64_t n_seqs, const int32_t *pages, const int64_t *page_start,
                     const int64_t *lengths, const int32_t *bonus, float *logits) {
  kd_clear_error();
  KD_CHECK_PTR("kd_drafter_draft", dr);
  KD_CHECK_PTR("kd_drafter_draft", logits);
  if (n_seqs <= 0 || !bonus)
    return kd_fail(KD_EINVAL, "kd_drafter_draft: n_seqs=%lld with bonus required", (long long)n_seqs);
  KD_TRY(kd_page_tables_check("kd_drafter_draft", n_seqs, pages, page_start, lengths, NULL, dr->n_pages,
                              dr->page_rows));
  const kd_drafter_desc *d = &dr->d;
  int64_t B = d->block_size, D = d->hidden, hd = d->head_dim, W = dr->kvw, QW = d->hq * hd, maxn = 0;
  for (int64_t s = 0; s < n_seqs; s++) {
    if (bonus[s] < 0 || bonus[s] >= d->vocab)
      return kd_fail(KD_EINVAL, "kd_drafter_draft: bonus token %d outside the vocabulary of %lld", bonus[s],
                     (long long)d->vocab);
    if (lengths[s] > maxn) maxn = lengths[s];
  }
  int64_t I = 0;
  for (int64_t li = 0; li < d->n_layers; li++)
    if (dr->layers[li].mlp.gate.n_out > I) I = dr->layers[li].mlp.gate.n_out;
  float *x = (float *)kd_reserve(&dr->x, sizeof(float) * (size_t)(B * D));
  float *hb = (float *)kd_reserve(&dr->hbuf, sizeof(float) * (size_t)(B * D));
  float *q = (float *)kd_reserve(&dr->q, sizeof(float) * (size_t)(B * QW));
  float *kb = (float *)kd_reserve(&dr->kb, sizeof(float) * (size_t)(B * W));
  float *vb = (float *)kd_reserve(&dr->vb, sizeof(float) * (size_t)(B * W));
  float *o = (float *)kd_reserve(&dr->o, sizeof(float) * (size_t)(B * QW));
  float *t = (float *)kd_reserve(&dr->t, sizeof(float) * (size_t)(B * D));
  float *g = (float *)kd_reserve(&dr->g, sizeof(float) * (size_t)(B * I));
  float *u = (float *)kd_reserve(&dr->u, sizeof(float) * (size_t)(B * I));
  int nt = kd_threads();
  float *p = (float *)kd_reserve(&dr->p, sizeof(float) * (size_t)((maxn + B) * nt)); /* per thread: S scores */
  float *cs = (float *)kd_reserve(&dr->cs, sizeof(float) * (size_t)(B * hd));
  float *fo = (float *)kd_reserve(&dr->fo, sizeof(float) * (size_t)(B * D));
  if (!x || !hb || !q || !kb || !vb || !o || !t || !g || !u || !p || !cs || !fo)
    return kd_fail(KD_ENOMEM, "kd_drafter_draft: out of memory");
  for (int64_t s = 0; s < n_seqs; s++) {
    const int32_t *pt = pages + page_start[s];
    int64_t n = lengths[s];
    for (int64_t r = 0; r < B; r++) /* block = embed([bonus, MASK x (B-1)]) */
      kd_embed_row(d->embed, d->embed_bf16, r ? d->mask_token : bonus[s], D, x + r * D);
    kd_rope_half_table(cs, n, B, hd, d->rope_theta);
    for (int64_t li = 0; li < d->n_layers; li++) {
      const kd_drafter_layer *ly = &dr->layers[li];
      KD_TRY(kd_rms_norm(x, ly->in_norm, hb, B, D, d->eps, NULL));
      KD_TRY(kd_lin(&ly->q, hb, q, B));
      KD_TRY(kd_rms_norm(q, ly->q_norm, q, B * d->hq, hd, d->eps, NULL));
      kd_rope_half(q, cs, B, d->hq, hd);
      KD_TRY(kd_drafter_kv(dr, ly, hb, kb, vb, B, cs));
      kd_drafter_attention(dr, q, pt, li, kb, vb, n, o, p, maxn + B, nt);
      KD_TRY(kd_lin(&ly->o, o, t, B));
      for (int64_t i = 0; i < B * D; i++) x[i] = x[i] + t[i];
      KD_TRY(kd_rms_norm(x, ly->post_norm, hb, B, D, d->eps, NULL));
      KD_TRY(kd_mlp_rows(&ly->mlp, hb, t, B, g, u));
      for (int64_t i = 0; i < B * D; i++) x[i] = x[i] + t[i];
    }
    KD_TRY(kd_rms_norm(x + D, d->final_norm, fo, B - 1, D, d->eps, NULL));  /* rows 1..B-1 */
    KD_TRY(kd_lin(&d->lm_head, fo, logits + s * (B - 1) * d->vocab, B - 1));
  }
  return KD_OK;
}
