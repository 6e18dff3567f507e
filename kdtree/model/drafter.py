"""DFlash block drafter: predicts the next B-1 tokens after the bonus token in one forward.

Layout (names in kdtree/model/names.drafter_tensor_shapes): context features
`hidden_norm(fc(concat(target hiddens of target_layer_ids)))` for every committed position; the block is
the target's embedding of [bonus, MASK x (B-1)]; each layer is a pre-norm Qwen3-style GQA attention
(q/k RMSNorm per head, rotate_half RoPE at absolute positions) whose queries are the block rows and whose
keys/values are context + block, NON-causal, then a SwiGLU MLP. Final norm and the TARGET's lm_head give
logits for block rows 1..B-1. The drafter never touches correctness (the target verifies every token);
it only decides how many tokens a round commits.

Per generation the state lives in a `DrafterCache` (roped k and v of the context per layer, appended
as tokens commit), so a round costs one block forward plus the new context rows, not the whole context. Its rows
live in pages of the drafter's arena with the ids of its target's pool (kdtree/model/pages.py): row j = position j,
in the same page as the target's latent row j, so a prefix cache hit maps both with one page table.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Mapping, Sequence

import numpy as np

from kdtree.model.names import drafter_tensor_shapes
from kdtree.model.pages import DEFAULT_PAGE_ROWS, PagedCache, PagePool, page_rows_of
from kdtree.errors import CheckpointError, ConfigError


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float):
    """Standard (rotate_half) RoPE tables: positions i[T] -> cos, sin f32[T, head_dim]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))   # [hd/2]
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]                 # [T, hd/2]
    ang = np.concatenate([ang, ang], axis=-1)                                            # [T, hd]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x f32[T, H, hd] rotated by rotate_half: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class DrafterCache(PagedCache):
    """The drafter's context (roped keys and values of each committed position, every layer) in pages of its
    drafter's arena: length, max_len, truncate. Made by DFlashDrafter.new_cache (share=: the target cache's pages)."""

    def truncate(self, n: int) -> None:
        self.length = min(self.length, int(n))


