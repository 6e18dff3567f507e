"""The DFlash drafter's extend and draft in one library call each (kd_drafter_*: native/src/cpu/kd_forward.c,
native/src/cuda/kd_forward.cu), with DFlashDrafter's interface (kdtree/model/drafter.py is the numpy spec).

    drafter = NativeDrafter(cfg, weights, ops, target.embed_tokens, target.lm_head_w, target, pages=target.pages)
    cache = drafter.new_cache(max_len, share=target_cache)   # context rows in the target cache's pages
    drafter.extend(cache, hiddens)          # {layer_id: f32[T, D]} of the next T committed tokens
    logits = drafter.draft(cache, bonus)    # f32[B-1, V]
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from kdtree.backends.native_forward import NativeTarget, _Registry, _timed
from kdtree.model.drafter import DrafterCache, check_drafter_weights, context_features, drafter_shape
from kdtree.model.pages import DEFAULT_PAGE_ROWS, PagePool


class NativeDrafterCache(DrafterCache):
    """The drafter's context in pages of the library's drafter arena (kd_drafter_pages), ids of its target's pool:
    DrafterCache's length / max_len / truncate."""


class NativeDrafter:
    """The DFlash drafter whose extend and draft are ONE library call each: its weights (by
    names.drafter_tensor_shapes) and its target's embed / lm_head registered with the library, the sizes from
    drafter_shape (the function DFlashDrafter reads). With `target` (the NativeTarget whose embed_tokens /
    lm_head_w these are), the CUDA build reads the target's device copies instead of uploading them again
    (2 x V x D: 4.7 GB of BF16 for K2.6); it is kept alive as long as this drafter. build_drafter
    (kdtree/model/target.py) picks it for backend=cpu|cuda unless backend.drafter_forward=per_op.

    drafter = NativeDrafter(cfg, weights, ops, embed, lm_head, target=None)   # DFlashDrafter's arguments
    """

    def __init__(self, cfg, weights: Mapping[str, Any], ops: Any, embed: np.ndarray, lm_head: Any,
                 target: Optional[NativeTarget] = None, pages: Optional[PagePool] = None):
        lib = ops.lib
        self.cfg, self.lib = cfg, lib
        self._target = target
        shape = drafter_shape(cfg)
        check_drafter_weights(cfg, weights, source="drafter weights")
        ffi = lib.ffi
        reg = self._reg = _Registry(lib)
        w = weights
        self.block_size, self.vocab = shape.block_size, int(embed.shape[0])
        self.target_layer_ids = list(shape.target_layer_ids)
        d = self._desc = ffi.new("kd_drafter_desc *")
        d.vocab, d.hidden, d.n_layers = self.vocab, int(embed.shape[1]), shape.num_layers
        d.hq, d.hkv, d.head_dim, d.block_size = shape.hq, shape.hkv, shape.hd, shape.block_size
        d.mask_token, d.eps, d.rope_theta = shape.mask_token_id, shape.eps, shape.theta
        reg.weight(d.fc, w["fc.weight"], "fc")
        d.hidden_norm, d.final_norm = reg.vec(w["hidden_norm.weight"]), reg.vec(w["norm.weight"])
        reg.table(d, "embed", embed)
        reg.weight(d.lm_head, lm_head, "lm_head")
        layers = ffi.new("kd_drafter_layer[]", shape.num_layers)
        reg.keep.append(layers)
        for i in range(shape.num_layers):
            ly, p, a = layers[i], f"layers.{i}", f"layers.{i}.self_attn"
            ly.in_norm = reg.vec(w[f"{p}.input_layernorm.weight"])
            ly.post_norm = reg.vec(w[f"{p}.post_attention_layernorm.weight"])
            for name in ("q", "k", "v", "o"):
                reg.weight(getattr(ly, name), w[f"{a}.{name}_proj.weight"], f"{a}.{name}_proj")
            ly.q_norm, ly.k_norm = reg.vec(w[f"{a}.q_norm.weight"]), reg.vec(w[f"{a}.k_norm.weight"])
            for name in ("gate", "up", "down"):
                reg.weight(getattr(ly.mlp, name), w[f"{p}.mlp.{name}_proj.weight"], f"{p}.mlp.{name}_proj")
        d.layers = layers
        if target is not None:
            d.target = target.handle
        h = ffi.new("kd_drafter **")
        lib.check(lib.c.kd_drafter_create(d, h), "kd_drafter_create")
        self.handle = h[0]
        weakref.finalize(self, lib.c.kd_drafter_destroy, self.handle)
        self._seq = np.zeros(4, np.int64)            # [page_start 0, page_start 1, length, T] of one sequence
        self._rows = np.zeros(2, np.int64)
        self._bonus = np.zeros(1, np.int32)
        self._fb = ffi._backend.from_buffer
        self._types = {k: ffi.typeof(f"{k}[]") for k in ("float", "int32_t", "int64_t")}
        # the context arena, indexed by the target's page ids (its pool; a pool of its own when standalone)
        self.pages = pages if pages is not None else PagePool(DEFAULT_PAGE_ROWS)
        self.pages.add_arena(self._resize_arena)

    def weight_bytes(self) -> Dict[str, Tuple[int, int]]:
        """{matrix name: (bytes held, elements)} for every linear the drafter reads (fc, its layers, lm_head), as
        NativeTarget.weight_bytes: a round (extend + draft) streams each of them at least once."""
        return dict(self._reg.bytes)

    def _resize_arena(self, n_pages: int, page_rows: int) -> None:
        self.lib.check(self.lib.c.kd_drafter_pages(self.handle, int(n_pages), int(page_rows)), "kd_drafter_pages")

    def new_cache(self, max_len: int, share=None) -> NativeDrafterCache:
        """A context of max_len rows in fresh pages, or in the pages of `share` (the request's target cache)."""
        return NativeDrafterCache(self, max_len, share=share)

    def _table(self, cache: NativeDrafterCache):
        """cache's page table and the (page_start, lengths) block of one sequence, as C pointers."""
        if cache.pool is not self.pages:
            raise ValueError("drafter: the context cache was not made by this drafter's new_cache (its pages index "
                             "another arena); use drafter.new_cache(max_len)")
        fb, ty = self._fb, self._types
        pages = np.ascontiguousarray(cache.pages, np.int32)
        self._seq[1], self._seq[2] = pages.size, cache.length
        c = fb(ty["int64_t"], self._seq, False)
        return pages, fb(ty["int32_t"], pages, False), c, c + 2

    def extend(self, cache: NativeDrafterCache, hiddens: Mapping[int, np.ndarray]) -> None:
        """Append context rows: hiddens {layer_id: f32[T, D]} of the next T committed positions."""
        feats = np.ascontiguousarray(context_features(self.target_layer_ids, hiddens, cache), np.float32)
        T = feats.shape[0]
        if T == 0:
            return
        fb, ty = self._fb, self._types
        self._rows[1] = T
        keep, pages, page_start, lengths = self._table(cache)
        rc = _timed(self.lib.c.kd_drafter_extend, self.handle, 1, pages, page_start, lengths,
                    fb(ty["int64_t"], self._rows, False), fb(ty["float"], feats, False))
        if rc:
            self.lib.check(rc, "kd_drafter_extend")
        cache.length += T

    def draft(self, cache: NativeDrafterCache, bonus: int) -> np.ndarray:
        """One block forward after the cached context -> logits f32[B-1, V] of the tokens after `bonus`."""
        out = np.empty((self.block_size - 1, self.vocab), np.float32)
        self._bonus[0] = int(bonus)
        fb, ty = self._fb, self._types
        keep, pages, page_start, lengths = self._table(cache)
        rc = _timed(self.lib.c.kd_drafter_draft, self.handle, 1, pages, page_start, lengths,
                    fb(ty["int32_t"], self._bonus, False), fb(ty["float"], out, False))
        if rc:
            self.lib.check(rc, "kd_drafter_draft")
        return out


__all__ = ["NativeDrafter", "NativeDrafterCache"]
