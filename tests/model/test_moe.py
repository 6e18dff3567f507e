"""Sigmoid noaux_tc routing: selection by score + e_score_correction_bias, weights from the unbiased
sigmoid score, normalised and scaled; group-limited top-k; ties to the lower expert index; and the MoE
layer output is the weighted sum of the selected experts plus the unscaled shared expert.

Run: .venv/bin/python -m pytest -q tests/model/test_moe.py
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.model.k2 import route


def restated_route(scores, bias, k, n_group, topk_group, rsf, norm):
    """The formula written out with Python lists (DeepSeek-V3 MoEGate, noaux_tc)."""
    E = len(scores)
    choice = [float(scores[e]) + float(bias[e]) for e in range(E)]
    size = E // n_group
    if n_group > 1:
        gscore = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        keep = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        choice = [c if e // size in keep else 0.0 for e, c in enumerate(choice)]
    top = sorted(range(E), key=lambda e: (-choice[e], e))[:k]
    w = [float(scores[e]) for e in top]
    if norm:
        total = sum(w) + 1e-20
        w = [x / total for x in w]
    return top, [x * rsf for x in w]


@pytest.mark.parametrize("n_group,topk_group,k", [(1, 1, 2), (1, 1, 4), (4, 2, 3), (4, 1, 2)])
def test_route_equals_restated_formula(tiny_cfg, n_group, topk_group, k):
    cfg = tiny_cfg.copy()
    cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok = 16, n_group, topk_group, k
    rng = np.random.default_rng(n_group * 10 + k)
    for _ in range(50):
        scores = (1 / (1 + np.exp(-rng.standard_normal(16)))).astype(np.float32)
        bias = (0.1 * rng.standard_normal(16)).astype(np.float32)
        experts, weights = route(cfg, scores, bias)
        top, w = restated_route(scores, bias, k, n_group, topk_group, cfg.routed_scaling_factor, True)
        assert experts.tolist() == top
        assert weights.dtype == np.float32
        assert np.allclose(weights, w, rtol=1e-6)


def test_bias_selects_but_weights_are_unbiased_scores(tiny_cfg):
    scores = np.array([0.9, 0.8, 0.3, 0.2, 0.7, 0.6, 0.5, 0.1], np.float32)
    bias = np.array([0, 0, 0, 1.0, 0, 0, 0, 0.85], np.float32)   # lifts experts 3 and 7 above all others
    experts, weights = route(tiny_cfg, scores, bias)
    assert experts.tolist() == [3, 7]                            # biased choice 1.2 > 0.95 > 0.9
    expected = np.array([0.2, 0.1]) / 0.3 * tiny_cfg.routed_scaling_factor
    assert np.allclose(weights, expected, rtol=1e-6)
    assert route(tiny_cfg, scores, np.zeros(8, np.float32))[0].tolist() == [0, 1]


def test_ties_go_to_the_lower_expert_index(tiny_cfg):
    scores = np.full(8, 0.5, np.float32)
    experts, weights = route(tiny_cfg, scores, np.zeros(8, np.float32))
    assert experts.tolist() == [0, 1]
    assert np.allclose(weights, [tiny_cfg.routed_scaling_factor / 2] * 2)


def test_moe_layer_output_is_weighted_experts_plus_shared(tiny_cfg, tiny_weights, tiny_model):
    """Bias chosen so the lowest-scoring experts win: the layer must weight them by their own sigmoid scores."""
    cfg, m = tiny_cfg, tiny_model
    layer = 2
    p = f"model.layers.{layer}.mlp"
    W = {k: v.astype(np.float64) for k, v in tiny_weights.items() if k.startswith(p)}
    x = np.random.default_rng(5).standard_normal((1, cfg.hidden_size)).astype(np.float32)
    s = 1 / (1 + np.exp(-(W[f"{p}.gate.weight"] @ x[0].astype(np.float64))))
    losers = np.argsort(s)[:2]                                   # the two lowest scores
    moe = m.layers[layer]["moe"]
    saved = moe.bias
    moe.bias = np.zeros(cfg.n_routed_experts, np.float32)
    moe.bias[losers] = [2.0, 1.5]
    try:
        got = m._moe(moe, x)[0]
    finally:
        moe.bias = saved

    def mlp(q, v):
        g, u = W[f"{q}.gate_proj.weight"] @ v, W[f"{q}.up_proj.weight"] @ v
        return W[f"{q}.down_proj.weight"] @ (g / (1 + np.exp(-g)) * u)

    xd = x[0].astype(np.float64)
    w = s[losers] / s[losers].sum() * cfg.routed_scaling_factor
    ref = sum(we * mlp(f"{p}.experts.{e}", xd) for e, we in zip(losers, w)) + mlp(f"{p}.shared_experts", xd)
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-5), np.abs(got - ref).max()
    # The same layer without the bias picks other experts, so the output really changed.
    assert not np.allclose(m._moe(moe, x)[0], ref, rtol=1e-3, atol=1e-4)
