"""Grammar token bitmasks on backend=cpu (kd_token_bitmask_apply, kd_masked_argmax) equal the numpy reference
(kdtree/backends/base.py) bit for bit: odd vocabulary sizes, rows with one allowed token, all allowed, NaN and ties,
llguidance's own bitmask layout; bad shapes are a NativeError naming the op.

Run: .venv/bin/python -m pytest -q tests/native/test_token_bitmask.py
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.backends.base import unpack_bitmask
from kdtree.backends.numpy_ops import NumpyOps
from kdtree.errors import NativeError
from tests.native_lib import needs_cpu_library


def random_bits(rng, T, V, p):
    allowed = rng.random((T, V)) < p
    allowed[np.arange(T), rng.integers(0, V, T)] = True          # at least one token per row
    words = (V + 31) // 32
    padded = np.zeros((T, words * 32), np.uint8)
    padded[:, :V] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32), allowed


@needs_cpu_library
@pytest.mark.parametrize("T,V,p", [(1, 260, 0.01), (9, 260, 0.5), (33, 1031, 0.1), (4, 163840, 0.001),
                                   (3, 32, 1.0), (5, 97, 0.0)])
def test_native_bitmask_ops_equal_the_reference(cpu_ops, T, V, p):
    rng = np.random.default_rng(V + T)
    logits = rng.standard_normal((T, V)).astype(np.float32)
    logits[:, ::7] = logits[:, :1]                               # ties: the lowest id wins
    if T > 2:
        logits[2, V // 2] = np.nan                               # numpy's argmax: the first NaN
    bits, allowed = random_bits(rng, T, V, p)
    assert np.array_equal(unpack_bitmask(bits, V), allowed)
    ref = NumpyOps()
    assert np.array_equal(cpu_ops.masked_argmax(logits, bits), ref.masked_argmax(logits, bits))
    want = ref.token_bitmask_apply(logits.copy(), bits)
    got = cpu_ops.token_bitmask_apply(logits.copy(), bits)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)) and np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.isneginf(want) & ~np.isneginf(logits), ~allowed & ~np.isneginf(logits))


@needs_cpu_library
def test_bad_shapes_name_the_op(cpu_ops):
    logits = np.zeros((2, 100), np.float32)
    with pytest.raises(NativeError, match="masked_argmax: bitmask shape"):
        cpu_ops.masked_argmax(logits, np.zeros((2, 3), np.uint32))
    with pytest.raises(NativeError, match="token_bitmask_apply: logits must be"):
        cpu_ops.token_bitmask_apply(np.zeros((2, 100), np.float64), np.zeros((2, 4), np.uint32))


@pytest.fixture(scope="module")
def cpu_ops():
    from kdtree.backends.native import NativeOps
    return NativeOps("cpu")
