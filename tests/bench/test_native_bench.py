"""Native kernels beside their baselines (pytest-benchmark; nothing about speed is asserted).

    .venv/bin/python -m pytest tests/bench/test_native_bench.py --benchmark-enable --benchmark-only
    .venv/bin/python -m pytest tests/bench/test_native_bench.py --benchmark-enable --benchmark-only -m gpu  # GPU

After the run, tests/bench/conftest.py prints, beside each time, the bytes a call moves, the achieved GB/s, the
share of the machine's memory bandwidth measured in the same run (the roof: a numpy copy of a 256 MiB array,
read + write), and the speedup against the group's baseline (`extra_info["baseline"]`), like llm.c's dev/cuda.
Thread counts 1 and 2 are groups of their own (threadpoolctl limits OpenMP and OpenBLAS in-process).

Groups (min times; compare within a group):
  memory_roof              np.copyto of 256 MiB: the GB/s every other row is compared with.
  gemv(OxI,threads=n)      native W4A16 GEMV vs native FP32 GEMV on the same (dequantized) weights vs numpy FP32,
                           4096x4096 and the K2 expert shapes 2048x7168 / 7168x2048, each call on the next of
                           several weight copies (> 2x the 32 MiB L3 in all), so every call reads from memory.
  linear(T=t,...)          the batch-invariant native linear (FP32 and W4A16) vs numpy's BLAS GEMM (not invariant).
  tree_build(budget=B)     plain-Python heapq reference (kdtree/tree.py) vs NativeOps.tree_build (cffi
                           wrapper + C) vs the bare C call on preallocated buffers (kd_tree_build_job: one
                           pointer, as the wrapper calls it); depth 7, width 8 (K2.6 DFlash).
  draft_topk(7xV, width=4) the drafter block's log-softmax + top-w: numpy reference vs kd_draft_topk, V = 260, 163840.
  mla_attention(...)       native vs numpy reference, one verify block (T=33 = root + budget 32).
  cuda_*                   the CUDA kernels on device buffers (gpu marker), synchronized per call, with GB/s.
  target_forward(T=...)    one tiny-model forward after a 64-token context: numpy reference vs the per-op native
                           path (one library call per op) vs the whole native forward (one call), T=1 (an AR step)
                           and T=33 (a verify block); extra_info carries the time inside the library per call.
Outputs are asserted equal (integers) or within the parity suite's tolerance (floats).
"""
from __future__ import annotations

import itertools

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
THREADS = [1, 2]
L3_BYTES = 32 << 20   # this machine's L3 (lscpu); weight copies rotate through > 2x of it


def draft(depth=7, width=8, seed=0):
    rng = np.random.default_rng(seed)
    logp = np.ascontiguousarray(-np.sort(-np.log(rng.dirichlet(np.ones(width) * 0.5, size=depth)), axis=1), np.float32)
    return logp, rng.integers(0, 163840, (depth, width)).astype(np.int32)


def bench(benchmark, fn, threads, nbytes, baseline):
    """Run fn under `threads` OpenMP/OpenBLAS threads, with the bytes one call moves and the group's baseline."""
    import threadpoolctl   # here, not at the top: the GPU image has no threadpoolctl and its cuda_* rows need none
    benchmark.extra_info.update(bytes=int(nbytes), threads=threads, baseline=baseline)
    with threadpoolctl.threadpool_limits(limits=threads):
        return benchmark(fn)


# ---- memory roof ------------------------------------------------------------------------------------------------
def test_memory_roof(benchmark):
    """The machine's own memory bandwidth in this run: a numpy copy of 256 MiB (bytes = read + written)."""
    benchmark.group = "memory_roof"
    a = np.ones(64 << 20, np.float32)
    b = np.empty_like(a)
    benchmark.extra_info.update(bytes=2 * a.nbytes, roof=True)
    benchmark(np.copyto, b, a)
    assert (b == 1).all()


