"""YaRN RoPE of Kimi K2.6 (factor 64, original context 4096, beta 32/1, theta 50000, rope dim 64):
inv_freq, cos/sin magnitude and softmax scale against numbers worked out by hand here; the interleaved
rotation gives HF's scores; cos/sin of a position never depends on the other positions in the call.

Run: .venv/bin/python -m pytest -q tests/model/test_rope.py
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.model.rope import RotaryTable, apply_rope, rope_mscale, softmax_scale, yarn_inv_freq

from tests.checkpoint.configs import model_cfg as load_model_cfg


@pytest.fixture(scope="module")
def k26():
    return load_model_cfg("k26")


def test_k26_correction_range_by_hand():
    # dim(r) = 64 * ln(4096 / (2*pi*r)) / (2 * ln 50000)
    low = 64 * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(50000))   # 8.91...
    high = 64 * math.log(4096 / (2 * math.pi * 1)) / (2 * math.log(50000))   # 19.16...
    assert (math.floor(low), math.ceil(high)) == (8, 20)


def test_k26_inv_freq_by_hand(k26):
    inv = yarn_inv_freq(k26)
    assert inv.shape == (32,)
    extra = lambda i: 50000.0 ** (-2 * i / 64)       # noqa: E731  original RoPE frequency
    # low = 8, high = 20: index <= 8 keeps the original frequency, >= 20 is divided by the factor 64,
    # in between a linear ramp (i - 8) / 12 moves from extrapolation to interpolation.
    expected = {
        0: 1.0,
        4: extra(4),
        8: extra(8),
        11: (1 - 3 / 12) * extra(11) + (3 / 12) * extra(11) / 64,
        14: 0.5 * extra(14) + 0.5 * extra(14) / 64,
        19: (1 - 11 / 12) * extra(19) + (11 / 12) * extra(19) / 64,
        20: extra(20) / 64,
        31: 50000.0 ** (-62 / 64) / 64,
    }
    for i, want in expected.items():
        assert inv[i] == pytest.approx(want, rel=1e-12), i
    assert inv[31] == pytest.approx(4.3822e-07, rel=1e-4)


def test_k26_softmax_scale_and_mscale_by_hand(k26):
    # mscale == mscale_all_dim == 1: cos/sin unscaled; softmax scale = 192^-0.5 * (0.1 * ln 64 + 1)^2
    assert rope_mscale(k26) == 1.0
    assert softmax_scale(k26) == pytest.approx((1 / math.sqrt(192)) * (0.1 * math.log(64) + 1) ** 2, rel=1e-12)
    assert softmax_scale(k26) == pytest.approx(0.144681, rel=1e-5)


def test_mscale_ratio_when_mscales_differ(k26):
    cfg = OmegaConf.merge(k26, {"rope_scaling": {"mscale": 0.707, "mscale_all_dim": 0.707}})
    assert rope_mscale(cfg) == pytest.approx(1.0)
    cfg = OmegaConf.merge(k26, {"rope_scaling": {"mscale": 0.5, "mscale_all_dim": 1.0}})
    assert rope_mscale(cfg) == pytest.approx((0.05 * math.log(64) + 1) / (0.1 * math.log(64) + 1), rel=1e-12)
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2, rel=1e-12)


def test_no_yarn_without_scaling(k26):
    cfg = OmegaConf.merge(k26, {"rope_scaling": {"factor": 1.0}})
    assert np.allclose(yarn_inv_freq(cfg), 50000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-12)
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5)


def test_interleaved_rotation_gives_hf_scores_and_depends_on_distance_only(k26):
    """q·k after interleaved RoPE == HF's de-interleave + rotate_half q·k, and only m - n matters."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 64)).astype(np.float32)
    table = RotaryTable(k26)

    def ours(x, pos):
        c, s = table.cos_sin(np.array([pos]))
        return apply_rope(x, c, s)[0].astype(np.float64)

    def hf(x, pos):
        x = x[0].astype(np.float64)
        x = np.concatenate([x[0::2], x[1::2]])
        ang = pos * yarn_inv_freq(k26)
        cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
        return x * cos + np.concatenate([-x[32:], x[:32]]) * sin

    for m, n in [(7, 3), (5000, 10), (200000, 199000)]:
        assert ours(q, m) @ ours(k, n) == pytest.approx(hf(q, m) @ hf(k, n), rel=1e-4, abs=1e-4)
    assert ours(q, 1007) @ ours(k, 1000) == pytest.approx(ours(q, 7) @ ours(k, 0), rel=1e-4, abs=1e-4)


def test_cos_sin_of_a_position_is_the_same_in_any_call(k26):
    table = RotaryTable(k26)
    positions = np.array([0, 5, 1023, 1024, 3000, 262143])
    c_all, s_all = table.cos_sin(positions)
    for i, p in enumerate(positions):
        c, s = RotaryTable(k26).cos_sin(np.array([p]))
        assert np.array_equal(c[0], c_all[i]) and np.array_equal(s[0], s_all[i])