class DFlashDrafter:
    """DFlash drafter over a target's embeddings and lm_head.

    drafter = DFlashDrafter(cfg, weights, ops, embed, lm_head)
    cache = drafter.new_cache(max_len)
    drafter.extend(cache, hiddens)          # hiddens {layer_id: f32[T, D]} of the next T committed tokens
    logits = drafter.draft(cache, bonus)    # f32[B-1, V]: predictions of the B-1 tokens after `bonus`
    """

    def __init__(self, cfg, weights: Mapping[str, Any], ops, embed: np.ndarray, lm_head: Any,
                 pages: PagePool = None):
        self.cfg = cfg
        self.ops = ops
        shape = drafter_shape(cfg)
        self.block_size, self.target_layer_ids = shape.block_size, shape.target_layer_ids
        self.num_layers = shape.num_layers
        self.hq, self.hkv, self.hd = shape.hq, shape.hkv, shape.hd
        self.eps, self.theta, self.mask_token_id = shape.eps, shape.theta, shape.mask_token_id
        check_drafter_weights(cfg, weights, source="drafter weights")
        # no batch invariance needed here (the target verifies every drafted token): the fastest
        # deterministic linear of the backend (a plain GEMM on numpy)
        self._linear = getattr(ops, "linear_fast", ops.linear)
        self.w = dict(weights)
        self.embed = embed        # f32[V, D] (target's model.embed_tokens.weight)
        self.lm_head = lm_head    # f32[V, D] or Int4Weight (target's lm_head.weight)
        # context K/V arenas f32[n_layers, n_pages, page_rows, Hkv, hd], indexed by the target's page ids
        self.k = self.v = np.zeros((self.num_layers, 0, DEFAULT_PAGE_ROWS, self.hkv, self.hd), np.float32)
        self.pages = pages if pages is not None else PagePool(DEFAULT_PAGE_ROWS)
        self.pages.add_arena(self._resize_arena)

    def _resize_arena(self, n_pages: int, page_rows: int) -> None:
        """Its target's pool changed size: the first pages keep their rows (same page size), new ones are zeros."""
        shape = (self.num_layers, n_pages, page_rows, self.hkv, self.hd)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        if page_rows == self.k.shape[2]:
            n = min(n_pages, self.k.shape[1])
            k[:, :n], v[:, :n] = self.k[:, :n], self.v[:, :n]
        self.k, self.v = k, v

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def load(cls, path, cfg, ops, embed: np.ndarray, lm_head: Any) -> "DFlashDrafter":
        """Load `path` = a drafter dir (its *.safetensors files) or one .safetensors file."""
        from safetensors.numpy import load_file

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise CheckpointError(f"drafter checkpoint {p} has no .safetensors file; "
                                  f"write <checkpoint>/drafter/model.safetensors")
        weights: Dict[str, np.ndarray] = {}
        for f in files:
            for name, t in load_file(str(f)).items():
                weights[name] = np.ascontiguousarray(t, dtype=np.float32)
        check_drafter_weights(cfg, weights, source=str(p))
        return cls(cfg, weights, ops, embed, lm_head)

    @classmethod
    def from_target(cls, model, weights: Mapping[str, Any]) -> "DFlashDrafter":
        """This drafter over `model`'s (any Target) embeddings, lm_head and ops; build_drafter picks NativeDrafter
        where the library runs the drafter's forwards."""
        return cls(model.cfg, weights, model.ops, model.embed_tokens, model.lm_head_w, getattr(model, "pages", None))

    def new_cache(self, max_len: int, share: PagedCache = None) -> DrafterCache:
        """A context of max_len rows in fresh pages, or in the pages of `share` (a cache of the target whose pool
        this drafter shares: the request's own pages)."""
        return DrafterCache(self, max_len, share=share)

    # ---- forward ------------------------------------------------------------------------------------
    def _kv(self, i: int, x: np.ndarray, positions: np.ndarray, cos_sin=None):
        """x f32[T, D] -> roped k, v f32[T, Hkv, hd] of layer i."""
        a = f"layers.{i}.self_attn"
        T = x.shape[0]
        k = self._linear(x, self.w[f"{a}.k_proj.weight"]).reshape(T, self.hkv, self.hd)
        v = self._linear(x, self.w[f"{a}.v_proj.weight"]).reshape(T, self.hkv, self.hd)
        k = self.ops.rms_norm(k.reshape(T * self.hkv, self.hd), self.w[f"{a}.k_norm.weight"], self.eps)
        cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(positions, self.hd, self.theta)
        k = apply_rope_half(k.reshape(T, self.hkv, self.hd), cos, sin)
        return k.astype(np.float32), v.astype(np.float32)

    def extend(self, cache: DrafterCache, hiddens: Mapping[int, np.ndarray]) -> None:
        """Append context rows: hiddens {layer_id: f32[T, D]} of the next T committed positions."""
        feats = context_features(self.target_layer_ids, hiddens, cache)
        T = feats.shape[0]
        if T == 0:
            return
        n = cache.length
        ctx = self.ops.rms_norm(self._linear(feats, self.w["fc.weight"]), self.w["hidden_norm.weight"], self.eps)
        pos = np.arange(n, n + T)
        cos_sin = rope_cos_sin(pos, self.hd, self.theta)
        pg, off = page_rows_of(cache.pages, self.pages.page_rows, n, T)   # rows n.. through the page table
        for i in range(self.num_layers):
            k, v = self._kv(i, ctx, pos, cos_sin)
            self.k[i, pg, off] = k
            self.v[i, pg, off] = v
        cache.length = n + T

    def draft(self, cache: DrafterCache, bonus: int) -> np.ndarray:
        """One block forward after the cached context -> logits f32[B-1, V] of the tokens after `bonus`."""
        B, n = self.block_size, cache.length
        ids = np.full(B, self.mask_token_id, np.int64)
        ids[0] = int(bonus)
        x = np.asarray(self.embed[ids], np.float32)                         # [B, D]
        pos = np.arange(n, n + B)
        cos, sin = rope_cos_sin(pos, self.hd, self.theta)
        group = self.hq // self.hkv
        scale = self.hd ** -0.5
        pg, off = page_rows_of(cache.pages, self.pages.page_rows, 0, n)     # the context, gathered in order
        for i in range(self.num_layers):
            p, a = f"layers.{i}", f"layers.{i}.self_attn"
            h = self.ops.rms_norm(x, self.w[f"{p}.input_layernorm.weight"], self.eps)
            q = self._linear(h, self.w[f"{a}.q_proj.weight"])            # [B, Hq*hd]
            q = self.ops.rms_norm(q.reshape(B * self.hq, self.hd), self.w[f"{a}.q_norm.weight"], self.eps)
            q = apply_rope_half(q.reshape(B, self.hq, self.hd), cos, sin)   # [B, Hq, hd]
            kb, vb = self._kv(i, h, pos, (cos, sin))                        # [B, Hkv, hd]
            k = np.concatenate([self.k[i, pg, off], kb], axis=0)            # [n+B, Hkv, hd]
            v = np.concatenate([self.v[i, pg, off], vb], axis=0)
            # q head j = kv * group + g reads kv head j // group: one batched matmul per kv head over its
            # group's queries (no repeated k/v), non-causal
            qg = q.reshape(B, self.hkv, group, self.hd).transpose(1, 2, 0, 3).reshape(self.hkv, group * B, self.hd)
            s = np.matmul(qg, k.transpose(1, 2, 0))                         # [Hkv, group*B, n+B]
            s *= np.float32(scale)
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            o = np.matmul(s, v.transpose(1, 0, 2))                          # [Hkv, group*B, hd]
            o = o.reshape(self.hkv, group, B, self.hd).transpose(2, 0, 1, 3).reshape(B, self.hq * self.hd)
            o = np.ascontiguousarray(o, np.float32)
            x = x + self._linear(o, self.w[f"{a}.o_proj.weight"])
            h = self.ops.rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"], self.eps)
            g = self._linear(h, self.w[f"{p}.mlp.gate_proj.weight"])
            u = self._linear(h, self.w[f"{p}.mlp.up_proj.weight"])
            x = x + self._linear(self.ops.silu_mul(g, u), self.w[f"{p}.mlp.down_proj.weight"])
        h = self.ops.rms_norm(x[1:], self.w["norm.weight"], self.eps)       # [B-1, D]
        return self._linear(h, self.lm_head)                             # [B-1, V]


