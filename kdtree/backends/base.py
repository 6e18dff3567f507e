"""The Ops interface: every op the K2 target needs, as one backend implements it.

Signatures and numerics are those of docs/engine-contracts.md ("Ops"). The numpy reference
(kdtree/backends/numpy_ops.py) is the ground truth; native backends are checked against it.
Every op is batch-invariant: a row's result never depends on how many other rows are in the call.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Tuple

import numpy as np


class Ops(ABC):
    """One backend's implementation of the model ops (float32 in, float32 out)."""

    name: str = "abstract"
    has_head_linear: bool = False   # True where head_linear is a native op (K2Model then prefers it)

    @abstractmethod
    def linear(self, x: np.ndarray, w: Any) -> np.ndarray:
        """x f32[T, in], w f32[out, in] ndarray or a quantized weight with .matvec -> f32[T, out]."""

    def linear_fast(self, x: np.ndarray, w: Any) -> np.ndarray:
        """Like linear, for callers that do not need batch invariance (the DFlash drafter: the target verifies
        every token it proposes): the backend's fastest deterministic path. Default: linear."""
        return self.linear(x, w)

    def moe(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, layer: Any) -> Optional[np.ndarray]:
        """Optional fused MoE layer: x f32[T, D], experts i64[T, k] (descending choice order), weights f32[T, k],
        layer with .experts[e].{gate, up, down} and .shared (or None) -> f32[T, D] equal to K2Model's grouped
        path (acc = 0 + w_0 y_0 + ... + shared, each expert a row-wise linear); None = not available here."""
        return None

    def head_linear(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
        """Optional per-head linear out[t, h] = w[h] @ x[t, h] (x f32[T, H, in], w f32[H, out, in], out
        f32[T, H, out], views with a contiguous last axis), row-wise like linear. Returns False (nothing written)
        where the backend has none; K2Model then uses numpy's batched matmul."""
        return False

    @abstractmethod
    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """x f32[T, D], w f32[D] -> x / sqrt(mean(x^2) + eps) * w, f32[T, D]."""

    @abstractmethod
    def mla_attention(self, q: np.ndarray, kv: np.ndarray, n_prefix: int, visibility: Optional[np.ndarray],
                      scale: float, kv_lora: int) -> np.ndarray:
        """Absorbed MLA over a latent cache.

        q f32[T, H, L+R] (absorbed nope part + roped rope part), kv f32[S, L+R] with S == n_prefix + T
        (rows [0, n_prefix) the cache, [n_prefix, S) the block). Key n_prefix+k is visible to query t iff
        bit (k % 64) of visibility[t, k // 64] is set; None = causal. Cache rows are visible to every query.
        Returns o_lat f32[T, H, L] = softmax(scale * q·kv) @ kv[:, :L].
        """

    @abstractmethod
    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """gate, up f32[T, I] -> silu(gate) * up, f32[T, I]."""

    def draft_topk(self, logits: np.ndarray, width: int) -> Tuple[np.ndarray, np.ndarray]:
        """The drafter's block logits f32[depth, V] -> (logp f32[depth, w], ids i32[depth, w]), w = min(width, V):
        kdtree.tree.draft_topk (the reference; native backends may differ in the last bit of a log-prob)."""
        from kdtree.tree import draft_topk
        return draft_topk(logits, width)

    def tree_build(self, logp: np.ndarray, ids: np.ndarray, budget: int) -> Any:
        """logp f32[depth, width], ids i32[depth, width] -> Tree (kdtree/tree.py)."""
        raise NotImplementedError(f"backend {self.name} has no tree_build")

    def tree_accept(self, parents: np.ndarray, tokens: np.ndarray, target_argmax: np.ndarray) -> Tuple[np.ndarray, int]:
        """parents i32[N], tokens i32[N], target_argmax i32[N+1] -> (path i32[k], bonus)."""
        raise NotImplementedError(f"backend {self.name} has no tree_accept")

    def token_bitmask_apply(self, logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
        """Grammar masks: logits f32[T, V] (modified in place and returned) at -inf where row t's bit is 0; bitmask
        u32[T, ceil(V/32)], bit (v % 32) of word v // 32 = token v (llguidance's layout)."""
        logits[~unpack_bitmask(bitmask, logits.shape[1])] = -np.inf
        return logits

    def masked_argmax(self, logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
        """i32[T]: each row's argmax among the tokens its bitmask allows (ties: the lowest id; -1: none)."""
        allowed = unpack_bitmask(bitmask, logits.shape[1])
        out = np.argmax(np.where(allowed, logits, -np.inf), axis=1).astype(np.int32)
        out[~allowed.any(axis=1)] = -1
        return out


def unpack_bitmask(bitmask: np.ndarray, V: int) -> np.ndarray:
    """u32[T, words] token bitmask -> bool[T, V]."""
    b = np.ascontiguousarray(bitmask, "<u4")
    return np.unpackbits(b.view(np.uint8).reshape(b.shape[0], -1), axis=1, bitorder="little")[:, :V].astype(bool)
