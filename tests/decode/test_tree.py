"""kdtree/tree.py against an independent path-based heapq tree builder, and accept-walk edge cases.

    .venv/bin/python -m pytest -q tests/decode/test_tree.py
"""
from __future__ import annotations

import heapq

import numpy as np
import pytest

from kdtree.tree import causal_visibility, draft_topk, tree_accept, tree_build, unpack_visibility


def heapq_tree(logp: np.ndarray, ids: np.ndarray, budget: int):
    """Straightforward best-first search over rank paths: a node is its tuple of ranks, its score the float64
    sum of its log-probs summed from depth 1 down; ties pop in push order."""
    depth, width = logp.shape

    def score(path):
        s = 0.0
        for d, r in enumerate(path):
            s += float(logp[d, r])
        return s

    heap, counter, order = [], 0, []
    if depth and width and budget:
        heap = [(-score((0,)), 0, (0,))]
        counter = 1
    while heap and len(order) < budget:
        _, _, path = heapq.heappop(heap)
        order.append(path)
        for nxt in ([path[:-1] + (path[-1] + 1,)] if path[-1] + 1 < width else []) + \
                   ([path + (0,)] if len(path) < depth else []):
            heapq.heappush(heap, (-score(nxt), counter, nxt))
            counter += 1
    index = {p: i for i, p in enumerate(order)}
    tokens = [int(ids[len(p) - 1, p[-1]]) for p in order]
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in order]
    return np.array(tokens, np.int32), np.array(parents, np.int32), np.array([len(p) for p in order], np.int32)


def random_draft(rng, depth, width, ties=False):
    logp = np.log(rng.dirichlet(np.ones(width) * 0.5, size=depth)).astype(np.float32)
    if ties:  # a few distinct levels: many equal path scores, exercising the FIFO tie rule
        logp = np.round(logp * 2) / 2
    logp = -np.sort(-logp, axis=1)
    ids = rng.integers(0, 1000, (depth, width)).astype(np.int32)
    return np.ascontiguousarray(logp, np.float32), ids


def check_tree(logp, ids, budget):
    tree = tree_build(logp, ids, budget)
    tokens, parents, depths = heapq_tree(logp, ids, budget)
    np.testing.assert_array_equal(tree.tokens, tokens)
    np.testing.assert_array_equal(tree.parents, parents)
    np.testing.assert_array_equal(tree.depths, depths)
    n = len(tokens)
    # visibility: root sees itself, node i sees the root, its ancestors and itself (and nothing else)
    vis = unpack_visibility(tree.visibility, n + 1)
    assert tree.visibility.shape == (n + 1, (n + 1 + 63) // 64)
    want = np.zeros((n + 1, n + 1), bool)
    want[0, 0] = True
    for i in range(n):
        a = i
        while a >= 0:
            want[i + 1, a + 1] = True
            a = parents[a]
        want[i + 1, 0] = True
    np.testing.assert_array_equal(vis, want)
    assert all(parents[i] < i for i in range(n))
    return tree


@pytest.mark.parametrize("depth,width,budget", [(7, 4, 32), (3, 8, 64), (5, 1, 3), (1, 6, 4), (4, 5, 200),
                                                (2, 3, 100), (6, 8, 512), (8, 2, 70)])
@pytest.mark.parametrize("ties", [False, True])
def test_tree_build_matches_heapq(depth, width, budget, ties):
    rng = np.random.default_rng(depth * 1000 + width * 10 + budget + ties)
    for _ in range(3):
        logp, ids = random_draft(rng, depth, width, ties)
        check_tree(logp, ids, budget)


def test_all_equal_scores_pop_in_push_order():
    logp = np.zeros((3, 3), np.float32)   # every path scores 0: pure FIFO
    ids = np.arange(9, dtype=np.int32).reshape(3, 3)
    tree = check_tree(logp, ids, 10)
    assert tree.tokens.tolist()[:4] == [0, 1, 3, 2]


def test_budget_zero_and_depth_one():
    logp, ids = random_draft(np.random.default_rng(0), 1, 5)
    empty = tree_build(logp, ids, 0)
    assert empty.tokens.shape == (0,) and empty.visibility.tolist() == [[1]]
    tree = check_tree(logp, ids, 3)
    assert tree.depths.tolist() == [1, 1, 1] and tree.parents.tolist() == [-1, -1, -1]
    assert tree.tokens.tolist() == ids[0, :3].tolist()
    # budget larger than the whole tree: every node once, then the heap is empty
    assert check_tree(logp, ids, 50).size == 5


def test_width_above_vocab_is_capped():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 5)).astype(np.float32)   # V = 5
    logp, ids = draft_topk(logits, 9)
    assert logp.shape == ids.shape == (4, 5)
    assert sorted(ids[0].tolist()) == list(range(5))
    assert (np.diff(logp, axis=1) <= 0).all()
    np.testing.assert_allclose(np.exp(logp).sum(axis=1), 1.0, rtol=1e-5)
    check_tree(logp, ids, 40)


