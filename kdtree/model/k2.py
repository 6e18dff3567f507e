"""The K2 target (DeepSeek-V3 architecture) over an Ops backend: MLA in absorbed form, sigmoid MoE, YaRN.

embed -> layers (h = x + attn(norm(x)); out = h + mlp(norm(h)); dense MLP before first_k_dense_replace,
MoE after) -> model.norm -> lm_head. Attention runs over a latent cache of kv_lora + rope floats per token
per layer (`LatentCache`: a page table into the model's ONE paged arena, kdtree/model/pages.py), so a verify block
(tree or chain) and an AR step share the same cache rows, and requests with a common prefix share its pages.
Every per-row computation is the same whatever the number of rows, so a tree node whose ancestors equal
the AR context gets bit-identical logits (see docs/engine-contracts.md, "Batch invariance").
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from kdtree.backends.base import Ops
from kdtree.model.derived import (check_context, check_seq, embed_weight, lm_head_weight, route_params,
                                  router_weights, softmax_scale, split_kv_b, transposed_w_uk, weight_getter)
from kdtree.model.names import is_moe_layer
from kdtree.model.pages import DEFAULT_PAGE_ROWS, PagedCache, PagePool, page_rows_of
from kdtree.model.rope import RotaryTable

NO_GRAPHS = {"graphs": 0, "replays": 0, "eager": 0, "buckets": 0, "capture_s": 0.0}   # graph_stats where none run


class LatentCache(PagedCache):
    """A sequence's latent rows [c, k_pe] (kv_lora + rope floats per token per layer) in pages of its K2Model's
    arena (kdtree/model/pages.py): length, max_len, truncate, keep, read_rows, kv. Made by K2Model.new_cache."""


class _Attn:
    """One layer's MLA weights, with kv_b_proj split per head once (W_uk, W_uv) for the absorbed form."""

    def __init__(self, w: Callable[[str], Any], cfg, layer: int):
        p = f"model.layers.{layer}.self_attn"
        self.q_a = w(f"{p}.q_a_proj.weight")
        self.q_a_norm = w(f"{p}.q_a_layernorm.weight")
        self.q_b = w(f"{p}.q_b_proj.weight")
        self.kv_a = w(f"{p}.kv_a_proj_with_mqa.weight")
        self.kv_a_norm = w(f"{p}.kv_a_layernorm.weight")
        self.o = w(f"{p}.o_proj.weight")
        self.heads, self.w_uk, self.w_uv = split_kv_b(cfg, w, layer)   # [H, nope, L], [H, v, L]
        self._w_uk_t: Optional[np.ndarray] = None

    @property
    def w_uk_t(self) -> np.ndarray:
        """W_uk as per-head linear weights [H, L, nope], built on first use (backends with Ops.head_linear)."""
        if self._w_uk_t is None:
            self._w_uk_t = transposed_w_uk(self.w_uk)
        return self._w_uk_t


class _Mlp:
    """gate/up/down of a dense MLP, a routed expert or the shared expert."""

    def __init__(self, w: Callable[[str], Any], p: str):
        self.gate = w(f"{p}.gate_proj.weight")
        self.up = w(f"{p}.up_proj.weight")
        self.down = w(f"{p}.down_proj.weight")


class _Moe:
    def __init__(self, w: Callable[[str], Any], cfg, layer: int):
        p = f"model.layers.{layer}.mlp"
        self.gate, self.bias = router_weights(w, layer)                                    # [E, D], [E]
        self.experts = [_Mlp(w, f"{p}.experts.{e}") for e in range(cfg.n_routed_experts)]
        self.shared = _Mlp(w, f"{p}.shared_experts") if cfg.n_shared_experts else None