# ---- tree build ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [64, 512])
@pytest.mark.parametrize("impl", ["python", "native", "c_raw"])
def test_tree_build(benchmark, impl, budget):
    benchmark.group = f"tree_build(budget={budget})"
    benchmark.extra_info["baseline"] = "python"
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
        job = ffi.new("kd_tree_job *")   # the one-pointer call the wrapper makes
        fb = ffi.from_buffer
        job.logp, job.ids, job.n_depth, job.width, job.budget = fb("float[]", logp), fb("int32_t[]", ids), 7, 8, budget
        job.tokens, job.parents = fb("int32_t[]", ints[0]), fb("int32_t[]", ints[1])
        job.depths, job.cap, job.visibility = fb("int32_t[]", ints[2]), budget, fb("uint64_t[]", vis)
        assert benchmark(lib.c.kd_tree_build_job, job) == 0
        got = tree_ref.Tree(tokens=ints[0], parents=ints[1], depths=ints[2],
                            visibility=vis.reshape(budget + 1, -1))
    for f in ("tokens", "parents", "depths", "visibility"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))


# ---- draft top-k -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [260, 163840])
@pytest.mark.parametrize("impl", ["numpy", "native"])
def test_draft_topk(benchmark, impl, V):
    """The drafter block's log-softmax + top-4 (7 rows): kdtree.tree.draft_topk (numpy) vs kd_draft_topk, at the
    tiny model's and K2's vocabularies."""
    benchmark.group = f"draft_topk(7x{V}, width=4)"
    benchmark.extra_info.update(baseline="numpy", bytes=7 * V * 4)
    logits = (3 * np.random.default_rng(V).standard_normal((7, V))).astype(np.float32)
    want = tree_ref.draft_topk(logits, 4)
    fn = tree_ref.draft_topk if impl == "numpy" else native.NativeOps("cpu").draft_topk
    lp, ids = benchmark(fn, logits, 4)
    np.testing.assert_array_equal(ids, want[1])
    np.testing.assert_allclose(lp, want[0], rtol=1e-6, atol=1e-6)


# ---- GEMV: W4A16 vs FP32, out of cache ------------------------------------------------------------------------
GEMV_SHAPES = [(4096, 4096), (2048, 7168), (7168, 2048)]   # (out, in): a 4096 square, K2 expert gate/up and down


