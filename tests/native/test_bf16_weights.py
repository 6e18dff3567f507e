"""BF16 weights stay BF16 in memory (backend=cpu): kd_linear_bf16 widens them exactly (bits << 16) in registers or
into L1, so every output equals kd_linear_f32 on the widened float32 weights bit for bit, for every T and odd
sizes, on the AVX2 and the portable path; the whole native forward of a BF16 checkpoint equals the forward of the
same weights widened to float32.

Run: .venv/bin/python -m pytest -q tests/native/test_bf16_weights.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kdtree.backends import native
from kdtree.bf16 import bf16_to_f32, f32_to_bf16
from tests.native_lib import needs_cpu_library

pytestmark = needs_cpu_library

TS = [1, 2, 3, 5, 9, 17, 33]
SIZES = [(1, 1), (7, 5), (15, 3), (16, 4), (17, 9), (33, 7), (100, 13), (257, 6), (1023, 5), (1030, 11),
         (2051, 3)]   # (n_in, n_out): n_in % 16 != 0 mostly; > 1024: the k-blocked path


def _bits(rng, shape):
    """random BF16 bit patterns of finite values (normals, subnormals, signed zeros)"""
    w = f32_to_bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(3.0))
    w[..., ::11] = 0x8000                   # -0
    w[..., 3::13] = 0x0001                  # the smallest subnormal
    return np.ascontiguousarray(w)


@pytest.mark.parametrize("n_in,n_out", SIZES)
def test_linear_bf16_equals_f32_on_widened(n_in, n_out):
    lib = native.load_library("cpu")
    rng = np.random.default_rng(n_in * 1000 + n_out)
    w16 = _bits(rng, (n_out, n_in))
    w32 = np.ascontiguousarray(bf16_to_f32(w16))
    for T in TS:
        x = rng.standard_normal((T, n_in), dtype=np.float32)
        np.testing.assert_array_equal(lib.linear_bf16(x, w16), lib.linear_f32(x, w32), err_msg=f"T={T}")


def test_linear_bf16_large_parallel():
    """>= 1 M weights: the threaded GEMV / blocked paths"""
    lib = native.load_library("cpu")
    rng = np.random.default_rng(7)
    w16 = _bits(rng, (1031, 1100))
    w32 = np.ascontiguousarray(bf16_to_f32(w16))
    for T in (1, 2, 5):
        x = rng.standard_normal((T, 1100), dtype=np.float32)
        np.testing.assert_array_equal(lib.linear_bf16(x, w16), lib.linear_f32(x, w32), err_msg=f"T={T}")


def test_linear_bf16_portable_path():
    """KDTREE_CPU_GENERIC=1 (no AVX2): the portable loops agree bit for bit too, with each other and with AVX2"""
    code = ("import numpy as np, sys; from kdtree.backends import native; from kdtree.bf16 import bf16_to_f32, "
            "f32_to_bf16; lib = native.load_library('cpu'); rng = np.random.default_rng(3); out = []\n"
            "for n_in, n_out in [(7, 5), (33, 7), (1030, 11)]:\n"
            "  w = f32_to_bf16(rng.standard_normal((n_out, n_in), dtype=np.float32))\n"
            "  for T in (1, 2, 5, 17):\n"
            "    x = rng.standard_normal((T, n_in), dtype=np.float32)\n"
            "    a = lib.linear_bf16(x, w); b = lib.linear_f32(x, np.ascontiguousarray(bf16_to_f32(w)))\n"
            "    assert np.array_equal(a, b), (n_in, n_out, T); out.append(a.tobytes())\n"
            "sys.stdout.write(__import__('hashlib').sha256(b''.join(out)).hexdigest())\n")
    env = dict(os.environ)
    digests = []
    for generic in ("1", "0"):
        env["KDTREE_CPU_GENERIC"] = generic
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        digests.append(r.stdout)
    assert digests[0] == digests[1]
