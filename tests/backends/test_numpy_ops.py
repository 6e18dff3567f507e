"""Numpy reference ops: each against its formula in float64, each row bit-identical whatever the number of
rows in the call (batch invariance), the packed visibility layout, INT4 weights through linear, and the
backend registry.

Run: .venv/bin/python -m pytest -q tests/backends/test_numpy_ops.py
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.backends import get_ops, register_backend
from kdtree.backends.numpy_ops import NumpyOps
from kdtree.tree import pack_visibility, unpack_visibility
from kdtree.config.schema import BackendConfig
from kdtree.errors import ConfigError

ops = NumpyOps()
rng = np.random.default_rng(0)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_linear_matches_matmul_and_is_row_invariant():
    x, w = f32(9, 96), f32(40, 96)
    y = ops.linear(x, w)
    assert np.allclose(y, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    for t in range(9):   # the same row alone, and inside a different-sized call at another offset
        assert np.array_equal(ops.linear(x[t:t + 1], w)[0], y[t])
        assert np.array_equal(ops.linear(x[max(0, t - 2):t + 1], w)[-1], y[t])


def test_linear_accepts_int4_weights_row_by_row():
    from kdtree.quant.int4 import Int4Weight, quantize_weight

    w = f32(24, 64)
    packed, scale, shape = quantize_weight(w, 32)
    q = Int4Weight.from_tensors("test.up_proj", packed, scale, shape, 32)
    x = f32(5, 64)
    y = ops.linear(x, q)
    assert y.shape == (5, 24) and y.dtype == np.float32
    assert np.allclose(y, x @ q.dequantize().T, rtol=1e-4, atol=1e-4)
    assert np.allclose(y, x @ w.T, atol=0.2 * np.abs(x @ w.T).max())   # 4-bit weights: close, not equal
    for t in range(5):
        assert np.array_equal(y[t], q.matvec(x[t]))


def test_rms_norm_formula_and_row_invariance():
    x, w = f32(6, 128) * 3, f32(128)
    y = ops.rms_norm(x, w, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    assert np.allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(ops.rms_norm(x[3:4], w, 1e-5)[0], y[3])


def test_silu_mul_formula():
    g, u = f32(4, 50) * 4, f32(4, 50)
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    y = ops.silu_mul(g, u)
    assert np.allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(ops.silu_mul(g[2:3], u[2:3])[0], y[2])


def test_visibility_bit_layout():
    mask = np.zeros((70, 70), bool)
    mask[0, 0] = True            # key 0 -> bit 0 of word 0
    mask[1, 65] = True           # key 65 -> bit 1 of word 1
    mask[2, 63] = True           # key 63 -> bit 63 of word 0
    packed = pack_visibility(mask)
    assert packed.dtype == np.uint64 and packed.shape == (70, 2)
    assert packed[0].tolist() == [1, 0]
    assert packed[1].tolist() == [0, 2]
    assert packed[2].tolist() == [1 << 63, 0]
    random = rng.random((70, 70)) < 0.5
    assert np.array_equal(unpack_visibility(pack_visibility(random), 70), random)


@pytest.mark.parametrize("n_prefix,T", [(0, 5), (7, 6), (3, 66)])
def test_mla_attention_matches_masked_softmax(n_prefix, T):
    H, L, R = 4, 32, 8
    q, kv = f32(T, H, L + R), f32(n_prefix + T, L + R)
    vis = rng.random((T, T)) < 0.4
    vis[np.arange(T), np.arange(T)] = True
    scale = 0.3
    got = ops.mla_attention(q, kv, n_prefix, pack_visibility(vis), scale, L)
    mask = np.concatenate([np.ones((T, n_prefix), bool), vis], axis=1)            # [T, S]
    s = np.einsum("thd,sd->ths", q.astype(np.float64), kv.astype(np.float64)) * scale
    s = np.where(mask[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("ths,sl->thl", p, kv[:, :L].astype(np.float64))
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-5), np.abs(got - ref).max()
    causal = ops.mla_attention(q, kv, n_prefix, None, scale, L)
    assert np.array_equal(causal, ops.mla_attention(q, kv, n_prefix, pack_visibility(np.tril(np.ones((T, T), bool))),
                                                    scale, L))


def test_get_ops_registry():
    assert isinstance(get_ops(BackendConfig(name="numpy")), NumpyOps)
    assert isinstance(get_ops("numpy"), NumpyOps)
    with pytest.raises(ConfigError, match="backend=nope is not available"):
        get_ops("nope")
    register_backend("test_numpy_alias", lambda cfg: NumpyOps())
    assert isinstance(get_ops("test_numpy_alias"), NumpyOps)


def test_tree_ops_delegate_to_the_tree_module():
    logp = np.log(np.array([[0.6, 0.3], [0.7, 0.2]], np.float32))
    ids = np.array([[5, 6], [7, 8]], np.int32)
    tree = ops.tree_build(logp, ids, 3)
    assert tree.tokens.tolist()[:1] == [5]
    path, bonus = ops.tree_accept(tree.parents, tree.tokens, np.array([5] + [7] * len(tree.tokens), np.int32))
    assert [int(tree.tokens[i]) for i in path][:1] == [5]
