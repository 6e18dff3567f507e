"""bfloat16 as uint16 bits in numpy (numpy has no bf16 dtype): the exact widening and the round-to-nearest-even
narrowing. Low level: the safetensors reader and the INT4 format both use it; it imports only kdtree.aligned.
"""
from __future__ import annotations

import numpy as np

from kdtree.aligned import aligned_empty


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits -> float32 (exact)."""
    wide = aligned_empty(bits.shape, np.uint32)   # a weight row read as float32 by the native kernels
    np.left_shift(bits, 16, out=wide, dtype=np.uint32, casting="unsafe")  # one pass, one allocation
    return wide.view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bits, round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)