def route_rows(cfg, scores: np.ndarray, bias: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Sigmoid noaux_tc routing of T tokens at once (each row independent of the others).

    scores f32[T, E] (sigmoid of the gate logits), bias f32[E] -> (experts i64[T, k] in descending choice
    order, weights f32[T, k]). Selection uses scores + bias (group-limited when n_group > 1; ties -> lower
    index); the weights are the unbiased scores of the selected experts, normalised, times
    routed_scaling_factor. Every step is a per-row op along the last axis (stable argsort, a sum of the
    row's k weights), so a row's result never depends on T.
    """
    scores = np.asarray(scores, np.float32)
    choice = scores + bias                                               # [T, E]
    k = cfg.num_experts_per_tok
    if cfg.n_group > 1:
        T, E = choice.shape
        groups = choice.reshape(T, cfg.n_group, -1)                      # [T, G, E/G]
        group_scores = -np.sort(-groups, axis=2, kind="stable")[:, :, :2].sum(axis=2)   # [T, G]
        top_groups = np.argsort(-group_scores, axis=1, kind="stable")[:, :cfg.topk_group]
        group_mask = np.zeros((T, cfg.n_group), bool)
        np.put_along_axis(group_mask, top_groups, True, axis=1)
        choice = np.where(np.repeat(group_mask, groups.shape[2], axis=1), choice, np.float32(0.0))  # HF: 0.0
    experts = np.argsort(-choice, axis=1, kind="stable")[:, :k]
    weights = scores[np.arange(scores.shape[0])[:, None], experts]
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=1, keepdims=True) + np.float32(1e-20))
    weights = (weights * np.float32(cfg.routed_scaling_factor)).astype(np.float32)
    return experts, weights


def route(cfg, scores: np.ndarray, bias: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Sigmoid noaux_tc routing of one token: scores f32[E] -> (experts i64[k], weights f32[k]) (route_rows)."""
    experts, weights = route_rows(cfg, np.asarray(scores, np.float32)[None, :], bias)
    return experts[0], weights[0]


def rope_tables(cos: np.ndarray, sin: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """cos, sin f32[T, R/2] -> (C, S) f32[T, R] with C = (c0, c0, c1, c1, ..), S = (-s0, s0, -s1, s1, ..)."""
    C = np.repeat(cos, 2, axis=1)
    S = np.empty_like(C)
    S[:, 0::2] = -sin
    S[:, 1::2] = sin
    return C, S


def rope_apply(x: np.ndarray, C: np.ndarray, S: np.ndarray) -> np.ndarray:
    """apply_rope (interleaved pairs) bit for bit, in four element-wise ops: x * C + swap_pairs(x) * S
    (x1 * -s == -(x1 * s) and a + -b == a - b exactly). x f32[T, ..., R], tables from rope_tables."""
    shape = (C.shape[0],) + (1,) * (x.ndim - 2) + (C.shape[1],)
    R = x.shape[-1]
    swapped = x.reshape(x.shape[:-1] + (R // 2, 2))[..., ::-1].reshape(x.shape)
    return x * C.reshape(shape) + swapped * S.reshape(shape)


class K2Model:
    """K2 target over an Ops backend, every op one `ops` call (the spec; backend=numpy, and the per-op path of the
    native library). weights: tensor name -> f32 ndarray or a quantized weight (Int4Weight) for Linear weights.
    Its peers behind the same Target protocol (kdtree/model/target.py): NativeTarget (the whole forward in one
    library call) and TPModel (tensor parallel); build_target picks one."""

    def __init__(self, cfg, weights: Mapping[str, Any], ops: Ops,
                 all_reduce: Optional[Callable[[np.ndarray], np.ndarray]] = None):
        self.cfg, self.ops = cfg, ops
        self.all_reduce = all_reduce  # tensor parallel: sum of the row-parallel partial outputs (None = tp 1)
        w = weight_getter(cfg, weights)
        self.eps = float(cfg.rms_norm_eps)
        self.kv_lora, self.rope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope = cfg.qk_nope_head_dim
        self.embed_tokens = embed_weight(weights, w)                                     # [V, D]
        self.norm_w = w("model.norm.weight")
        self.lm_head_w = lm_head_weight(cfg, weights, self.embed_tokens)
        self.layers: List[Dict[str, Any]] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            moe = is_moe_layer(cfg, i)
            self.layers.append({
                "in_norm": w(f"{p}.input_layernorm.weight"),
                "post_norm": w(f"{p}.post_attention_layernorm.weight"),
                "attn": _Attn(w, cfg, i),
                "moe": _Moe(w, cfg, i) if moe else None,
                "mlp": None if moe else _Mlp(w, f"{p}.mlp"),
            })
        self.rotary = RotaryTable(cfg)
        self.scale = softmax_scale(cfg)
        # per-head linear for the absorbed q/o where the backend has a native one (backend=cpu)
        self._head_linear = ops.head_linear if getattr(ops, "has_head_linear", False) else None
        self._route_cfg = route_params(cfg)
        self.return_logits = True   # False on tensor-parallel ranks 1..N-1: rank 0 alone needs the logits
        # the paged latent arena f32[n_layers, n_pages, page_rows, L+R]: every cache's rows (kdtree/model/pages.py)
        self.arena = np.zeros((cfg.num_hidden_layers, 0, DEFAULT_PAGE_ROWS, self.kv_lora + self.rope_dim), np.float32)
        self.pages = PagePool(DEFAULT_PAGE_ROWS)
        self.pages.add_arena(self._resize_arena)

    # -- pieces shared with the DFlash drafter ------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens i32[T] -> f32[T, D]."""
        return self.embed_tokens[np.asarray(tokens, np.int64)]

    def final_norm(self, h: np.ndarray) -> np.ndarray:
        return self.ops.rms_norm(h, self.norm_w, self.eps)

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """h f32[T, D] (already normed) -> logits f32[T, V]."""
        return self.ops.linear(h, self.lm_head_w)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Residual stream f32[T, D] -> logits f32[T, V] (final norm, then lm_head)."""
        return self.lm_head(self.final_norm(h))

    # -- the Target protocol's hooks: nothing native here ------------------------------------------------
    def attach_device_collective(self) -> bool:
        """False: the all-reduce stays the host callback (NativeTarget moves it onto the CUDA stream)."""
        return False

    def reserve_cache_pool(self, rows: int, page_rows: int = DEFAULT_PAGE_ROWS) -> bool:
        """A fixed arena of rows // page_rows pages from now on (PagePool.reserve); True."""
        self.pages.reserve(int(rows) // int(page_rows), page_rows)
        return True

    def _resize_arena(self, n_pages: int, page_rows: int) -> None:
        """The pool's size changed: the first pages keep their rows (same page size), new ones are zeros."""
        old = self.arena
        self.arena = np.zeros((old.shape[0], n_pages, page_rows, old.shape[3]), np.float32)
        if page_rows == old.shape[2]:
            k = min(n_pages, old.shape[1])
            self.arena[:, :k] = old[:, :k]

    def move_rows(self, pages: np.ndarray, start: int, rows: np.ndarray) -> None:
        """Tree compaction: rows `rows` of the sequence whose table is `pages` moved to start.. (every layer)."""
        P = self.pages.page_rows
        dst, dst_off = page_rows_of(pages, P, start, len(rows))
        src, src_off = np.asarray(pages, np.int64)[rows // P], rows % P
        self.arena[:, dst, dst_off] = self.arena[:, src, src_off]   # fancy indexing copies first: overlaps are safe

    def gather_rows(self, pages: np.ndarray, start: int, n: int) -> np.ndarray:
        """Rows [start, start + n) of a sequence, every layer: f32[n_layers, n, L+R] (a copy)."""
        pg, off = page_rows_of(pages, self.pages.page_rows, start, n)
        return np.ascontiguousarray(self.arena[:, pg, off])

    def graph_rows(self, rows: Iterable[int]) -> bool:
        """False: no CUDA graphs on this path."""
        return False

    def graph_stats(self) -> Dict[str, float]:
        return dict(NO_GRAPHS)

    def close(self) -> None:
        """Nothing to release (the arrays go with the object)."""

    def new_cache(self, max_len: int, prefix=()) -> LatentCache:
        """A cache of max_len rows: the pages `prefix` mapped first (a prefix cache hit), fresh pages for the rest."""
        check_context(self.cfg, max_len)
        return LatentCache(self, max_len, prefix)

    def _latent_write(self, cache, layer: int, start: int, rows: np.ndarray) -> None:
        """A sequence's new latent rows f32[n, L+R] at rows start.. of `layer` (through its page table; a plain
        f32[S, L+R] array for _attention)."""
        if isinstance(cache, np.ndarray):
            cache[start:start + rows.shape[0]] = rows
            return
        pg, off = page_rows_of(cache.pages, self.pages.page_rows, start, rows.shape[0])
        self.arena[layer, pg, off] = rows

    def _latent_rows(self, cache, layer: int, n: int) -> np.ndarray:
        """A sequence's first n latent rows of `layer`, gathered in order through its page table: f32[n, L+R]
        (a copy, bits unchanged)."""
        if isinstance(cache, np.ndarray):
            return cache[:n]
        pg, off = page_rows_of(cache.pages, self.pages.page_rows, 0, n)
        return self.arena[layer, pg, off]

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, positions: np.ndarray, cache: LatentCache,
                visibility: Optional[np.ndarray] = None, hidden_layers: Iterable[int] = ()
                ) -> Tuple[np.ndarray, Dict[int, np.ndarray]]:
        """Run T tokens after the cache's rows; append their latent rows to the cache.

        tokens i32[T], positions i32[T], visibility u64[T, ceil(T/64)] over the block (None = causal).
        Returns logits f32[T, V] and {layer: residual stream after that layer, f32[T, D]}.
        """
        seq = check_seq(0, tokens, positions, cache, visibility)
        if getattr(cache, "pool", self.pages) is not self.pages:
            raise ValueError("forward: the cache was made by another model's new_cache (its pages index that model's "
                             "arena); use model.new_cache(max_len)")
        h, hiddens = self._forward_rows([seq], hidden_layers)
        return (self.logits(h) if self.return_logits else np.empty((h.shape[0], 0), np.float32)), hiddens

    def forward_batch(self, seqs: Sequence[Tuple[np.ndarray, np.ndarray, LatentCache, Optional[np.ndarray]]],
                      hidden_layers: Iterable[int] = ()) -> Tuple[np.ndarray, np.ndarray, Dict[int, np.ndarray]]:
        """Rows of several sequences in ONE forward: seqs = [(tokens i32[T_s], positions i32[T_s], cache,
        visibility u64[T_s, ceil(T_s/64)] | None = causal)], distinct caches. Row-wise ops run once over the N
        concatenated rows; attention runs per sequence over its own cache and its own block (block-diagonal), so
        every row equals its sequence's forward alone, bit for bit (tests/model/test_forward_batch.py).
        Returns logits f32[N, V], argmax i32[N] and {layer: f32[N, D]}, rows in sequence order."""
        if not seqs:
            raise ValueError("forward_batch: no sequences; pass at least one (tokens, positions, cache, visibility)")
        checked = [check_seq(s, *seq) for s, seq in enumerate(seqs)]
        for s, c in enumerate(checked):
            if getattr(c[2], "pool", self.pages) is not self.pages:
                raise ValueError(f"forward_batch: sequence {s}'s cache was made by another model's new_cache (its "
                                 f"pages index that model's arena); use model.new_cache(max_len)")
        if len({id(c[2]) for c in checked}) != len(checked):
            raise ValueError("forward_batch: two sequences share one cache; give each sequence its own cache")
        h, hiddens = self._forward_rows(checked, hidden_layers)
        logits = self.logits(h) if self.return_logits else np.empty((h.shape[0], 0), np.float32)  # tp ranks 1..
        argmax = np.argmax(logits, axis=-1) if logits.shape[1] else np.zeros(len(logits))
        return logits, argmax.astype(np.int32), hiddens

    def _forward_rows(self, seqs: List[tuple], hidden_layers: Iterable[int]
                      ) -> Tuple[np.ndarray, Dict[int, np.ndarray]]:
        """The layer loop over the concatenated rows of checked sequences; appends each one's latent rows to its
        cache. Returns the last residual stream f32[N, D] and the wanted hidden states {layer: f32[N, D]}."""
        want = set(hidden_layers)
        tokens = np.concatenate([s[0] for s in seqs])                       # [N]
        positions = np.concatenate([s[1] for s in seqs])                    # [N]
        bounds = np.cumsum([0] + [len(s[0]) for s in seqs])                 # sequence s = rows bounds[s]..bounds[s+1]
        # (row0, row1, cache, n_prefix, visibility) of each sequence; n_prefix = its cache rows before this forward
        segments = [(int(bounds[j]), int(bounds[j + 1]), s[2], s[2].length, s[3]) for j, s in enumerate(seqs)]
        cos, sin = self.rotary.cos_sin(positions)                           # [N, R/2]
        rot = rope_tables(cos, sin)                                         # [N, R] each, shared by the layers
        h = self.embed(tokens)                                              # [N, D]
        hiddens: Dict[int, np.ndarray] = {}
        for i, layer in enumerate(self.layers):
            x = self.ops.rms_norm(h, layer["in_norm"], self.eps)
            h = h + self._attention_rows(layer["attn"], x, i, segments, rot)
            x = self.ops.rms_norm(h, layer["post_norm"], self.eps)
            m = self._moe(layer["moe"], x, i) if layer["moe"] is not None else self._mlp(layer["mlp"], x)
            h = h + (self.all_reduce(m) if self.all_reduce else m)
            if i in want:
                hiddens[i] = h.copy()
        for r0, r1, cache, n_prefix, _ in segments:
            cache.length = n_prefix + (r1 - r0)
        return h, hiddens

    def _attention(self, a: _Attn, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: np.ndarray,
                   n_prefix: int, visibility: Optional[np.ndarray]) -> np.ndarray:
        """MLA of one sequence's T rows over one layer's latent rows kv f32[max_len, L+R] (writes its rows)."""
        return self._attention_rows(a, x, 0, [(0, x.shape[0], kv, n_prefix, visibility)], rope_tables(cos, sin))

    def _attention_rows(self, a: _Attn, x: np.ndarray, layer: int, segments: List[tuple],
                        rot: Tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """MLA of layer `layer` over N rows: projections over all rows, then each sequence's rows attend to its
        own cache (segments: (row0, row1, cache, n_prefix, visibility)). Returns f32[N, D]."""
        ops, L, nope, T = self.ops, self.kv_lora, self.nope, x.shape[0]
        q = ops.linear(ops.rms_norm(ops.linear(x, a.q_a), a.q_a_norm, self.eps), a.q_b)
        q = q.reshape(T, a.heads, nope + self.rope_dim)                     # q: [T, H, nope+R]
        kv_a = ops.linear(x, a.kv_a)                                        # kv_a: [T, L+R]
        c_kv = ops.rms_norm(kv_a[:, :L], a.kv_a_norm, self.eps)            # [T, L]
        k_pe = rope_apply(kv_a[:, L:], *rot)                                # [T, R] shared by all heads
        q_full = np.empty((T, a.heads, L + self.rope_dim), np.float32)      # q_full: [T, H, L+R]
        q_full[:, :, L:] = rope_apply(q[:, :, nope:], *rot)
        # absorbed q and o: one batched matmul over (t, h); numpy runs each (t, h) item as its own small
        # BLAS call of a fixed shape ([1, nope] @ [nope, L], [v, L] @ [L, 1]), so a row never depends on T
        # (backend=cpu: one native per-head linear call each, over W_uk[h]^T and W_uv[h])
        head_linear = self._head_linear
        if head_linear is None or not head_linear(q[:, :, :nope], a.w_uk_t, q_full[:, :, :L]):
            q_full[:, :, :L] = np.matmul(q[:, :, None, :nope], a.w_uk)[:, :, 0]  # W_uk[h]^T q_nope[h]: [T, H, L]
        o_lat = np.empty((T, a.heads, L), np.float32)                       # [T, H, L]
        latent = np.concatenate([c_kv, k_pe], axis=1)                       # [T, L+R] the new rows
        for r0, r1, cache, n_prefix, visibility in segments:                # each sequence: its own cache only
            n = r1 - r0
            self._latent_write(cache, layer, n_prefix, latent[r0:r1])
            kv = self._latent_rows(cache, layer, n_prefix + n)              # [n_prefix + n, L+R] through its pages
            o_lat[r0:r1] = ops.mla_attention(q_full[r0:r1], kv, n_prefix, visibility, self.scale, L)
        o = np.empty((T, a.heads, a.w_uv.shape[1]), np.float32)
        if head_linear is None or not head_linear(o_lat, a.w_uv, o):
            o = np.matmul(a.w_uv, o_lat[:, :, :, None])                     # W_uv[h] o_lat[h]: [T, H, v]
        o = o.reshape(T, -1)                                                # [T, H*v]
        out = ops.linear(o, a.o)                                            # [T, D]
        return self.all_reduce(out) if self.all_reduce else out

    def _mlp(self, m: _Mlp, x: np.ndarray) -> np.ndarray:
        ops = self.ops
        return ops.linear(ops.silu_mul(ops.linear(x, m.gate), ops.linear(x, m.up)), m.down)

    def moe_stats(self, reset: bool = False) -> Dict[int, Dict[str, int]]:
        """{MoE layer: {forwards, experts, rows}} since the last reset (NativeTarget.moe_stats' counters): the
        distinct routed experts each forward used, summed -- each forward streams the union of its rows' experts."""
        stats = {i: dict(v) for i, v in sorted(getattr(self, "_moe_counts", {}).items())}
        if reset:
            self._moe_counts = {}
        return stats

    def _moe(self, moe: _Moe, x: np.ndarray, layer: int = -1) -> np.ndarray:
        """Routed experts grouped by expert (one gate/up/down call over the rows routed to it), then per token
        acc = 0 + w_1 y_1 + ... + w_k y_k (descending choice order) + shared: row-wise ops only, so a token's
        output is the same whatever other tokens share the call."""
        T, D = x.shape
        one = np.float32(1.0)
        logits = self.ops.linear(x, moe.gate)                               # [T, E]
        scores = one / (one + np.exp(-logits))
        experts, weights = route_rows(self._route_cfg, scores, moe.bias)          # [T, k] each
        counts = self.__dict__.setdefault("_moe_counts", {}).setdefault(layer, {"forwards": 0, "experts": 0, "rows": 0})
        counts["forwards"] += 1
        counts["experts"] += int(np.unique(experts).size)
        counts["rows"] += T
        fused_op = getattr(self.ops, "moe", None)                           # backend=cpu: one native call
        fused = fused_op(x, experts, weights, moe) if fused_op is not None else None
        if fused is not None:
            return fused
        k = experts.shape[1]
        flat = experts.reshape(-1)                                          # slot t*k + j -> expert
        y = np.empty((T * k, D), np.float32)                                # expert outputs per slot
        if T == 1:
            for j in range(k):
                y[j] = self._mlp(moe.experts[int(flat[j])], x)[0]
        else:
            order = np.argsort(flat, kind="stable")                         # slots grouped by expert
            sorted_e = flat[order]
            bounds = np.flatnonzero(np.diff(sorted_e)) + 1
            for slots in np.split(order, bounds):
                y[slots] = self._mlp(moe.experts[int(flat[slots[0]])], x[slots // k])
        y = y.reshape(T, k, D)
        acc = np.zeros((T, D), np.float32)
        for j in range(k):                                                  # descending choice order
            acc = acc + weights[:, j:j + 1] * y[:, j]
        if moe.shared is not None:
            acc = acc + self._mlp(moe.shared, x)
        return acc
