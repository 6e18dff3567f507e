"""K2Model.forward_batch: rows of several sequences in one forward (a tree verify, a prefill chunk, an AR row),
each attending only to its own latent cache; every row's logits, hidden states and cache rows are the same bits
as its sequence's forward alone, on numpy and the native cpu backend, fp32 and INT4 experts.

Run: .venv/bin/python -m pytest -q tests/model/test_forward_batch.py
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.backends import get_ops
from kdtree.model.target import build_target
from kdtree.tree import pack_visibility
from tests.model.test_batch_invariance import _backends
from tests.weights import int4_experts

LAYERS = (0, 1, 3)


def _tree_visibility(parents):
    """Block [root, nodes] with node i's parent parents[i] (-1 = root) -> packed ancestor-only visibility."""
    T = len(parents) + 1
    vis = np.zeros((T, T), bool)
    vis[:, 0] = True
    for i in range(T):
        j = i
        while j > 0:
            vis[i, j] = True
            j = parents[j - 1] + 1
    return pack_visibility(vis)


def _sequences(rng):
    """(prefix tokens in the cache, then this forward's tokens, positions, visibility) of four sequences."""
    parents = [-1, 0, 0, 1, -1, 4, 2]
    depths = [1, 2, 2, 3, 1, 2, 3]
    return [
        (rng.integers(0, 260, 11), rng.integers(0, 260, 8), 11 + np.array([0] + depths), _tree_visibility(parents)),
        (np.zeros(0, np.int64), rng.integers(0, 260, 13), np.arange(13), None),          # a prefill chunk
        (rng.integers(0, 260, 5), rng.integers(0, 260, 1), np.array([5]), None),           # an AR step
        (rng.integers(0, 260, 70), rng.integers(0, 260, 6), 70 + np.arange(6), None),     # a later chunk
    ]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_batched_rows_equal_each_sequence_alone(tiny_cfg, tiny_weights, backend, quant):
    weights = int4_experts(tiny_weights) if quant == "int4" else tiny_weights
    m = build_target(tiny_cfg, weights, get_ops(backend))   # backend=cpu: the native whole forward
    seqs = _sequences(np.random.default_rng(5))

    def prefilled(prefix):
        c = m.new_cache(96)
        if len(prefix):
            m.forward(prefix, np.arange(len(prefix)), c)
        return c

    alone = []
    for prefix, toks, pos, vis in seqs:
        c = prefilled(prefix)
        lg, hid = m.forward(toks, pos, c, visibility=vis, hidden_layers=LAYERS)
        alone.append((lg, hid, c))
    caches = [prefilled(s[0]) for s in seqs]
    lg, argmax, hid = m.forward_batch([(t, p, c, v) for (_, t, p, v), c in zip(seqs, caches)], LAYERS)
    np.testing.assert_array_equal(lg, np.concatenate([a[0] for a in alone]))
    np.testing.assert_array_equal(argmax, np.argmax(lg, axis=-1))
    for layer in LAYERS:
        np.testing.assert_array_equal(hid[layer], np.concatenate([a[1][layer] for a in alone]))
    for (_, _, c_alone), c in zip(alone, caches):
        assert c.length == c_alone.length
        for i in range(tiny_cfg.num_hidden_layers):
            np.testing.assert_array_equal(c.kv[i][:c.length], c_alone.kv[i][:c.length])


def test_two_sequences_sharing_one_cache_are_refused(tiny_model):
    c = tiny_model.new_cache(16)
    one = (np.array([1, 2]), np.array([0, 1]), c, None)
    with pytest.raises(ValueError, match="share one cache"):
        tiny_model.forward_batch([one, one])