def test_causal_visibility_many_words():
    vis = unpack_visibility(causal_visibility(130), 130)
    np.testing.assert_array_equal(vis, np.tril(np.ones((130, 130), bool)))


def test_visibility_spans_words():
    logp, ids = random_draft(np.random.default_rng(5), 6, 4)
    assert check_tree(logp, ids, 150).visibility.shape == (151, 3)


# ---- accept walk ------------------------------------------------------------------------------------------
#   root ── 0 (tok 10) ── 2 (tok 30) ── 4 (tok 50)
#        └─ 1 (tok 20) ── 3 (tok 40)
#                      └─ 5 (tok 41)
TOKENS = np.array([10, 20, 30, 40, 50, 41], np.int32)
PARENTS = np.array([-1, -1, 0, 1, 2, 1], np.int32)


def argmax_rows(**rows):
    a = np.full(len(PARENTS) + 1, 99, np.int32)  # 99 matches nothing
    for r, v in rows.items():
        a[int(r[1:])] = v
    return a


def test_accept_no_child_matches():
    path, bonus = tree_accept(PARENTS, TOKENS, argmax_rows(r0=7))
    assert path.tolist() == [] and bonus == 7   # acceptance length 1


def test_accept_deepest_node_full_path():
    path, bonus = tree_accept(PARENTS, TOKENS, argmax_rows(r0=10, r1=30, r3=50, r5=8))
    assert path.tolist() == [0, 2, 4] and bonus == 8   # acceptance length 4


def test_accept_non_first_sibling():
    path, bonus = tree_accept(PARENTS, TOKENS, argmax_rows(r0=20, r2=41, r6=5))
    assert path.tolist() == [1, 5] and bonus == 5


def test_accept_first_matching_child_in_node_order():
    parents = np.array([-1, -1], np.int32)
    tokens = np.array([3, 3], np.int32)   # duplicate tokens: the earlier node wins
    path, bonus = tree_accept(parents, tokens, np.array([3, 6, 7], np.int32))
    assert path.tolist() == [0] and bonus == 6


def test_accept_empty_tree():
    path, bonus = tree_accept(np.zeros(0, np.int32), np.zeros(0, np.int32), np.array([4], np.int32))
    assert path.tolist() == [] and bonus == 4


def _topk_by_full_sort(logits, width):
    """draft_topk's definition: log-softmax, one stable descending sort of the whole row, the first w."""
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    ids = np.argsort(-logp, axis=1, kind="stable")[:, :min(width, logits.shape[1])].astype(np.int32)
    return np.take_along_axis(logp, ids, axis=1), ids


@pytest.mark.parametrize("V", [260, 5000, 163840])
def test_draft_topk_large_vocab_equals_the_full_stable_sort(V):
    """K2's vocabulary takes the O(V) path (partition, then the entries at or above the w-th value in id order):
    the same ids and log-probs as the full stable sort, also with ties across the w-th place and NaN rows."""
    rng = np.random.default_rng(V)
    logits = rng.standard_normal((7, V)).astype(np.float32)
    logits[1, rng.choice(V, 9, replace=False)] = logits[1].max() + 1.0        # 9 equal maxima: ties past w = 4
    logits[2, :] = 0.5                                                        # a flat row: the lowest ids
    logits[3, rng.choice(V, V - 2, replace=False)] = np.nan                   # NaNs fill the top: full-sort fallback
    logits[4, 7] = np.float32(3e38)                                           # z of the rest rounds to one value
    for width in (1, 4, 10):
        with np.errstate(invalid="ignore", over="ignore"):
            logp, ids = draft_topk(logits, width)
            want_logp, want_ids = _topk_by_full_sort(logits, width)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(logp, want_logp)
