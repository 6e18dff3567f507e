"""The DDTree draft tree: the numpy/Python reference of tree build, greedy accept and the packed visibility
masks (docs/engine-contracts.md, "Tree"). Low level on purpose: decode/ and backends/ both use it, it imports
nothing from kdtree.

Written for clarity; the native library (native/src/common/kd_common.c) implements the same rule and is
checked against this module bit-for-bit (tests/native/test_backend_ops.py).

    logp, ids = draft_topk(draft_logits, width)      # [depth, width] each, sorted descending
    tree = tree_build(logp, ids, budget)              # nodes in pop order, parents precede children
    path, bonus = tree_accept(tree.parents, tree.tokens, target_argmax)   # target_argmax: [N + 1]
"""
from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Tuple

import numpy as np



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


@dataclass
class Tree:
    tokens: np.ndarray      # i32[N] drafted token of each node
    parents: np.ndarray     # i32[N] parent node index, -1 = the root (the round's bonus token)
    depths: np.ndarray      # i32[N] 1-based depth; verify position = start + depth
    visibility: np.ndarray  # u64[N+1, ceil((N+1)/64)] over the verify block [root, nodes]

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self, start: int) -> np.ndarray:
        """i32[N+1] positions of the verify block [root, nodes]: root at `start`, a node at start + depth."""
        return np.concatenate([[0], self.depths]).astype(np.int32) + np.int32(start)


def draft_topk(logits: np.ndarray, width: int) -> Tuple[np.ndarray, np.ndarray]:
    """logits f32[depth, V] -> (logp f32[depth, w], ids i32[depth, w]), w = min(width, V) (width is capped
    at the vocabulary), log-softmax sorted descending; equal log-probs keep ascending token id."""
    logits = np.asarray(logits, np.float32)
    depth, V = logits.shape
    w = min(int(width), V)
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    if w <= 0 or V < 4096 or V <= 8 * w:      # short rows: one stable sort costs less than the steps below
        ids = np.argsort(-logp, axis=1, kind="stable")[:, :w].astype(np.int32)
        return np.take_along_axis(logp, ids, axis=1).astype(np.float32), ids
    # K2's vocabulary (163840) made the full sort 163 ms a round. The same first w in O(V): the w-th largest
    # log-prob of each row (a partition), every entry >= it in ascending id (ties included, so the stable order's
    # lowest ids are there), then a stable sort of those few. A row with NaNs among its top w takes the full sort.
    kth = -np.partition(-logp, w - 1, axis=1)[:, w - 1]
    ids = np.empty((depth, w), np.int32)
    for r in range(depth):
        cand = np.flatnonzero(logp[r] >= kth[r])
        if len(cand) < w:
            ids[r] = np.argsort(-logp[r], kind="stable")[:w]
        else:
            ids[r] = cand[np.argsort(-logp[r, cand], kind="stable")[:w]]
    return np.take_along_axis(logp, ids, axis=1).astype(np.float32), ids


def tree_build(logp: np.ndarray, ids: np.ndarray, budget: int) -> Tree:
    """Best-first tree over path scores (sum of log-probs along the path, in float64).

    logp f32[depth, width] (rows sorted descending), ids i32[depth, width]. Start with (depth 1, rank 0);
    pop the best node (ties: first pushed), append it, push its next sibling then its first child.
    Stop after `budget` pops or when the heap is empty.
    """
    logp = np.asarray(logp, np.float32)
    ids = np.asarray(ids, np.int32)
    if logp.shape != ids.shape or logp.ndim != 2:
        raise ValueError(f"tree_build: logp {logp.shape} and ids {ids.shape} must both be [depth, width]")
    depth, width = logp.shape
    tokens, parents, depths = [], [], []
    heap: list = []
    counter = 0
    if depth > 0 and width > 0 and budget > 0:
        # entry: (-score, push counter, depth, rank, parent node, parent's score)
        heap.append((-float(logp[0, 0]), counter, 1, 0, -1, 0.0))
        counter += 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent, base = heapq.heappop(heap)
        score = -neg
        node = len(tokens)
        tokens.append(int(ids[d - 1, r]))
        parents.append(parent)
        depths.append(d)
        if r + 1 < width:
            heapq.heappush(heap, (-(base + float(logp[d - 1, r + 1])), counter, d, r + 1, parent, base))
            counter += 1
        if d < depth:
            heapq.heappush(heap, (-(score + float(logp[d, 0])), counter, d + 1, 0, node, score))
            counter += 1
    parents_arr = np.array(parents, np.int32)
    return Tree(tokens=np.array(tokens, np.int32), parents=parents_arr, depths=np.array(depths, np.int32),
                visibility=ancestor_visibility(parents_arr))


def ancestor_visibility(parents: np.ndarray) -> np.ndarray:
    """parents i32[N] (parents precede children) -> u64[N+1, ceil((N+1)/64)]: row 0 = the root sees itself,
    row i+1 = node i sees the root, its ancestors and itself."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), bool)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return pack_visibility(mask)


@functools.lru_cache(maxsize=128)
def causal_visibility(T: int) -> np.ndarray:
    """u64[T, ceil(T/64)] causal mask: row t sees block rows 0..t (what visibility=None means). Read-only and
    cached per T: a batched decode step asks for it once per request (T = 1) and building it cost ~37 us."""
    v = pack_visibility(np.tril(np.ones((T, T), bool)))
    v.setflags(write=False)
    return v


def tree_accept(parents: np.ndarray, tokens: np.ndarray, target_argmax: np.ndarray) -> Tuple[np.ndarray, int]:
    """Greedy walk: from the root follow the first child (node order) whose token equals the target's argmax
    at the current row (row 0 = root, row i+1 = node i). Returns (path i32[k] node indices, bonus = argmax
    at the last accepted row); acceptance length = k + 1."""
    parents = np.asarray(parents, np.int32)
    tokens = np.asarray(tokens, np.int32)
    target_argmax = np.asarray(target_argmax, np.int32)
    path = []
    cur = -1
    while True:
        want = target_argmax[cur + 1]
        nxt = next((i for i in range(cur + 1, len(parents)) if parents[i] == cur and tokens[i] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    return np.array(path, np.int32), int(target_argmax[cur + 1])


__all__ = ["Tree", "draft_topk", "tree_build", "tree_accept", "ancestor_visibility", "causal_visibility",
           "pack_visibility", "unpack_visibility"]
