"""`tree.policy=cost`: each round verifies the best-first prefix of its tree that maximises expected committed tokens
per second -- lossless (any tree commits the same tokens; only the forwards they take change).

A best-first tree's nodes come in non-increasing path score (the sum of the drafter's log-probs along the path), so
its first b nodes are the best b-node tree, and under the drafter's own distribution a round that verifies them
commits E(b) = 1 + sum_{i<b} exp(score_i) tokens. A verify of b + 1 rows costs t(b + 1) seconds (measured on this
model and machine: one forward per size after a short prefix when first needed, then every solo forward's own
time, smoothed), plus the round's draft. The round verifies b* = argmax_b E(b) / (t(b + 1) + draft).

Where decoding is compute-bound (the tiny model: a 33-row forward costs ~8 single-row ones) that picks a small tree;
where it is memory-bound (tiny_wide, K2.6: a verify of 9 rows costs about one step, each row of a MoE layer adding
only the experts it alone routes to -- the union a verify streams) it picks a large one. The measured t(T) already
contains the MoE union's bytes at the router's real statistics: no separate byte model to keep calibrated.
Where even the best prefix commits fewer tokens per second than plain steps (a compute-bound model whose drafter costs
more than it saves), the request takes AR steps, trying a tree round again every EXPLORE steps. Requests decoding
together share one forward, so the policy runs for a request decoding alone; batched rounds keep the configured
budget.
"""
from __future__ import annotations

import time
from typing import Dict, Tuple

import numpy as np

from kdtree.tree import Tree

SMOOTH = 0.2                 # weight of a new measurement in a size's running estimate
EXPLORE = 8                  # while plain steps are faster: one tree round every this many steps


def tree_option(tree_cfg, key: str, default):
    """tree_cfg's `key` (a DictConfig, a dict or an object with attributes), `default` where it has none."""
    get = getattr(tree_cfg, "get", None)
    return get(key, default) if get is not None else getattr(tree_cfg, key, default)


def policy_of(tree_cfg) -> str:
    policy = str(tree_option(tree_cfg, "policy", "fixed"))
    if policy not in ("fixed", "cost"):
        from kdtree.errors import ConfigError
        raise ConfigError(f"tree.policy={policy} is unknown; use tree.policy=fixed (always the whole budget) or "
                          f"tree.policy=cost (the prefix with the most expected tokens per second)")
    return policy