def drafter_shape(cfg) -> SimpleNamespace:
    """The drafter's sizes from the target's ModelConfig (model.drafter.*), checked: block_size, target_layer_ids,
    num_layers, hq, hkv, hd, eps, theta, mask_token_id. One definition for DFlashDrafter and NativeDrafter."""
    d = cfg.drafter
    shape = SimpleNamespace(
        block_size=int(d.block_size), target_layer_ids=[int(i) for i in d.target_layer_ids],
        num_layers=int(d.num_hidden_layers), hq=int(d.num_attention_heads), hkv=int(d.num_key_value_heads),
        hd=int(d.head_dim), eps=float(d.rms_norm_eps), theta=float(d.rope_theta), mask_token_id=int(cfg.mask_token_id))
    if shape.block_size < 2:
        raise ConfigError(f"model.drafter.block_size={shape.block_size} (model={cfg.name}) leaves no token to draft; use >= 2")
    if shape.hq % shape.hkv:
        raise ConfigError(f"model.drafter.num_key_value_heads={shape.hkv} does not divide "
                          f"num_attention_heads={shape.hq} (model={cfg.name}); pick a divisor")
    if not shape.target_layer_ids:
        raise ConfigError(f"model.drafter.target_layer_ids is empty (model={cfg.name}); list target layers, e.g. [1, 3]")
    for i in shape.target_layer_ids:
        if not 0 <= i < int(cfg.num_hidden_layers):
            raise ConfigError(f"model.drafter.target_layer_ids has {i}, outside 0..{int(cfg.num_hidden_layers) - 1} "
                              f"(model={cfg.name}); use target layer indices")
    return shape


def context_features(target_layer_ids: Sequence[int], hiddens: Mapping[int, np.ndarray], cache) -> np.ndarray:
    """extend's input: the target's hidden rows {layer: f32[T, D]} of target_layer_ids side by side, f32[T, n * D],
    after checking that the cache has room for T more rows."""
    feats = np.concatenate([np.asarray(hiddens[i], np.float32) for i in target_layer_ids], axis=-1)
    n, T = cache.length, feats.shape[0]
    if T and n + T > cache.max_len:
        raise ConfigError(f"drafter context {n + T} exceeds its cache max_len={cache.max_len}; "
                          f"allocate new_cache(max_len >= prompt + max_new_tokens + block)")
    return feats


def check_drafter_weights(cfg, weights: Mapping[str, Any], source: str) -> None:
    """Every tensor of names.drafter_tensor_shapes present with its shape, else one-line CheckpointError."""
    for name, shape in drafter_tensor_shapes(cfg).items():
        if name not in weights:
            raise CheckpointError(f"{source} lacks tensor {name} (expected shape {list(shape)} for model={cfg.name}); "
                                  f"re-export the DFlash drafter with its names")
        got = tuple(getattr(weights[name], "shape", ()))
        if got != tuple(shape):
            raise CheckpointError(f"{source} tensor {name} has shape {list(got)}, expected {list(shape)} "
                                  f"for model={cfg.name}; use the drafter trained for this target")


__all__: Sequence[str] = ("DFlashDrafter", "DrafterCache", "check_drafter_weights", "context_features", "drafter_shape",
                          "rope_cos_sin", "apply_rope_half")
