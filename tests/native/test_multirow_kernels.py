"""The multi-row CPU kernels (four x rows per weight load, four weight rows per x row) compute every output
exactly as the one-row dot: a row's result is the same for every T and every position in the call, on the
AVX2 path and on the portable path (KDTREE_CPU_GENERIC=1), for float32 and INT4 weights and odd sizes; the
attention's four-heads-per-key dots likewise (masked-tail AVX2 == portable, bit for bit).

Run: .venv/bin/python -m pytest -q tests/native/test_multirow_kernels.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kdtree.backends import native
from kdtree.quant import int4
from tests.native_lib import needs_cpu_library

pytestmark = needs_cpu_library

SIZES = [(1, 5), (7, 9), (16, 4), (40, 13), (96, 21), (130, 6), (256, 33), (600, 7), (1030, 5)]   # (n_in, n_out); > 512: k-blocked


def _weights(rng, n_in, n_out):
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    out = [w]
    if n_in % 8 == 0:
        group = 8 if n_in % 32 else 32
        packed, scale, shape = int4.quantize_weight(w, group)
        out.append(int4.Int4Weight(packed, int4.bf16_to_f32(scale), shape, group))
    return out


@pytest.mark.parametrize("n_in,n_out", SIZES)
def test_linear_row_independent_of_T_and_offset(n_in, n_out):
    ops = native.NativeOps("cpu")
    rng = np.random.default_rng(n_in * 100 + n_out)
    x = rng.standard_normal((13, n_in), dtype=np.float32)
    for w in _weights(rng, n_in, n_out):
        one = np.stack([ops.linear(x[t:t + 1], w)[0] for t in range(13)])
        if isinstance(w, np.ndarray):   # the one-row result is the plain fixed-order dot
            ref = np.stack([[_lane_dot(w[o], x[t]) for o in range(n_out)] for t in range(13)])
            np.testing.assert_array_equal(one, ref)
        for T in range(2, 14):
            for start in sorted({0, 13 - T, (13 - T) // 2}):
                np.testing.assert_array_equal(ops.linear(x[start:start + T], w), one[start:start + T],
                                              err_msg=f"T={T} start={start} {type(w).__name__}")


def fma32(a, b, c):
    """float32 fused multiply-add, exactly C's fmaf (one rounding of a * b + c), elementwise over arrays: the product
    is exact in float64, the sum's float64 rounding error is recovered exactly (TwoSum), and a float64 sum that lands
    on a float32 tie is rounded the way the exact value lies."""
    a64, b64, c64 = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a64 * b64
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    toward = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf))).astype(np.float64)
    tie = (s != r64) & (s - r64 == toward - s) & (err != 0)
    fix = tie & ((err > 0) == (toward > r64))      # the exact value lies on `toward`'s side of the tie
    return np.where(fix, toward, r64).astype(np.float32)


def _lane_dot(a, b):
    """kd_dot_f32 restated: element k to lane k % 16, each lane a chain of fused multiply-adds (one rounding per
    product-sum, fma32), pairwise lane combine."""
    acc = np.zeros(16, np.float32)
    for k in range(0, a.shape[0], 16):
        r = min(16, a.shape[0] - k)
        acc[:r] = fma32(a[k:k + r], b[k:k + r], acc[:r])
    w = 8
    while w >= 1:
        acc[:w] = acc[:w] + acc[w:2 * w]
        w //= 2
    return acc[0]


_SCRIPT = """
import sys, numpy as np
from kdtree.backends import native
from kdtree.quant import int4
ops = native.NativeOps("cpu")
rng = np.random.default_rng(5)
out = {}
for n_in, n_out in %r:
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    w16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((17, n_in), dtype=np.float32)
    for T in (1, 2, 3, 4, 5, 7, 8, 11, 17):
        out[f"f32_{n_in}_{n_out}_{T}"] = ops.linear(x[:T], w)
        out[f"bf16_{n_in}_{n_out}_{T}"] = native.load_library("cpu").linear_bf16(x[:T], w16)
        for group in (8, 32):   # odd and even words per group (the AVX-512 GEMV takes whole chunks per group)
            if n_in %% group == 0:
                packed, scale, shape = int4.quantize_weight(w, group)   # scale: BF16 bits
                out[f"w4_{group}_{n_in}_{n_out}_{T}"] = ops.linear(x[:T], int4.Int4Weight(packed, scale, shape, group))
                out[f"w4f_{group}_{n_in}_{n_out}_{T}"] = native.load_library("cpu").linear_w4a16(
                    x[:T], packed, int4.bf16_to_f32(scale), n_in, group)      # the same scales as float32
