"""Native kernels beside their numpy counterparts (pytest-benchmark; nothing about speed is asserted).

    .venv/bin/python -m pytest tests/bench/test_native_bench.py --benchmark-enable --benchmark-only
    .venv/bin/python -m pytest tests/bench/test_native_bench.py --benchmark-enable --benchmark-only -m gpu  # GPU

Groups (compare the mean of the rows of a group side by side):
  tree_build(budget=B)   plain-Python heapq reference (kdtree/tree.py) vs NativeOps.tree_build (cffi
                         wrapper + C) vs the bare C call on preallocated buffers; depth 7, width 8 (K2.6 DFlash).
  gemv(4096x4096,T=1)    native W4A16 GEMV vs numpy FP32 GEMV (w @ x, 64 MiB: does not fit in cache) vs native
                         FP32 GEMV. Bytes per call in extra_info: GB/s = bytes / mean.
  mla_attention(...)     native vs numpy reference, one verify block (T=33 = root + budget 32).
  cuda_*                 the CUDA kernels on device buffers (gpu marker), synchronized per call, with GB/s.
Outputs are asserted equal (integers) or within the parity suite's tolerance (floats).
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.backends import native
from kdtree.backends.numpy_ops import NumpyOps
from kdtree import tree as tree_ref
from kdtree.quant import int4
from tests.native_lib import needs_cpu_library

pytestmark = needs_cpu_library
EPS = float(np.finfo(np.float32).eps)
REF = NumpyOps()


def draft(depth=7, width=8, seed=0):
    rng = np.random.default_rng(seed)
    logp = np.ascontiguousarray(-np.sort(-np.log(rng.dirichlet(np.ones(width) * 0.5, size=depth)), axis=1), np.float32)
    return logp, rng.integers(0, 163840, (depth, width)).astype(np.int32)


# ---- tree build ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [64, 512])
@pytest.mark.parametrize("impl", ["python", "native", "c_raw"])
def test_tree_build(benchmark, impl, budget):
    benchmark.group = f"tree_build(budget={budget})"
    logp, ids = draft()
    want = tree_ref.tree_build(logp, ids, budget)
    if impl == "python":
        got = benchmark(tree_ref.tree_build, logp, ids, budget)
    elif impl == "native":
        got = benchmark(native.NativeOps("cpu").tree_build, logp, ids, budget)
    else:
        lib = native.load_library("cpu")
        ffi = lib.ffi
        ints = np.empty((3, budget), np.int32)
        vis = np.empty((budget + 1) * ((budget + 64) // 64), np.uint64)
        n = ffi.new("int64_t *")
        args = (ffi.from_buffer("float[]", logp), ffi.from_buffer("int32_t[]", ids), 7, 8, budget,
                ffi.from_buffer("int32_t[]", ints[0]), ffi.from_buffer("int32_t[]", ints[1]),
                ffi.from_buffer("int32_t[]", ints[2]), budget, ffi.from_buffer("uint64_t[]", vis), n)
        assert benchmark(lib.c.kd_tree_build, *args) == 0
        got = tree_ref.Tree(tokens=ints[0], parents=ints[1], depths=ints[2],
                            visibility=vis.reshape(budget + 1, -1))
    for f in ("tokens", "parents", "depths", "visibility"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))


# ---- GEMV: W4A16 vs FP32 ----------------------------------------------------------------------------------------
N = 4096


@pytest.fixture(scope="module")
def gemv_data():
    rng = np.random.default_rng(0)
    packed, scale, shape = int4.quantize_weight(rng.standard_normal((N, N), dtype=np.float32), 32)
    w4 = int4.Int4Weight(packed, int4.bf16_to_f32(scale), shape, 32)
    deq = w4.dequantize()                                       # f32 [4096, 4096], 64 MiB
    x = rng.standard_normal((1, N), dtype=np.float32)
    want = x[0].astype(np.float64) @ deq.T.astype(np.float64)
    tol = 2 * N * EPS * (np.abs(deq) @ np.abs(x[0]))             # the parity suite's linear bound
    return w4, deq, x, want, tol


@pytest.mark.parametrize("impl", ["native_w4a16", "numpy_f32", "native_f32"])
def test_gemv(benchmark, gemv_data, impl):
    w4, deq, x, want, tol = gemv_data
    benchmark.group = f"gemv({N}x{N},T=1)"
    if impl == "native_w4a16":
        ops = native.NativeOps("cpu")
        benchmark.extra_info["bytes"] = w4.packed.nbytes + w4.scale.nbytes + x.nbytes
        got = benchmark(ops.linear, x, w4)[0]
    elif impl == "numpy_f32":
        benchmark.extra_info["bytes"] = deq.nbytes + x.nbytes
        got = benchmark(lambda: deq @ x[0])
    else:
        ops = native.NativeOps("cpu")
        benchmark.extra_info["bytes"] = deq.nbytes + x.nbytes
        got = benchmark(ops.linear, x, deq)[0]
    assert (np.abs(got - want) <= tol).all()


# ---- attention ---------------------------------------------------------------------------------------------
ATT = dict(T=33, H=16, L=512, R=64, P=1024)


@pytest.fixture(scope="module")
def att_data():
    rng = np.random.default_rng(0)
    T, H, L, R, P = (ATT[k] for k in ("T", "H", "L", "R", "P"))
    logp, ids = draft()
    vis = tree_ref.tree_build(logp, ids, T - 1).visibility      # a real tree's ancestor mask
    q = rng.standard_normal((T, H, L + R), dtype=np.float32)
    kv = rng.standard_normal((P + T, L + R), dtype=np.float32)
    return q, kv, vis, float((L + R) ** -0.5)


@pytest.mark.parametrize("impl", ["native", "numpy"])
def test_mla_attention(benchmark, att_data, impl):
    q, kv, vis, scale = att_data
    benchmark.group = "mla_attention(" + ",".join(f"{k}={v}" for k, v in ATT.items()) + ")"
    fn = native.NativeOps("cpu").mla_attention if impl == "native" else REF.mla_attention
    got = benchmark(fn, q, kv, ATT["P"], vis, scale, ATT["L"])
    np.testing.assert_allclose(got, REF.mla_attention(q, kv, ATT["P"], vis, scale, ATT["L"]), rtol=0, atol=1e-4)


# ---- CUDA kernels on device buffers ----------------------------------------------------------------------------
K2 = dict(hidden=7168, expert=2048)


@pytest.mark.gpu
@pytest.mark.skipif(native.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("op", ["w4a16_gemv_2048x7168", "w4a16_T33_2048x7168", "f32_gemv_7168x7168",
                                "mla_attention_T33_H64_P4096"])
def test_cuda_kernel(benchmark, op):
    lib = native.load_library("cuda")
    ffi, c = lib.ffi, lib.c
    rng = np.random.default_rng(0)
    benchmark.group = "cuda"
    if op.startswith("w4a16"):
        T = 33 if "T33" in op else 1
        n_out, n_in = K2["expert"], K2["hidden"]
        packed, scale, shape = int4.quantize_weight(rng.standard_normal((n_out, n_in), dtype=np.float32), 32)
        scale = int4.bf16_to_f32(scale)
        x = rng.standard_normal((T, n_in), dtype=np.float32)
        d = [lib.device_array(a) for a in (x, packed, scale)]
        out = lib.device_array(np.empty((T, n_out), np.float32), upload=False)
        nbytes = packed.nbytes + scale.nbytes + x.nbytes

        def call():
            lib.check(c.kd_linear_w4a16(*(ffi.cast("void *", a.addr) for a in d), ffi.cast("float *", out.addr), T,
                                        n_in, n_out, 32, ffi.NULL), op)
            lib.check(c.kd_synchronize(ffi.NULL), op)
        want = x.astype(np.float64) @ int4.dequantize(packed, scale, shape).T
    elif op.startswith("f32"):
        n = K2["hidden"]
        w = rng.standard_normal((n, n), dtype=np.float32)
        x = rng.standard_normal((1, n), dtype=np.float32)
        d = [lib.device_array(a) for a in (x, w)]
        out = lib.device_array(np.empty((1, n), np.float32), upload=False)
        nbytes = w.nbytes + x.nbytes

        def call():
            lib.check(c.kd_linear_f32(*(ffi.cast("void *", a.addr) for a in d), ffi.cast("float *", out.addr), 1, n, n,
                                      ffi.NULL), op)
            lib.check(c.kd_synchronize(ffi.NULL), op)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
    else:
        T, H, L, R, P = 33, 64, 512, 64, 4096
        logp, ids = draft()
        vis = tree_ref.tree_build(logp, ids, T - 1).visibility
        q = rng.standard_normal((T, H, L + R), dtype=np.float32)
        kv = rng.standard_normal((P + T, L + R), dtype=np.float32)
        d = [lib.device_array(a) for a in (q, kv, vis)]
        out = lib.device_array(np.empty((T, H, L), np.float32), upload=False)
        nbytes = q.nbytes + kv.nbytes + T * H * L * 4

        def call():
            lib.check(c.kd_mla_attention(*(ffi.cast("void *", a.addr) for a in d), ffi.cast("float *", out.addr), T, H,
                                         L, R, P, (L + R) ** -0.5, ffi.NULL), op)
            lib.check(c.kd_synchronize(ffi.NULL), op)
        want = REF.mla_attention(q, kv, P, vis, (L + R) ** -0.5, L)
    benchmark.extra_info["bytes"] = nbytes
    benchmark(call)
    got = out.download(np.empty(want.shape, np.float32))
    benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.mean / 1e9, 1)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
