"""Numpy reference backend: float32, written for clarity, the ground truth for every other backend.

Batch invariance by construction: every op computes each row with the identical floating-point sequence
whatever T is, so the same row in a 1-row call and in a T-row call gives bit-identical results:
  * linear: one GEMV per row, issued from C by a stacked matmul (`w @ x[t]` for every t, never one GEMM
    over T rows; numpy's matmul calls BLAS once per stacked item, with the item's fixed shape);
  * rms_norm, silu_mul: element-wise ufuncs and a per-row reduction along the contiguous last axis
    (numpy reduces each row with the same pairwise routine whatever the number of rows);
  * attention: per row, the row's visible keys in ascending position order, its own softmax and weighted sum.
tests/backends/test_numpy_ops.py checks each op row by row against 1-row calls for many T.
`linear_fast` (the drafter's path) is a plain GEMM: deterministic but NOT batch invariant.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kdtree import tree
from kdtree.backends.base import Ops
from kdtree.tree import unpack_visibility


class NumpyOps(Ops):
    name = "numpy"

    def linear(self, x: np.ndarray, w: Any) -> np.ndarray:
        # x: [T, in] -> [T, out], one GEMV per row (never one GEMM over T rows)
        x = np.ascontiguousarray(x, np.float32)
        if isinstance(w, np.ndarray):
            T = x.shape[0]
            if w.dtype != np.float32:
                w = np.asarray(w, np.float32)
            # stacked matmul [out, in] @ [T, in, 1]: numpy loops over the T items in C, each one the same
            # GEMV `w @ x[t]` as a 1-row call (tests/backends/test_numpy_ops.py checks it bit for bit)
            return np.matmul(w, x.reshape(T, -1, 1)).reshape(T, w.shape[0])
        if hasattr(w, "linear"):  # Int4Weight.linear: row t computed exactly as matvec(x[t]), unpacked once
            return np.asarray(w.linear(x), np.float32)
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        for t in range(x.shape[0]):
            out[t] = w.matvec(x[t])
        return out

    def linear_fast(self, x: np.ndarray, w: Any) -> np.ndarray:
        """One GEMM over all rows (the drafter's path): deterministic, NOT batch invariant."""
        if isinstance(w, np.ndarray) and w.dtype == np.float32:
            return np.asarray(x, np.float32) @ w.T
        return self.linear(x, w)

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        # x: [T, D]; per row r * (1 / sqrt(mean(r * r) + eps)) * w, the mean reduced along the last axis
        x = np.ascontiguousarray(x, np.float32)
        one = np.float32(1.0)
        ms = np.add.reduce(x * x, axis=-1, keepdims=True) / np.float32(x.shape[-1])   # row-wise pairwise sum
        return x * (one / np.sqrt(ms + np.float32(eps))) * w

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        # gate, up: [T, I] -> gate / (1 + exp(-gate)) * up, element-wise
        gate = np.ascontiguousarray(gate, np.float32)
        one = np.float32(1.0)
        return gate / (one + np.exp(-gate)) * up

    def mla_attention(self, q: np.ndarray, kv: np.ndarray, n_prefix: int, visibility: Optional[np.ndarray],
                      scale: float, kv_lora: int) -> np.ndarray:
        # q: [T, H, L+R], kv: [n_prefix + T, L+R] -> o_lat [T, H, L]
        T, H, _ = q.shape
        assert kv.shape[0] == n_prefix + T, (kv.shape, n_prefix, T)
        out = np.empty((T, H, kv_lora), np.float32)
        rows = None if visibility is None else self._key_rows(visibility, T, n_prefix)
        scale = np.float32(scale)
        kv = np.ascontiguousarray(kv, np.float32)
        for t in range(T):
            if rows is None:
                keys = kv[:n_prefix + t + 1]                          # causal: the rows themselves, no copy
            else:
                keys = kv[rows[t]]                                    # [n, L+R], ascending positions
            s = q[t] @ keys.T                                         # [H, n]
            s *= scale
            s -= s.max(axis=1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=1, keepdims=True)
            np.matmul(s, keys[:, :kv_lora], out=out[t])               # [H, L]
        return out

    def _key_rows(self, visibility: np.ndarray, T: int, n_prefix: int):
        """Per query row, its visible kv rows (cache, then visible block rows, ascending); the last block's
        lists are reused by the next layers of the same forward (same visibility bytes and prefix)."""
        vis = np.ascontiguousarray(visibility, dtype="<u8")
        key = (T, n_prefix, vis.tobytes())
        hit = self._rows_cache                                        # one read: safe across threads
        if hit is not None and hit[0] == key:
            return hit[1]
        mask = unpack_visibility(vis, T)
        prefix = np.arange(n_prefix)
        rows = [np.concatenate([prefix, n_prefix + np.flatnonzero(mask[t])]) for t in range(T)]
        self._rows_cache = (key, rows)
        return rows

    _rows_cache = None

    def tree_build(self, logp, ids, budget):
        return tree.tree_build(logp, ids, budget)

    def tree_accept(self, parents, tokens, target_argmax):
        return tree.tree_accept(parents, tokens, target_argmax)