for H, L, R, P, T in [(8, 32, 8, 20, 9), (3, 16, 1, 5, 6), (5, 9, 8, 0, 4), (4, 64, 0, 7, 3)]:
    q = rng.standard_normal((T, H, L + R), dtype=np.float32)
    kv = rng.standard_normal((P + T, L + R), dtype=np.float32)
    out[f"attn_{H}_{L}_{R}"] = ops.mla_attention(q, kv, P, None, 0.2, L)
np.savez(sys.argv[1], **out)
""" % (SIZES + [(1100, 12), (1544, 18), (1040, 1100), (2080, 13), (2080, 520)],)   # + in-place panels,
# split over threads; 2080: the k-blocked fused INT4 kernel (group 32, 3+ rows), 520 rows: several row groups, threaded


# the CPU build's three kernel families: AVX-512 where the host has it (this VM does), AVX2 + FMA, portable C
ISAS = {"avx512": {}, "avx2": {"KDTREE_CPU_ISA": "avx2"}, "portable": {"KDTREE_CPU_GENERIC": "1"}}


def test_avx512_avx2_and_portable_multirow_paths_agree_bitwise(tmp_path):
    files = {}
    for isa, env in ISAS.items():
        files[isa] = tmp_path / f"k_{isa}.npz"
        subprocess.run([sys.executable, "-c", _SCRIPT, str(files[isa])], check=True,
                       env={**os.environ, "KDTREE_CPU_GENERIC": "0", "KDTREE_CPU_ISA": "", **env})
    ref = np.load(files["portable"])
    assert ref.files
    for isa in ("avx512", "avx2"):
        got = np.load(files[isa])
        for k in ref.files:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{isa} {k}")
    for isa in ISAS:   # BF16 scales (as held) and the same scales widened to float32: the same bits on every path
        got = np.load(files[isa])
        w4 = [k for k in got.files if k.startswith("w4_")]
        assert w4
        for k in w4:
            np.testing.assert_array_equal(got[k], got["w4f_" + k[3:]], err_msg=f"{isa} {k}: BF16 vs f32 scales")


def test_head_linear_equals_linear_per_head_on_strided_views():
    ops = native.NativeOps("cpu")
    assert ops.has_head_linear
    rng = np.random.default_rng(9)
    for T, H, n_in, n_out in [(1, 8, 16, 32), (7, 3, 40, 9), (33, 8, 32, 16)]:
        q = rng.standard_normal((T, H, n_in + 5), dtype=np.float32)            # a strided [T, H, n_in] view
        w = rng.standard_normal((H, n_out, n_in), dtype=np.float32)
        out = np.full((T, H, n_out + 3), np.nan, np.float32)
        assert ops.head_linear(q[:, :, :n_in], w, out[:, :, :n_out])
        for h in range(H):
            np.testing.assert_array_equal(out[:, h, :n_out], ops.linear(np.ascontiguousarray(q[:, h, :n_in]), w[h]))
        assert np.isnan(out[:, :, n_out:]).all()                               # nothing outside the view written
        assert not ops.head_linear(q[:, :, :n_in].astype(np.float64), w, out[:, :, :n_out])


def _lane_dots(x, w):
    """kd_dot_f32 restated for every (row, output) at once: x f32[T, n], w f32[O, n] -> f32[T, O]; element k to
    lane k % 16 in ascending k (a fused multiply-add, fma32), then the pairwise lane combine."""
    T, n = x.shape
    acc = np.zeros((T, w.shape[0], 16), np.float32)
    for k in range(0, n, 16):
        r = min(16, n - k)
        acc[:, :, :r] = fma32(x[:, None, k:k + r], w[None, :, k:k + r], acc[:, :, :r])
    h = 8
    while h >= 1:
        acc[:, :, :h] = acc[:, :, :h] + acc[:, :, h:2 * h]
        h //= 2
    return acc[:, :, 0]


# (n_in, n_out, group): several k blocks (512), outputs over a 48-output block, odd and even words per group,
# inputs with a 16-element tail; group 0 = float32 only (n_in not a multiple of 8)
LARGE = [(1040, 50, 16), (1064, 97, 8), (1128, 7, 24), (520, 49, 40), (1037, 50, 0)]


@pytest.mark.parametrize("n_in,n_out,group", LARGE)
def test_blocked_kernels_equal_the_lane_order_dot_at_every_T(n_in, n_out, group):
    """The register-tiled T >= 2 kernels and the fused W4A16 GEMV: every output is bit for bit the fixed lane-order
    dot of the row (on the dequantized weight for W4A16, with full-precision float32 scales), for T = 1..64."""
    ops = native.NativeOps("cpu")
    rng = np.random.default_rng(n_in + n_out)
    x = rng.standard_normal((64, n_in), dtype=np.float32)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    weights = [(w, w)]
    if group:
        packed, _, shape = int4.quantize_weight(w, group)
        scale = rng.uniform(0.01, 0.3, (n_out, n_in // group)).astype(np.float32)   # not bf16: q * s rounds
        w4 = int4.Int4Weight(packed, scale, shape, group)
        weights.append((w4, w4.dequantize()))
    for wt, deq in weights:
        want = _lane_dots(x, deq)
        for T in (1, 2, 3, 9, 33, 64):
            np.testing.assert_array_equal(ops.linear(x[:T], wt), want[:T], err_msg=f"T={T} {type(wt).__name__}")


# (n_in, n_out, group): rows of several k blocks (the AVX2 / AVX-512 panels), odd n_in (a 16-element tail: the
# weights through the panel buffer), n_out not a multiple of the panel (a last panel of 1-3 rows), weights >= 1 M
# (panels split over threads), 1-33 rows (row tiles of 1-3, BF16 / INT4 in place and through the buffer); group 0 =
# float32 only
STREAMED = [(1037, 1031, 0), (2056, 61, 8), (1040, 1100, 16), (3000, 7, 24), (1552, 2, 0), (4104, 37, 8)]


@pytest.mark.parametrize("n_in,n_out,group", STREAMED)
def test_every_T_equals_T_single_row_calls_bitwise(n_in, n_out, group):
    """Batch invariance of the multi-row linear: a call of T rows (T = 1..33) gives, for each row, exactly the bits
    of a one-row call on it (kd_gemv_f32_avx2 / the fused W4A16 GEMV), with 1 and 2 threads."""
    ops = native.NativeOps("cpu")
    rng = np.random.default_rng(n_in * 7 + n_out)
    x = rng.standard_normal((33, n_in), dtype=np.float32)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    weights = [w]
    if group:
        packed, _, shape = int4.quantize_weight(w, group)
        weights.append(int4.Int4Weight(packed, rng.uniform(0.01, 0.3, (n_out, n_in // group)).astype(np.float32),
                                       shape, group))
    try:
        for threads in (1, 2):
            ops.lib.set_threads(threads)
            for wt in weights:
                one = np.stack([ops.linear(x[t:t + 1], wt)[0] for t in range(33)])
                for T in range(1, 34):
                    assert np.array_equal(ops.linear(x[:T], wt), one[:T]), f"T={T} threads={threads} {type(wt).__name__}"
    finally:
        ops.lib.set_threads(0)


@pytest.mark.parametrize("n_in,n_out", [(4112, 13), (4096, 6), (1040, 50), (2056, 37)])
def test_bf16_rows_equal_the_lane_order_dot_on_either_side_of_l2(n_in, n_out):
    """BF16 weights widened exactly: the AVX2 fused kernel (T = 2-7: passes of 2-6 rows of x over each weight row,
    x in L1 whole or k-blocked with every pass of a row over a block back to back), the panels (T = 2 over long rows,
    T >= 8) and the AVX-512 kernels -- whole-row passes while x fits KD_ROWS_X_MAX (8 MB: past L2, 1-4 MB here at
    T = 64-520), the k-blocked tiles beyond (n_in 4096 / 4112 at T = 520) -- give every output the lane-order dot of
    the widened row -- so a row's bits do not depend on how many rows came with it. n_in 2056: a 16-element chunk's
    tail of 8; n_out 13 / 37 / 50: a last partial panel or row group; one and two threads (the outputs split)."""
    ops = native.NativeOps("cpu")
    rng = np.random.default_rng(n_in + 3 * n_out)
    x = rng.standard_normal((520, n_in), dtype=np.float32)
    w16 = (rng.standard_normal((n_out, n_in), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    want = _lane_dots(x, int4.bf16_to_f32(w16))
    try:
        for threads in (1, 2):
            ops.lib.set_threads(threads)
            for T in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 64, 70, 520):
                np.testing.assert_array_equal(ops.lib.linear_bf16(x[:T], w16), want[:T],
                                              err_msg=f"T={T} threads={threads} (x {T * n_in * 4} bytes)")
    finally:
        ops.lib.set_threads(0)
