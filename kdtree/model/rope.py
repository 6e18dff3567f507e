"""YaRN rotary position embedding of the K2 target, with DeepSeek-V3's formulas.

The inverse frequencies, the cos/sin magnitude (`yarn_get_mscale(factor, mscale) /
yarn_get_mscale(factor, mscale_all_dim)`) and the attention softmax scale are written exactly as in
HF `DeepseekV3YarnRotaryEmbedding` / `DeepseekV3Attention`. The rotation acts on *interleaved* pairs
(x[2i], x[2i+1]) and keeps them interleaved: HF de-interleaves and uses rotate_half, which is the same
rotation up to one permutation applied to both q and k, so every score q·k is the same.

cos/sin are computed in float64 and rounded to float32 once, in fixed-size blocks of positions, so the
value used for a position never depends on which other positions are in the call (batch invariance).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np

_BLOCK = 1024  # positions per cos/sin table block: every block is computed by the same call shape


def yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_position_embeddings: int) -> float:
    """The rope dimension whose wavelength fits `num_rotations` times into the original context."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(low_rot: float, high_rot: float, dim: int, base: float,
                               max_position_embeddings: int) -> Tuple[int, int]:
    low = math.floor(yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
    high = math.ceil(yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_linear_ramp_mask(low: float, high: float, dim: int) -> np.ndarray:
    if low == high:
        high += 0.001  # prevent singularity
    linear = (np.arange(dim, dtype=np.float64) - low) / (high - low)
    return np.clip(linear, 0.0, 1.0)


def _uses_yarn(cfg) -> bool:
    rs = cfg.rope_scaling
    return rs is not None and str(rs.type) == "yarn" and float(rs.factor) > 1.0


def yarn_inv_freq(cfg) -> np.ndarray:
    """inv_freq f64[rope_dim / 2] of the config (plain RoPE when rope_scaling is not YaRN with factor > 1)."""
    dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
    exponent = np.arange(0, dim, 2, dtype=np.float64) / dim      # [dim/2]
    freq_extra = 1.0 / (base ** exponent)
    if not _uses_yarn(cfg):
        return freq_extra
    rs = cfg.rope_scaling
    factor = float(rs.factor)
    freq_inter = 1.0 / (factor * base ** exponent)
    low, high = yarn_find_correction_range(float(rs.beta_fast), float(rs.beta_slow), dim, base,
                                           int(rs.original_max_position_embeddings))
    inv_freq_mask = 1.0 - yarn_linear_ramp_mask(low, high, dim // 2)
    return freq_inter * (1.0 - inv_freq_mask) + freq_extra * inv_freq_mask


def rope_mscale(cfg) -> float:
    """Magnitude multiplying cos and sin (1.0 for K2, whose mscale == mscale_all_dim)."""
    if not _uses_yarn(cfg):
        return 1.0
    rs = cfg.rope_scaling
    factor = float(rs.factor)
    return yarn_get_mscale(factor, float(rs.mscale)) / yarn_get_mscale(factor, float(rs.mscale_all_dim))


def softmax_scale(cfg) -> float:
    """(qk_nope + qk_rope)^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if _uses_yarn(cfg):
        m = yarn_get_mscale(float(cfg.rope_scaling.factor), float(cfg.rope_scaling.mscale_all_dim))
        scale = scale * m * m
    return scale


class RotaryTable:
    """cos/sin f32[pos, rope_dim/2] per position, built lazily in blocks of `_BLOCK` positions."""

    def __init__(self, cfg):
        self.inv_freq = yarn_inv_freq(cfg)   # [R/2] float64
        self.mscale = rope_mscale(cfg)
        self._blocks: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> Tuple[np.ndarray, np.ndarray]:
        blk = self._blocks.get(b)
        if blk is None:
            pos = np.arange(b * _BLOCK, (b + 1) * _BLOCK, dtype=np.float64)
            ang = pos[:, None] * self.inv_freq[None, :]                       # [BLOCK, R/2]
            blk = ((np.cos(ang) * self.mscale).astype(np.float32), (np.sin(ang) * self.mscale).astype(np.float32))
            self._blocks[b] = blk
        return blk

    def cos_sin(self, positions: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """positions i[T] -> (cos f32[T, R/2], sin f32[T, R/2])."""
        positions = np.asarray(positions, dtype=np.int64)
        half = self.inv_freq.shape[0]
        cos = np.empty((positions.shape[0], half), np.float32)
        sin = np.empty((positions.shape[0], half), np.float32)
        blocks = positions // _BLOCK
        for b in np.unique(blocks):
            sel = blocks == b
            c, s = self._block(int(b))
            cos[sel] = c[positions[sel] - b * _BLOCK]
            sin[sel] = s[positions[sel] - b * _BLOCK]
        return cos, sin


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate interleaved pairs: x f32[T, ..., R], cos/sin f32[T, R/2] -> f32[T, ..., R] (still interleaved)."""
    extra = (1,) * (x.ndim - 2)
    c = cos.reshape(cos.shape[0], *extra, cos.shape[1])
    s = sin.reshape(sin.shape[0], *extra, sin.shape[1])
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out
