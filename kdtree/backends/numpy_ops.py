"""Numpy reference backend: float32, written for clarity, the ground truth for every other backend.

Batch invariance by construction: every op loops over rows and computes each row with the identical
numpy call sequence whatever T is (a GEMV per row for linear layers; for attention, the row's visible
keys gathered in ascending position order, then its own softmax and weighted sum). So the same row in
a 1-row call and in a T-row call gives bit-identical results.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kdtree.backends.base import Ops


def unpack_visibility(visibility: np.ndarray, n_rows: int) -> np.ndarray:
    """Packed u64[T, ceil(T/64)] -> bool[T, n_rows]: bit (k % 64) of word k // 64 is key k."""
    vis = np.ascontiguousarray(visibility, dtype="<u8")
    bits = np.unpackbits(vis.view(np.uint8).reshape(vis.shape[0], -1), axis=1, bitorder="little")
    return bits[:, :n_rows].astype(bool)


def pack_visibility(mask: np.ndarray) -> np.ndarray:
    """bool[T, T] -> packed u64[T, ceil(T/64)] (the inverse of unpack_visibility)."""
    mask = np.asarray(mask, dtype=bool)
    T, K = mask.shape
    words = (K + 63) // 64
    padded = np.zeros((T, words * 64), np.uint8)
    padded[:, :K] = mask
    return np.packbits(padded, axis=1, bitorder="little").view("<u8").astype(np.uint64).reshape(T, words)


class NumpyOps(Ops):
    name = "numpy"

    def linear(self, x: np.ndarray, w: Any) -> np.ndarray:
        # x: [T, in] -> [T, out], one GEMV per row (never one GEMM over T rows)
        x = np.asarray(x, np.float32)
        if isinstance(w, np.ndarray):
            out = np.empty((x.shape[0], w.shape[0]), np.float32)
            for t in range(x.shape[0]):
                out[t] = w @ x[t]
            return out
        if hasattr(w, "linear"):  # Int4Weight.linear: row t computed exactly as matvec(x[t]), unpacked once
            return np.asarray(w.linear(x), np.float32)
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        for t in range(x.shape[0]):
            out[t] = w.matvec(x[t])
        return out

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        # x: [T, D]
        out = np.empty(x.shape, np.float32)
        eps = np.float32(eps)
        for t in range(x.shape[0]):
            r = x[t]
            out[t] = r * (np.float32(1.0) / np.sqrt(np.mean(r * r) + eps)) * w
        return out

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        # gate, up: [T, I]
        out = np.empty(gate.shape, np.float32)
        one = np.float32(1.0)
        for t in range(gate.shape[0]):
            g = gate[t]
            out[t] = g / (one + np.exp(-g)) * up[t]
        return out

    def mla_attention(self, q: np.ndarray, kv: np.ndarray, n_prefix: int, visibility: Optional[np.ndarray],
                      scale: float, kv_lora: int) -> np.ndarray:
        # q: [T, H, L+R], kv: [n_prefix + T, L+R] -> o_lat [T, H, L]
        T, H, _ = q.shape
        assert kv.shape[0] == n_prefix + T, (kv.shape, n_prefix, T)
        out = np.empty((T, H, kv_lora), np.float32)
        prefix = np.arange(n_prefix)
        vis = unpack_visibility(visibility, T) if visibility is not None else None
        scale = np.float32(scale)
        for t in range(T):
            block = np.arange(t + 1) if vis is None else np.flatnonzero(vis[t])
            keys = kv[np.concatenate([prefix, n_prefix + block])]   # [n, L+R], ascending positions
            s = (q[t] @ keys.T) * scale                               # [H, n]
            e = np.exp(s - s.max(axis=1, keepdims=True))
            p = e / e.sum(axis=1, keepdims=True)
            out[t] = p @ keys[:, :kv_lora]                            # [H, L]
        return out

    def tree_build(self, logp, ids, budget):
        from kdtree.decode import tree
        return tree.tree_build(logp, ids, budget)

    def tree_accept(self, parents, tokens, target_argmax):
        from kdtree.decode import tree
        return tree.tree_accept(parents, tokens, target_argmax)
