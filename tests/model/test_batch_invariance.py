"""Exact batch invariance of the restructured forward (MoE grouped by expert, routing over all rows at once,
absorbed q/o as one batched matmul, vectorised numpy ops): every row of a T-row forward -- logits, hidden
states and latent-cache rows -- is bit-identical to one-row forwards, for T up to 33 (every expert active),
on numpy and the native cpu backend, fp32 and INT4 experts; and the per-op numpy kernels row by row.

Run: .venv/bin/python -m pytest -q tests/model/test_batch_invariance.py
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.backends import get_ops
from kdtree.backends.numpy_ops import NumpyOps
from kdtree.model.k2 import K2Model, route, route_rows
from kdtree.model.target import build_target
from tests.native_lib import CPU_SKIPPED, needs_cpu_library
from tests.weights import int4_experts

PROMPT = np.array([256, 50, 43, 50, 61], np.int32)


def _backends():
    return ["numpy"] if CPU_SKIPPED else ["numpy", "cpu"]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_block_rows_equal_one_row_forwards(tiny_cfg, tiny_weights, backend, quant):
    weights = int4_experts(tiny_weights) if quant == "int4" else tiny_weights
    m = build_target(tiny_cfg, weights, get_ops(backend))   # backend=cpu: the native whole forward
    layers = tuple(range(tiny_cfg.num_hidden_layers))
    block = np.random.default_rng(3).integers(0, 260, 33).astype(np.int32)
    pos = len(PROMPT) + np.arange(len(block))

    def prefilled():
        c = m.new_cache(128)
        m.forward(PROMPT, np.arange(len(PROMPT)), c)
        return c

    c1 = prefilled()
    lg, hid = m.forward(block, pos, c1, hidden_layers=layers)
    c2 = prefilled()
    rows = [m.forward(block[i:i + 1], pos[i:i + 1], c2, hidden_layers=layers) for i in range(len(block))]
    np.testing.assert_array_equal(lg, np.concatenate([r[0] for r in rows]))
    for layer in layers:
        np.testing.assert_array_equal(hid[layer], np.concatenate([r[1][layer] for r in rows]))
        np.testing.assert_array_equal(c1.kv[layer][:c1.length], c2.kv[layer][:c2.length])
    # and a middle slice of the block as its own forward (rows at other offsets, other expert groupings)
    c3 = prefilled()
    m.forward(block[:9], pos[:9], c3)
    lg3, _ = m.forward(block[9:20], pos[9:20], c3)
    np.testing.assert_array_equal(lg3, lg[9:20])


def test_route_rows_equals_route_per_row(tiny_cfg):
    for n_group, topk_group, k in [(1, 1, 2), (4, 2, 3), (2, 1, 8)]:
        cfg = tiny_cfg.copy()
        cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok = 16, n_group, topk_group, k
        rng = np.random.default_rng(k)
        scores = (1 / (1 + np.exp(-rng.standard_normal((37, 16))))).astype(np.float32)
        scores[5] = scores[6] = 0.5                                   # ties
        bias = (0.1 * rng.standard_normal(16)).astype(np.float32)
        experts, weights = route_rows(cfg, scores, bias)
        for t in range(37):
            e1, w1 = route(cfg, scores[t], bias)
            assert experts[t].tolist() == e1.tolist()
            np.testing.assert_array_equal(weights[t], w1)


@pytest.mark.parametrize("n_in,n_out", [(128, 256), (256, 128), (128, 40), (64, 192), (40, 7)])
def test_numpy_ops_rows_independent_of_T(n_in, n_out):
    ops = NumpyOps()
    rng = np.random.default_rng(n_in + n_out)
    x = (3 * rng.standard_normal((40, n_in))).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(n_in)).astype(np.float32)
    one = {"linear": np.stack([ops.linear(x[t:t + 1], w)[0] for t in range(40)]),
           "rms_norm": np.stack([ops.rms_norm(x[t:t + 1], nw, 1e-5)[0] for t in range(40)]),
           "silu_mul": np.stack([ops.silu_mul(x[t:t + 1], x[39 - t:40 - t])[0] for t in range(40)])}
    for T in (2, 3, 7, 8, 9, 16, 33, 40):
        for s in sorted({0, 40 - T, (40 - T) // 2}):
            np.testing.assert_array_equal(ops.linear(x[s:s + T], w), one["linear"][s:s + T])
            np.testing.assert_array_equal(ops.rms_norm(x[s:s + T], nw, 1e-5), one["rms_norm"][s:s + T])
            np.testing.assert_array_equal(ops.silu_mul(x[s:s + T], x[::-1][s:s + T]), one["silu_mul"][s:s + T])


@needs_cpu_library
def test_fused_moe_equals_grouped_path(tiny_cfg, tiny_weights):
    """backend=cpu runs each MoE layer as one kd_moe_f32 call; it gives the grouped Python path's bits."""
    fused_ops, plain_ops = get_ops("cpu"), get_ops("cpu")
    fused_ops.native_forward = plain_ops.native_forward = False   # the per-op path (one call per op)
    plain_ops.moe = lambda *a, **k: None
    fused, plain = K2Model(tiny_cfg, tiny_weights, fused_ops), K2Model(tiny_cfg, tiny_weights, plain_ops)
    calls = []
    inner = fused_ops.moe
    fused_ops.moe = lambda *a: calls.append(inner(*a)) or calls[-1]
    block = np.random.default_rng(4).integers(0, 260, 21).astype(np.int32)
    pos = np.arange(len(block))
    c1, c2 = fused.new_cache(64), plain.new_cache(64)
    lg1, h1 = fused.forward(block, pos, c1, hidden_layers=(0, 1, 2, 3))
    lg2, h2 = plain.forward(block, pos, c2, hidden_layers=(0, 1, 2, 3))
    assert calls and all(c is not None for c in calls)
    np.testing.assert_array_equal(lg1, lg2)
    for i in h1:
        np.testing.assert_array_equal(h1[i], h2[i])
    one, _ = fused.forward(block[:1], pos[:1], fused.new_cache(8))
    np.testing.assert_array_equal(one[0], lg1[0])


def test_rope_apply_equals_apply_rope_bitwise():
    from kdtree.model.k2 import rope_apply, rope_tables
    from kdtree.model.rope import apply_rope
    rng = np.random.default_rng(5)
    cos = rng.standard_normal((9, 4)).astype(np.float32)
    sin = rng.standard_normal((9, 4)).astype(np.float32)
    sin[0, 0] = 0.0
    for shape in [(9, 8), (9, 3, 8)]:
        x = (10 * rng.standard_normal(shape)).astype(np.float32)
        x[0, ..., :2] = [0.0, -0.0]
        np.testing.assert_array_equal(rope_apply(x, *rope_tables(cos, sin)), apply_rope(x, cos, sin))
        view = np.concatenate([x, x], axis=-1)[..., 3:11]                  # a strided view
        np.testing.assert_array_equal(rope_apply(view, *rope_tables(cos, sin)), apply_rope(view, cos, sin))
