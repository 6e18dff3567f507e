"""Resident memory of INT4-W4A16 weights vs FP32, on the tiny model's routed experts and one K2.6-shaped expert.

    .venv/bin/python -m pytest tests/bench/test_quant_memory.py --benchmark-enable --benchmark-only

Timed: Int4Weight.linear (unpack + per-group GEMV, row by row) beside the FP32 GEMV of the same matrix; nothing
about speed is asserted. Bytes are exact arithmetic and asserted: per weight, 4 bits packed + one scale per
32 weights, which is bf16 (16 bits) on disk -> 4.5/32 of FP32, and float32 (32 bits) in memory -> 5/32.
"""
import numpy as np
import pytest

from kdtree.backends.numpy_ops import NumpyOps
from kdtree.quant.int4 import Int4Weight, quantize_weight

GROUP = 32
SHAPES = {"tiny_expert_up": (256, 128), "tiny_expert_down": (128, 256), "k26_expert_up": (2048, 7168)}


def _quantized(out, n, seed=0):
    w = np.random.default_rng(seed).normal(0, n ** -0.5, size=(out, n)).astype(np.float32)   # [out, in]
    packed, scale, shape = quantize_weight(w, GROUP)
    disk = packed.nbytes + scale.nbytes + shape.nbytes                     # I32 + BF16 + I32[2] bytes
    return w, Int4Weight.from_tensors("bench", packed, scale, shape, GROUP), disk


@pytest.mark.parametrize("name", list(SHAPES))
def test_int4_resident_bytes_and_linear(benchmark, name):
    out, n = SHAPES[name]
    w, W, disk = _quantized(out, n)
    x = np.random.default_rng(1).normal(size=(8, n)).astype(np.float32)   # [T=8, in]
    benchmark.extra_info.update(
        shape=[out, n], fp32_bytes=w.nbytes, int4_resident_bytes=W.nbytes, int4_disk_bytes=disk,
        resident_ratio=W.nbytes / w.nbytes, disk_ratio=disk / w.nbytes,
        scale_in_memory=str(W.scale_held.dtype))
    assert W.nbytes / w.nbytes == pytest.approx(4.5 / 32)                  # BF16 scales in memory, as on disk
    assert (disk - 8) / w.nbytes == pytest.approx(4.5 / 32)                # bf16 scales on disk
    benchmark(NumpyOps().linear, x, W)


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_linear_baseline(benchmark, name):
    out, n = SHAPES[name]
    w = np.random.default_rng(0).normal(0, n ** -0.5, size=(out, n)).astype(np.float32)
    x = np.random.default_rng(1).normal(size=(8, n)).astype(np.float32)
    benchmark.extra_info.update(shape=[out, n], fp32_bytes=w.nbytes)
    benchmark(NumpyOps().linear, x, w)