@pytest.fixture(scope="module", params=GEMV_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def gemv_data(request):
    n_out, n_in = request.param
    rng = np.random.default_rng(0)
    group = 32
    w4 = []   # random nibbles and bf16-valued scales: exactly what a checkpoint holds
    while sum(w.nbytes for w in w4) < 2 * L3_BYTES:
        packed = rng.integers(-2 ** 31, 2 ** 31, (n_out, n_in // 8), dtype=np.int64).astype(np.int32)
        scale = int4.bf16_to_f32(int4.f32_to_bf16(rng.uniform(0.005, 0.05, (n_out, n_in // group)).astype(np.float32)))
        w4.append(int4.Int4Weight(packed, scale, (n_out, n_in), group))
    deq = [w.dequantize() for w in w4[:2]]                      # f32, >= 2 x 29 MiB: out of cache in turn
    x = rng.standard_normal((1, n_in), dtype=np.float32)
    want = x[0].astype(np.float64) @ deq[0].T.astype(np.float64)
    tol = 2 * n_in * EPS * (np.abs(deq[0]) @ np.abs(x[0]))      # the parity suite's linear bound
    return w4, deq, x, want, tol


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("impl", ["native_w4a16", "native_f32", "numpy_f32"])
def test_gemv(benchmark, gemv_data, impl, threads):
    w4, deq, x, want, tol = gemv_data
    n_out, n_in = deq[0].shape
    benchmark.group = f"gemv({n_out}x{n_in},T=1,threads={threads})"
    ops = native.NativeOps("cpu")
    out_bytes = 4 * n_out + x.nbytes
    if impl == "native_w4a16":
        ws, nbytes = w4, w4[0].nbytes + out_bytes
        call = lambda w: ops.linear(x, w)[0]           # noqa: E731
    elif impl == "native_f32":
        ws, nbytes = deq, deq[0].nbytes + out_bytes
        call = lambda w: ops.linear(x, w)[0]           # noqa: E731
    else:
        ws, nbytes = deq, deq[0].nbytes + out_bytes
        call = lambda w: w @ x[0]                       # noqa: E731
    assert (np.abs(call(ws[0]) - want) <= tol).all()
    ring = itertools.cycle(ws)                          # the next copy each call: every call reads from memory
    bench(benchmark, lambda: call(next(ring)), threads, nbytes, "native_f32")


# ---- batch-invariant linear over T rows vs BLAS GEMM ------------------------------------------------------------
LIN = 4096


@pytest.fixture(scope="module")
def linear_data():
    rng = np.random.default_rng(1)
    packed = rng.integers(-2 ** 31, 2 ** 31, (LIN, LIN // 8), dtype=np.int64).astype(np.int32)
    scale = int4.bf16_to_f32(int4.f32_to_bf16(rng.uniform(0.005, 0.05, (LIN, LIN // 32)).astype(np.float32)))
    w4 = int4.Int4Weight(packed, scale, (LIN, LIN), 32)
    return w4, w4.dequantize(), rng.standard_normal((64, LIN), dtype=np.float32)   # 64 MiB f32: out of cache


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("T", [2, 4, 9, 33])   # 2-4: a K2 verify's rows per expert
@pytest.mark.parametrize("impl", ["native_f32", "native_w4a16", "numpy_blas"])
def test_linear(benchmark, linear_data, impl, T, threads):
    w4, w, xs = linear_data
    x = xs[:T]
    benchmark.group = f"linear({LIN}x{LIN},T={T},threads={threads})"
    ops = native.NativeOps("cpu")
    io = x.nbytes + 4 * T * LIN
    if impl == "numpy_blas":
        fn, nbytes = (lambda: x @ w.T), w.nbytes + io
    elif impl == "native_f32":
        fn, nbytes = (lambda: ops.linear(x, w)), w.nbytes + io
    else:
        fn, nbytes = (lambda: ops.linear(x, w4)), w4.nbytes + io
    got = bench(benchmark, fn, threads, nbytes, "numpy_blas")
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert (np.abs(got - want) <= 2 * LIN * EPS * (np.abs(x) @ np.abs(w).T)).all()
    if impl != "numpy_blas":   # batch invariance: the last row equals that row computed alone, bit for bit
        np.testing.assert_array_equal(got[-1], ops.linear(x[-1:], w if impl == "native_f32" else w4)[0])


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
    benchmark.extra_info["baseline"] = "numpy"
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


# ---- whole target forward ------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("impl", ["numpy", "cpu_per_op", "cpu_whole"])
def test_target_forward(benchmark, tiny_cfg, tiny_weights, impl, T):
    from kdtree.backends.native_forward import LIBRARY_CLOCK
    from kdtree.tree import causal_visibility
    from kdtree.model.k2 import K2Model
    from kdtree.model.target import build_target
    benchmark.group = f"target_forward(T={T})"
    ops = REF if impl == "numpy" else native.NativeOps("cpu")
    if impl == "cpu_per_op":
        ops.native_forward = False
    m = build_target(tiny_cfg, tiny_weights, ops)
    ctx = 64
    cache = m.new_cache(ctx + T)
    m.forward(np.arange(ctx, dtype=np.int32), np.arange(ctx), cache)
    block, pos, vis = np.arange(T, dtype=np.int32) + 7, ctx + np.arange(T), causal_visibility(T)

    def step():
        out = m.forward(block, pos, cache, visibility=vis)
        cache.truncate(ctx)
        return out

    lib0 = LIBRARY_CLOCK.seconds
    logits, _ = benchmark.pedantic(step, rounds=20, iterations=5, warmup_rounds=2)
    benchmark.extra_info.update(library_seconds_per_call=(LIBRARY_CLOCK.seconds - lib0) / (22 * 5))
    ref_model = K2Model(tiny_cfg, tiny_weights, REF)
    ref, _ = ref_model.forward(np.concatenate([np.arange(ctx), block]).astype(np.int32), np.arange(ctx + T),
                               ref_model.new_cache(ctx + T))
    np.testing.assert_allclose(logits, ref[ctx:], rtol=1e-4, atol=1e-4)