class ForwardCosts:
    """Seconds of a target forward by rows, measured on this model; and of a draft."""

    def __init__(self, model):
        self.model = model
        self.rows: Dict[int, float] = {}
        self.draft = 0.0
        self.tree_rate = 0.0                     # tokens per second of tree rounds (draft + verify), smoothed
        self.confidence = 1.0                    # accepted drafted tokens / the drafter's expectation, smoothed
        self.calibrated = False

    def calibrate(self, max_rows: int, repeats: int = 2) -> bool:
        """One forward of each size 1..max_rows after an 8-row prefix (the fastest of `repeats`); False when no
        cache could be had now (a full serving pool: the policy waits for a later round)."""
        try:
            cache = self.model.new_cache(8 + int(max_rows) + 1)
        except Exception:                              # CachePoolBusy (or a backend without caches)
            return False
        try:
            prefix = np.arange(8, dtype=np.int32) % 200 + 32
            self.model.forward_batch([(prefix, np.arange(8, dtype=np.int32), cache, None)])
            for T in range(1, int(max_rows) + 1):
                best = float("inf")
                for _ in range(max(1, repeats)):
                    toks = (np.arange(T, dtype=np.int32) % 200 + 40).astype(np.int32)
                    t0 = time.perf_counter()
                    self.model.forward_batch([(toks, np.arange(8, 8 + T, dtype=np.int32), cache, None)])
                    best = min(best, time.perf_counter() - t0)
                    cache.truncate(8)
                self.rows[T] = best
        finally:
            if hasattr(cache, "release"):
                cache.release()
        self.calibrated = True
        return True

    def observe(self, rows: int, seconds: float) -> None:
        old = self.rows.get(int(rows))
        self.rows[int(rows)] = seconds if old is None else (1 - SMOOTH) * old + SMOOTH * seconds

    def observe_draft(self, seconds: float) -> None:
        self.draft = seconds if not self.draft else (1 - SMOOTH) * self.draft + SMOOTH * seconds

    def observe_round(self, tokens: int, seconds: float, expected: float = 0.0) -> None:
        """A tree round committed `tokens` in `seconds`; `expected`: the drafted tokens it expected to accept."""
        if expected > 0:                         # the drafter's probabilities are not calibrated: learn how far off
            ratio = min(4.0, max(0.25, (tokens - 1) / expected))
            self.confidence = (1 - SMOOTH) * self.confidence + SMOOTH * ratio
        rate = tokens / max(seconds, 1e-9)
        self.tree_rate = rate if not self.tree_rate else (1 - SMOOTH) * self.tree_rate + SMOOTH * rate

    def prefers_ar(self) -> bool:
        """A plain step (1 / t(1), no draft) commits faster than this model's tree rounds have been."""
        return bool(self.calibrated and self.tree_rate and self.tree_rate < 1.0 / self.seconds(1))

    def seconds(self, rows: int) -> float:
        """t(rows): measured, else interpolated between the nearest measured sizes."""
        if rows in self.rows:
            return self.rows[rows]
        known = sorted(self.rows)
        lo = max((k for k in known if k < rows), default=known[0])
        hi = min((k for k in known if k > rows), default=known[-1])
        if lo == hi:
            return self.rows[lo] * rows / lo
        f = (rows - lo) / (hi - lo)
        return self.rows[lo] * (1 - f) + self.rows[hi] * f


def node_scores(tree: Tree, logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """f64[N] each node's path score (sum of the drafter's log-probs along its path)."""
    rank = [{int(t): float(lp) for t, lp in zip(ids[d], logp[d])} for d in range(ids.shape[0])]
    out = np.empty(tree.size, np.float64)
    for i, (t, p, d) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        out[i] = (out[p] if p >= 0 else 0.0) + rank[int(d) - 1].get(int(t), -np.inf)
    return out


def subtree_values(tree: Tree, p: np.ndarray) -> np.ndarray:
    """f32[N + 1]: per verify row the expected tokens its subtree commits (each node's acceptance probability p[i]
    summed over the node and its descendants); row 0, the root, inf (never pruned). Parents precede children."""
    val = np.asarray(p, np.float64).copy()
    parents = np.asarray(tree.parents)
    for i in range(tree.size - 1, -1, -1):
        if parents[i] >= 0:
            val[parents[i]] += val[i]
    return np.concatenate([[np.inf], val]).astype(np.float32)


def best_prefix(tree: Tree, logp: np.ndarray, ids: np.ndarray, costs: ForwardCosts) -> Tuple[int, float]:
    """(b*, the drafted tokens it expects to accept): b* = argmax_b (1 + c sum_{i<b} exp(score_i)) / (t(b + 1) +
    draft) over b = 0..N, c = costs.confidence (how the drafter's probabilities have matched its acceptance)."""
    drafted = np.concatenate([[0.0], np.cumsum(np.exp(node_scores(tree, logp, ids)))])
    rate = [(1.0 + costs.confidence * drafted[b]) / (costs.seconds(b + 1) + costs.draft) for b in range(tree.size + 1)]
    b = int(np.argmax(rate))
    return b, float(drafted[b])


def prefix_tree(tree: Tree, b: int) -> Tree:
    """The first b nodes (parents precede children, so it is a tree; its visibility rows need no change)."""
    if b >= tree.size:
        return tree
    words = (b + 1 + 63) // 64
    return Tree(np.array(tree.tokens[:b]), np.array(tree.parents[:b]), np.array(tree.depths[:b]),
                np.ascontiguousarray(tree.visibility[:b + 1, :words]))


__all__ = ["ForwardCosts", "best_prefix", "node_scores", "policy_of", "prefix_tree", "subtree_values"]
