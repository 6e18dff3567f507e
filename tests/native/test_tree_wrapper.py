"""NativeOps.tree_build / tree_accept on per-thread preallocated buffers: every call equals the Python reference,
threads never share buffers, bad input fails with one line naming it.

Run: .venv/bin/python -m pytest -q tests/native/test_tree_wrapper.py
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kdtree.backends import native
from kdtree import tree as tree_ref
from kdtree.errors import NativeError
from tests.native_lib import needs_cpu_library

pytestmark = needs_cpu_library


def _draft(seed, depth=5, width=4):
    rng = np.random.default_rng(seed)
    logp = np.ascontiguousarray(-np.sort(-np.log(rng.dirichlet(np.ones(width), size=depth)), axis=1), np.float32)
    return logp, rng.integers(0, 1000, (depth, width)).astype(np.int32)


def _assert_tree(got, want):
    for f in ("tokens", "parents", "depths", "visibility"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)


def test_repeated_builds_equal_the_reference_and_reuse_the_buffers():
    ops = native.NativeOps("cpu")
    first = None
    for seed in range(6):
        logp, ids = _draft(seed)
        for budget in (1, 9, 40):
            tree = ops.tree_build(logp, ids, budget)
            _assert_tree(tree, tree_ref.tree_build(logp, ids, budget))
            argmax = np.arange(budget + 1, dtype=np.int32)
            path, bonus = ops.tree_accept(tree.parents, tree.tokens, argmax)
            want_path, want_bonus = tree_ref.tree_accept(tree.parents, tree.tokens, argmax)
            np.testing.assert_array_equal(path, want_path)
            assert bonus == want_bonus
        if first is None:
            first = tree
        assert tree is first                      # budget 40 of every seed: one buffer set, overwritten
    # list / float64 / non-contiguous inputs are converted by NativeOps, same tree
    logp, ids = _draft(9)
    _assert_tree(ops.tree_build(logp.astype(np.float64).tolist(), np.asfortranarray(ids), 40),
                 tree_ref.tree_build(logp, ids, 40))


def test_the_same_arrays_refilled_build_each_new_tree():
    """A decode round refills the same two arrays (draft_topk's buffers) and builds again: the repeat path (one
    pointer to a prepared kd_tree_job) sees the new contents, a new budget, and an array reshaped in place."""
    ops = native.NativeOps("cpu")
    logp, ids = _draft(0, depth=4, width=6)
    for budget in (20, 7):
        for seed in range(1, 6):
            new_logp, new_ids = _draft(seed, depth=4, width=6)
            logp[...], ids[...] = new_logp, new_ids           # in place: same objects, same memory
            _assert_tree(ops.tree_build(logp, ids, budget), tree_ref.tree_build(logp, ids, budget))
    logp.shape, ids.shape = (6, 4), (6, 4)                    # same memory, another shape
    logp[...] = -np.sort(-logp, axis=1)                       # rows sorted again for the new width
    _assert_tree(ops.tree_build(logp, ids, 7), tree_ref.tree_build(logp, ids, 7))


_TIE_VALUES = {   # the draft rows kd_tree_build's queue path (sorted rows, all <= 0) and its heap path must agree on
    "ties": [0, -0.5, -1, -np.inf, -0.0, -1.5],                      # equal path scores from different paths
    "rounding": [-1e-8, -3e-8, -1.0, -1.0000001, -2 ** -24, -16777216.0, -0.1],   # sums that round together
    "unsorted": [0, -0.5, -1, -np.inf, 0.5],                         # not sorted, a positive entry: the heap path
    "positive": [2, 1, 0, -0.5, -1, -np.inf],                        # sorted but positive: the heap path
}


@pytest.mark.parametrize("kind", ["ties", "rounding", "thirds", "dirichlet", "unsorted", "positive"])
def test_random_drafts_with_ties_build_the_reference_tree(kind):
    """Random shapes (depth, width 1..8, budget 0..300) and draft rows full of ties and rounding coincidences: the
    native build (its per-(depth, rank) queues where rows are sorted and <= 0, its heap elsewhere) pops the same
    nodes in the same order as the Python heapq reference, ties broken by push order."""
    ops = native.NativeOps("cpu")
    rng = np.random.default_rng(["ties", "rounding", "thirds", "dirichlet", "unsorted", "positive"].index(kind))
    for _ in range(150):
        D, W = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        budget = int(rng.choice([rng.integers(0, 20), rng.integers(0, 301)]))
        if kind in _TIE_VALUES:
            logp = rng.choice(np.array(_TIE_VALUES[kind], np.float32), (D, W))
        elif kind == "thirds":
            logp = -(rng.integers(0, 4, (D, W)) * np.float32(1 / 3) + rng.integers(0, 3, (D, W)) * np.float32(1e-7))
            logp[rng.random((D, W)) < 0.1] = -np.inf
        else:
            logp = np.log(rng.dirichlet(np.ones(W), size=D))
        if kind != "unsorted":
            logp = -np.sort(-logp, axis=1)
        logp = np.ascontiguousarray(logp, np.float32)
        ids = rng.integers(0, 1000, (D, W)).astype(np.int32)
        _assert_tree(ops.tree_build(logp, ids, budget), tree_ref.tree_build(logp, ids, budget))


def test_threads_build_into_their_own_buffers():
    ops = native.NativeOps("cpu")
    errors = []

    def work(seed):
        try:
            for i in range(200):
                logp, ids = _draft(seed * 1000 + i % 7)
                _assert_tree(ops.tree_build(logp, ids, 30), tree_ref.tree_build(logp, ids, 30))
        except AssertionError as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("logp,ids,budget,match", [
    (np.zeros((3, 4), np.float64), np.zeros((3, 4), np.int32), 8, "logp: dtype float64, expected float32"),
    (np.zeros((3, 4), np.float32), np.zeros((3, 5), np.int32), 8, r"logp \(3, 4\) and ids \(3, 5\) differ"),
    (np.zeros((3, 4), np.float32), np.zeros((3, 4), np.int32), -1, "budget=-1"),
    (np.zeros((4, 3), np.float32).T, np.zeros((3, 4), np.int32), 8, "not C-contiguous"),
])
def test_library_wrapper_names_bad_input(logp, ids, budget, match):
    lib = native.load_library("cpu")
    with pytest.raises(NativeError, match=match):
        lib.tree_build(logp, ids, budget)
