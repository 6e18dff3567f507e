"""Parity suite of the native library (in the spirit of llama.cpp's test-backend-ops).

Every op x several shapes x every available backend ("cpu"; "cuda" is marked gpu and skipped without a device)
against the numpy reference: kdtree/tree.py for the tree ops, kdtree.backends.numpy_ops for the dense
ops, kdtree.quant.int4.dequantize for W4A16. Integer outputs are bit-exact; float outputs are within a per-op
tolerance (justified where it is computed); every output buffer is surrounded by sentinel guard regions that
must survive the call. A case id re-runs one case:
    pytest 'tests/native/test_backend_ops.py::test_op[mla_attention(T=5,H=3,L=32,R=8,P=12,vis_kind=tree)-cpu]'

    .venv/bin/python -m pytest -q tests/native/test_backend_ops.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kdtree.backends import native
from kdtree.backends.numpy_ops import NumpyOps
from kdtree import tree as tree_ref
from kdtree.tree import unpack_visibility
from kdtree.errors import NativeError
from kdtree.quant import int4
from tests.native_lib import needs_cpu_library

EPS = float(np.finfo(np.float32).eps)
GUARD = 37                       # sentinel elements on each side of every output
SENTINEL = np.uint32(0x7FC0DEAD)  # a NaN payload no kernel writes by accident
REF = NumpyOps()

BACKENDS = [
    pytest.param("cpu", marks=needs_cpu_library),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        native.cuda_device_count() == 0, reason=f"no CUDA device: {native.CUDA_REASON}")]),
]


# ---- harness: call a C op on raw pointers with guarded outputs -----------------------------------------------
class Guarded:
    """A host output array with GUARD sentinel elements on both sides (4-byte or 8-byte elements)."""

    def __init__(self, shape, dtype):
        n = int(np.prod(shape))
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        word = np.uint32 if self.dtype.itemsize == 4 else np.uint64
        self.buf = np.full(n + 2 * GUARD, SENTINEL, word).view(self.dtype)
        self.n = n

    @property
    def value(self) -> np.ndarray:
        return self.buf[GUARD:GUARD + self.n].reshape(self.shape)

    def check_guards(self, op: str) -> None:
        raw = self.buf.view(np.uint32 if self.dtype.itemsize == 4 else np.uint64)
        for side, part in (("before", raw[:GUARD]), ("after", raw[GUARD + self.n:])):
            bad = np.flatnonzero(part != SENTINEL)
            assert bad.size == 0, f"{op} wrote {bad.size} elements {side} its output (out of bounds)"


def raw_call(lib, fn: str, inputs, outs, *sizes):
    """Call lib.c.<fn>(inputs..., outs..., sizes..., [stream]) with guarded outs. On cuda the inputs and the whole
    guarded buffers go to the device and back, so a device-side out-of-bounds write shows up in the guards."""
    ffi, c = lib.ffi, lib.c
    if lib.kind == "cpu":
        ptrs = [ffi.NULL if a is None else ffi.cast("void *", a.ctypes.data) for a in inputs]
        ptrs += [ffi.cast("void *", g.buf.ctypes.data + GUARD * g.dtype.itemsize) for g in outs]
        rc = getattr(c, fn)(*ptrs, *sizes, ffi.NULL)
    else:
        dev_in = [None if a is None else lib.device_array(a) for a in inputs]
        dev_out = [lib.device_array(g.buf) for g in outs]
        ptrs = [ffi.NULL if d is None else ffi.cast("void *", d.addr) for d in dev_in]
        ptrs += [ffi.cast("void *", d.addr + GUARD * g.dtype.itemsize) for d, g in zip(dev_out, outs)]
        rc = getattr(c, fn)(*ptrs, *sizes, ffi.NULL)
        lib.check(c.kd_synchronize(ffi.NULL), "kd_synchronize")
        for d, g in zip(dev_out, outs):
            d.download(g.buf)
    lib.check(rc, fn)
    for g in outs:
        g.check_guards(fn)


def assert_close(got, want, tol, what):
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), f"{what}: |err| {err[worst]:.3g} > tol {np.broadcast_to(tol, err.shape)[worst]:.3g} at {worst}"


# ---- inputs -------------------------------------------------------------------------------------------------
def rng_for(case_id: str):
    """A seed fixed by the case id, so a re-run of one case sees the same inputs."""
    return np.random.default_rng(int.from_bytes(case_id.encode(), "little") % (2 ** 63))


def random_parents(rng, n):
    """A random tree in pop order (parents precede children)."""
    return np.array([rng.integers(-1, i) if i else -1 for i in range(n)], np.int32)


def visibility_for(kind, rng, T):
    if kind == "causal":
        return None
    if kind == "causal_packed":
        return tree_ref.causal_visibility(T)
    # tree: row 0 = root, rows 1.. = nodes of a random tree (what the verify forward passes)
    return tree_ref.ancestor_visibility(random_parents(rng, T - 1))


# ---- the ops: each case builds inputs, runs the backend with guards, compares with the reference ----------------
def case_linear(lib, rng, T, n_in, n_out):
    x = rng.standard_normal((T, n_in), dtype=np.float32)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    out = Guarded((T, n_out), np.float32)
    raw_call(lib, "kd_linear_f32", [x, w], [out], T, n_in, n_out)
    # Both sides sum n_in products in some fixed order: each is within n_in*eps*sum|w||x| of the exact value
    # (standard forward error bound of any summation order), so they differ by at most twice that.
    tol = 2 * n_in * EPS * (np.abs(x) @ np.abs(w).T) + 1e-30
    assert_close(out.value, REF.linear(x, w), tol, "linear")
    np.testing.assert_array_equal(native.NativeOps(lib.kind).linear(x, w), out.value)


def case_linear_w4a16(lib, rng, T, n_in, n_out, group):
    x = rng.standard_normal((T, n_in), dtype=np.float32)
    packed, scale_bf16, shape = int4.quantize_weight(rng.standard_normal((n_out, n_in), dtype=np.float32), group)
    w = int4.Int4Weight(packed, int4.bf16_to_f32(scale_bf16), shape, group)
    deq = int4.dequantize(packed, w.scale, shape)
    out = Guarded((T, n_out), np.float32)
    raw_call(lib, "kd_linear_w4a16", [x, w.packed, w.scale], [out], T, n_in, n_out, group)
    # Same bound as linear: the dequantized weights are exact float32 (q * scale, one rounding, as int4.dequantize).
    tol = 2 * n_in * EPS * (np.abs(x) @ np.abs(deq).T) + 1e-30
    assert_close(out.value, x.astype(np.float64) @ deq.T.astype(np.float64), tol, "linear_w4a16")
    np.testing.assert_array_equal(native.NativeOps(lib.kind).linear(x, w), out.value)
    # Contract of the library: W4A16 is exactly kd_linear_f32 on the dequantized weight (same products, same order).
    np.testing.assert_array_equal(out.value, native.NativeOps(lib.kind).linear(x, deq))


def case_linear_w4a16_half(lib, rng, T, n_in, n_out, group, act):
    if lib.kind == "cpu":
        pytest.skip("fp16/bf16 activations are CUDA-only (cpu takes float32)")
    x32 = rng.standard_normal((T, n_in), dtype=np.float32)
    x = x32.astype(np.float16) if act == "f16" else int4.f32_to_bf16(x32)
    x_exact = x.astype(np.float32) if act == "f16" else int4.bf16_to_f32(x)
    packed, scale_bf16, shape = int4.quantize_weight(rng.standard_normal((n_out, n_in), dtype=np.float32), group)
    scale = int4.bf16_to_f32(scale_bf16)
    got = lib.linear_w4a16_half(x, act, packed, scale, n_in, group)
    # the kernel widens each activation exactly, then runs the float32 W4A16 kernel's operations: bit-exact
    np.testing.assert_array_equal(got, lib.linear_w4a16(x_exact, packed, scale, n_in, group))


def case_rms_norm(lib, rng, T, D):
    x = (rng.standard_normal((T, D)) * 3).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    out = Guarded((T, D), np.float32)
    raw_call(lib, "kd_rms_norm", [x, w], [out], T, D, np.float32(1e-6))
    # Sum of squares: D*eps relative on each side (any order), halved by the sqrt; plus ~4 roundings
    # (divide, add eps, reciprocal, two products). Relative to |x*w|/rms.
    want = REF.rms_norm(x, w, 1e-6)
    tol = (D * EPS + 8 * EPS) * np.abs(want) + 1e-30
    assert_close(out.value, want, tol, "rms_norm")


def case_silu_mul(lib, rng, T, I):
    gate = (rng.standard_normal((T, I)) * 8).astype(np.float32)
    gate.flat[:4] = [0.0, -90.0, 90.0, -1e-20][: min(4, gate.size)]
    up = rng.standard_normal((T, I)).astype(np.float32)
    out = Guarded((T, I), np.float32)
    raw_call(lib, "kd_silu_mul", [gate, up], [out], T, I)
    # exp differs by <= 2 ulp between libm/CUDA and numpy's SIMD exp; 1+e, divide and multiply add 3 roundings.
    with np.errstate(over="ignore"):   # the reference's exp(90) overflows to inf: silu(-90) = -0
        want = REF.silu_mul(gate, up)
    assert_close(out.value, want, 8 * EPS * np.abs(want) + 1e-37, "silu_mul")


def case_mla_attention(lib, rng, T, H, L, R, P, vis_kind):
    E, S = L + R, P + T
    q = rng.standard_normal((T, H, E), dtype=np.float32)
    kv = rng.standard_normal((S, E), dtype=np.float32)
    scale = np.float32(E ** -0.5)
    vis = visibility_for(vis_kind, rng, T)
    out = Guarded((T, H, L), np.float32)
    raw_call(lib, "kd_mla_attention", [q, kv, vis], [out], T, H, L, R, P, scale)
    want = REF.mla_attention(q, kv, P, vis, float(scale), L)
    # A score's error is <= E*eps*scale*|q||k| per side (dot in any order); exp turns an absolute score error d into
    # a relative weight error ~d, and the output is a convex combination of value rows, so the error is bounded by
    # (2*score_err + softmax roundings (S + 4)*eps) * max|v|.
    score_err = E * EPS * float(scale) * np.linalg.norm(q, axis=-1).max() * np.linalg.norm(kv, axis=-1).max()
    tol = (4 * score_err + (S + 4) * EPS) * np.abs(kv[:, :L]).max()
    assert_close(out.value, want, tol, "mla_attention")
    np.testing.assert_array_equal(native.NativeOps(lib.kind).mla_attention(q, kv, P, vis, float(scale), L),
                                  out.value)


def case_tree_build(lib, rng, depth, width, budget, ties):
    logp = np.log(rng.dirichlet(np.ones(width) * 0.5, size=depth)).astype(np.float32)
    if ties:
        logp = np.round(logp)
    logp = np.ascontiguousarray(-np.sort(-logp, axis=1), np.float32)
    ids = rng.integers(0, 50000, (depth, width)).astype(np.int32)
    want = tree_ref.tree_build(logp, ids, budget)
    n = want.size
    cap = max(budget, 1)
    words = (cap + 1 + 63) // 64
    tokens, parents, depths = (Guarded((cap,), np.int32) for _ in range(3))
    vis = Guarded(((cap + 1) * words,), np.uint64)
    n_out = np.zeros(1, np.int64)
    c, ffi = lib.c, lib.ffi
    p = lambda g: ffi.cast("void *", g.buf.ctypes.data + GUARD * g.dtype.itemsize)  # noqa: E731
    lib.check(c.kd_tree_build(ffi.cast("float *", logp.ctypes.data), ffi.cast("int32_t *", ids.ctypes.data), depth,
                              width, budget, p(tokens), p(parents), p(depths), cap, p(vis),
                              ffi.cast("int64_t *", n_out.ctypes.data)), "kd_tree_build")
    for g in (tokens, parents, depths, vis):
        g.check_guards("kd_tree_build")
    assert n_out[0] == n
    np.testing.assert_array_equal(tokens.value[:n], want.tokens)
    np.testing.assert_array_equal(parents.value[:n], want.parents)
    np.testing.assert_array_equal(depths.value[:n], want.depths)
    w = (n + 1 + 63) // 64
    np.testing.assert_array_equal(vis.value[:(n + 1) * w].reshape(n + 1, w), want.visibility)
    got = native.NativeOps(lib.kind).tree_build(logp, ids, budget)
    for f in ("tokens", "parents", "depths", "visibility"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))


def case_tree_accept(lib, rng, n, vocab):
    parents = random_parents(rng, n)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    for trial in range(20):
        # bias the target towards the tree so walks go deep: row r's argmax is some child's token
        argmax = rng.integers(0, vocab, n + 1).astype(np.int32)
        for r in range(n + 1):
            kids = np.flatnonzero(parents == r - 1)
            if kids.size and rng.random() < 0.8:
                argmax[r] = tokens[rng.choice(kids)]
        want_path, want_bonus = tree_ref.tree_accept(parents, tokens, argmax)
        path = Guarded((max(n, 1),), np.int32)
        k, bonus = np.zeros(1, np.int64), np.zeros(1, np.int32)
        c, ffi = lib.c, lib.ffi
        lib.check(c.kd_tree_accept(ffi.cast("int32_t *", parents.ctypes.data), ffi.cast("int32_t *", tokens.ctypes.data),
                                   n, ffi.cast("int32_t *", argmax.ctypes.data),
                                   ffi.cast("int32_t *", path.buf.ctypes.data + GUARD * 4),
                                   ffi.cast("int64_t *", k.ctypes.data), ffi.cast("int32_t *", bonus.ctypes.data)),
                  "kd_tree_accept")
        path.check_guards("kd_tree_accept")
        np.testing.assert_array_equal(path.value[:k[0]], want_path)
        assert bonus[0] == want_bonus
        got_path, got_bonus = native.NativeOps(lib.kind).tree_accept(parents, tokens, argmax)
        np.testing.assert_array_equal(got_path, want_path)
        assert got_bonus == want_bonus


CASES = []


def case(fn, **kw):
    name = fn.__name__[len("case_"):]
    cid = f"{name}(" + ",".join(f"{k}={v}" for k, v in kw.items()) + ")"
    CASES.append(pytest.param(fn, kw, cid, id=cid))


for T, n_in, n_out in [(1, 1, 1), (1, 37, 11), (5, 64, 33), (7, 129, 17), (3, 1000, 5), (16, 48, 70)]:
    case(case_linear, T=T, n_in=n_in, n_out=n_out)
for T, n_in, n_out, g in [(1, 32, 3, 32), (5, 64, 7, 32), (3, 96, 5, 32), (2, 256, 9, 128), (4, 40, 6, 8),
                          (1, 8, 1, 8), (9, 160, 13, 32), (2, 1024, 4, 32),
                          # the T = 1 GEMV: odd words per group (8, 24: chunks straddle groups), one chunk per
                          # group (16), eight (128), odd n_out, a tail past the last 16 inputs, and one large
                          # enough to split over the threads
                          (1, 200, 7, 8), (1, 312, 5, 24), (1, 48, 3, 16), (1, 1152, 3, 128), (1, 4104, 257, 8)]:
    case(case_linear_w4a16, T=T, n_in=n_in, n_out=n_out, group=g)
for T, n_in, n_out, g, act in [(1, 64, 5, 32, "f16"), (3, 256, 9, 128, "bf16"), (2, 40, 3, 8, "bf16")]:
    case(case_linear_w4a16_half, T=T, n_in=n_in, n_out=n_out, group=g, act=act)
for T, D in [(1, 1), (3, 7), (5, 64), (2, 1000), (1, 17)]:
    case(case_rms_norm, T=T, D=D)
for T, I in [(1, 1), (1, 5), (4, 33), (3, 1000)]:
    case(case_silu_mul, T=T, I=I)
for T, H, L, R, P, v in [(1, 1, 4, 2, 0, "causal"), (1, 3, 32, 8, 16, "causal"), (5, 3, 32, 8, 12, "tree"),
                         (5, 3, 32, 8, 12, "causal"), (9, 2, 16, 4, 0, "tree"), (9, 2, 16, 4, 3, "causal_packed"),
                         (70, 2, 8, 4, 5, "tree"), (65, 1, 8, 0, 0, "causal"), (4, 4, 64, 16, 100, "tree")]:
    case(case_mla_attention, T=T, H=H, L=L, R=R, P=P, vis_kind=v)
for depth, width, budget, ties in [(1, 1, 1, False), (7, 4, 32, False), (3, 8, 64, False), (5, 3, 0, False),
                                   (6, 8, 512, False), (4, 9, 200, True), (1, 6, 10, False), (8, 2, 300, True),
                                   (7, 8, 64, True)]:
    case(case_tree_build, depth=depth, width=width, budget=budget, ties=ties)
for n, vocab in [(0, 5), (1, 3), (6, 4), (32, 8), (130, 6)]:
    case(case_tree_accept, n=n, vocab=vocab)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn,kw,cid", CASES)
def test_op(backend, fn, kw, cid):
    fn(native.load_library(backend), rng_for(cid), **kw)


# ---- batch invariance: a row's result never depends on the other rows --------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_independent_of_T(backend):
    ops = native.NativeOps(backend)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 96), dtype=np.float32)
    w = rng.standard_normal((21, 96), dtype=np.float32)
    packed, scale, shape = int4.quantize_weight(w, 32)
    w4 = int4.Int4Weight(packed, int4.bf16_to_f32(scale), shape, 32)
    for weight in (w, w4):
        full = ops.linear(x, weight)
        for t in range(9):
            np.testing.assert_array_equal(ops.linear(x[t:t + 1], weight)[0], full[t])
    rw = rng.standard_normal(96).astype(np.float32)
    full = ops.rms_norm(x, rw, 1e-6)
    for t in range(9):
        np.testing.assert_array_equal(ops.rms_norm(x[t:t + 1], rw, 1e-6)[0], full[t])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_row_equals_ar_step(backend):
    """The lossless invariant: a tree node's attention row equals the AR step over its ancestors, bit for bit."""
    ops = native.NativeOps(backend)
    rng = np.random.default_rng(2)
    P, T, H, L, R = 11, 40, 3, 32, 8
    parents = random_parents(rng, T - 1)
    vis = tree_ref.ancestor_visibility(parents)
    q = rng.standard_normal((T, H, L + R), dtype=np.float32)
    kv = rng.standard_normal((P + T, L + R), dtype=np.float32)
    full = ops.mla_attention(q, kv, P, vis, 0.125, L)
    mask = unpack_visibility(vis, T)
    for t in range(T):
        rows = np.concatenate([np.arange(P), P + np.flatnonzero(mask[t])])   # the AR context: ancestors + itself
        ar = ops.mla_attention(q[t:t + 1], np.ascontiguousarray(kv[rows]), len(rows) - 1, None, 0.125, L)
        np.testing.assert_array_equal(ar[0], full[t])


# ---- errors ----------------------------------------------------------------------------------------------------
def test_errors_carry_the_library_message():
    lib = native.load_library("cpu")
    with pytest.raises(NativeError, match="group=12 must be a positive multiple of 8"):
        lib.linear_w4a16(np.zeros((1, 24), np.float32), np.zeros((2, 3), np.int32), np.zeros((2, 2), np.float32),
                         24, 12)
    with pytest.raises(NativeError, match="disagree on in_features"):
        lib.linear_f32(np.zeros((1, 4), np.float32), np.zeros((2, 5), np.float32))
    with pytest.raises(NativeError, match="dtype float64"):
        lib.rms_norm(np.zeros((1, 4)), np.zeros(4, np.float32), 1e-6)
    with pytest.raises(NativeError, match="not C-contiguous"):
        lib.silu_mul(np.zeros((4, 4), np.float32)[:, ::2], np.zeros((4, 2), np.float32))
    with pytest.raises(NativeError, match="CUDA-only"):
        lib.check(lib.c.kd_linear_w4a16_half(lib.ffi.NULL, 1, lib.ffi.NULL, lib.ffi.NULL, lib.ffi.NULL, 1, 8, 1, 8,
                                             lib.ffi.NULL), "kd_linear_w4a16_half")
    assert lib.version == native.ABI_VERSION and lib.backend == "cpu" and lib.device_count == 1
    with pytest.raises(NativeError, match="not found; build it with `make native`"):
        native.load_library("cpu", "/nonexistent/libkdtree_cpu.so")


@needs_cpu_library
def test_library_info_names_the_host_kernels_the_knobs_select():
    """bench.json's provenance says which kernels ran: KDTREE_CPU_GENERIC=1 and KDTREE_CPU_ISA=avx2 are read at
    load, so each case is its own process."""
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    has2, has512 = {"avx2", "fma"} <= flags, {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    want = {"": "avx512" if has2 and has512 else "avx2" if has2 else "generic",
            "KDTREE_CPU_ISA=avx2": "avx2" if has2 else "generic", "KDTREE_CPU_GENERIC=1": "generic"}
    for knob, kernels in want.items():
        env = {k: v for k, v in os.environ.items() if k not in ("KDTREE_CPU_ISA", "KDTREE_CPU_GENERIC")}
        if knob:
            env[knob.split("=")[0]] = knob.split("=")[1]
        r = subprocess.run([sys.executable, "-c", "import json; from kdtree.backends import native; "
                            "print(json.dumps(native.library_info('cpu')))"], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        info = json.loads(r.stdout)
        assert info["host_kernels"] == kernels, (knob, info)
        assert info["abi"] == native.ABI_VERSION and info["library"].endswith("libkdtree_cpu.so")


def test_cuda_library_without_device_fails_cleanly():
    n = native.cuda_device_count()   # never raises
    assert n >= 0
    if not native.library_path("cuda").exists():
        pytest.skip("libkdtree_cuda.so not built (no nvcc)")
    lib = native.load_library("cuda")
    assert lib.backend == "cuda" and lib.version == native.ABI_VERSION
    if n > 0:
        pytest.skip("a CUDA device is present")
    assert "CUDA" in native.CUDA_REASON or "device" in native.CUDA_REASON
    with pytest.raises(NativeError, match="no CUDA device"):
        native.NativeOps("cuda").linear(np.zeros((1, 4), np.float32), np.zeros((2, 4), np.float32))
    # tree ops run on the host in both builds
    path, bonus = native.NativeOps("cuda").tree_accept(np.array([-1], np.int32), np.array([5], np.int32),
                                                       np.array([5, 6], np.int32))
    assert path.tolist() == [0] and bonus == 6


def test_registered_backends():
    from kdtree.backends import get_ops
    assert isinstance(get_ops("cpu"), native.NativeOps) and get_ops("cpu").name == "cpu"


_ISA_SCRIPT = """
import sys, numpy as np
from kdtree.backends import native
from kdtree.quant import int4
rng = np.random.default_rng(4)
ops = native.NativeOps("cpu")
out = {}
# INT4 rows longer than one k block (512) too: the multi-row path dequantizes block by block (AVX-512: 16 weights
# per table lookup, whole groups per chunk; odd words per group and tails take the 8-wide path), BF16 and float32
# scales
for n_in, group in [(96, 32), (40, 8), (256, 128), (1056, 32), (1152, 128), (1048, 8)]:
    packed, scale, shape = int4.quantize_weight(rng.standard_normal((7, n_in), dtype=np.float32), group)
    for sk, sc in (("bf16", int4.bf16_to_f32(scale)), ("f32", int4.bf16_to_f32(scale) * np.float32(1.0001))):
        w = int4.Int4Weight(packed, sc, shape, group)
        assert (w.scale_held.dtype == np.uint16) == (sk == "bf16")
        x = rng.standard_normal((9, n_in), dtype=np.float32)
        for T in (1, 2, 3, 4, 5, 9):   # the GEMV, the fused few-row kernel (2-4), the block-dequantizing tiles
            out[f"w4_{n_in}_{sk}_T{T}"] = ops.linear(x[:T], w)
        for T in (1, 2, 3, 4, 5):      # and a row's bits do not depend on how many rows came with it
            assert np.array_equal(out[f"w4_{n_in}_{sk}_T{T}"], out[f"w4_{n_in}_{sk}_T9"][:T]), (n_in, sk, T)
# exp (silu, the attention's softmax): eight lanes and the tail, the range ends, subnormal results, NaN
g = (rng.standard_normal((3, 37)) * 30).astype(np.float32)
g.flat[:10] = [0.0, -90.0, 90.0, -1e-20, 103.5, -103.5, 88.7, -88.8, 95.0, np.nan]
out["silu"] = ops.silu_mul(g, rng.standard_normal((3, 37)).astype(np.float32))
q, kv = rng.standard_normal((3, 2, 24)).astype(np.float32), rng.standard_normal((16, 24)).astype(np.float32)
out["mla"] = ops.mla_attention(q * 4, kv, 13, None, 0.3, 16)
# the draft top-k's max, exp-sum and selection scan: K2's vocabulary plus a tail, ties, a NaN row, a short row
lg = (3 * rng.standard_normal((4, 163845))).astype(np.float32)
lg[1, 100:200] = lg[1].max()
lg[2, 77] = np.nan
for V in (163845, 5):
    lp, ids = ops.draft_topk(np.ascontiguousarray(lg[:, :V]), 4)
    out[f"topk_lp_{V}"], out[f"topk_ids_{V}"] = lp.copy(), ids.copy()
np.savez(sys.argv[1], **out)
"""


def test_avx2_and_portable_paths_agree_bitwise(tmp_path):
    """KDTREE_CPU_GENERIC=1 forces the portable C loops: they must give the AVX2 path's bits exactly."""
    import os
    import subprocess
    import sys
    files = {}
    for generic in ("0", "1"):
        files[generic] = tmp_path / f"isa{generic}.npz"
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(files[generic])], check=True,
                       env={**os.environ, "KDTREE_CPU_GENERIC": generic})
    a, b = np.load(files["0"]), np.load(files["1"])
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_config_errors_are_one_line():
    from kdtree.backends import get_ops
    from kdtree.config.schema import BackendConfig
    from kdtree.errors import ConfigError
    with pytest.raises(ConfigError, match=r"backend=cpu \(backend.library=/nonexistent.so\).*make native") as e:
        get_ops(BackendConfig(name="cpu", library="/nonexistent.so"))
    assert "\n" not in str(e.value)
    if native.cuda_device_count() == 0:
        with pytest.raises(ConfigError, match="backend=cuda.*use backend=.*numpy") as e:
            get_ops("cuda")
        assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(native.cuda_device_count() == 0, reason="no CUDA device")
def test_cuda_on_torch_memory_and_stream():
    """The documented torch path: device pointers from data_ptr() and torch's current stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    lib = native.load_library("cuda")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 200), dtype=np.float32)
    w = rng.standard_normal((17, 200), dtype=np.float32)
    xt, wt = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    out = torch.empty((3, 17), device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        lib.check(lib.c.kd_linear_f32(lib.ptr("float *", xt.data_ptr()), lib.ptr("float *", wt.data_ptr()),
                                      lib.ptr("float *", out.data_ptr()), 3, 200, 17,
                                      lib.stream(torch.cuda.current_stream().cuda_stream)), "kd_linear_f32")
    stream.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), native.NativeOps("cuda").linear(x, w))


def test_a_library_of_another_abi_version_is_refused_naming_make_native(tmp_path):
    """A libkdtree_cpu.so built from an older header (kd_version() = 1) must not be used: one line, the fix."""
    src = tmp_path / "old.c"
    src.write_text("int kd_version(void) { return 1; }\n")
    lib = tmp_path / "libkdtree_cpu.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    with pytest.raises(NativeError, match=rf"ABI version 1, kdtree expects {native.ABI_VERSION}; rebuild it with "
                                          r"`make native`"):
        native.load_library("cpu", str(lib))


_EXIT_AFTER_PARALLEL = """
import sys, numpy as np
from kdtree.backends import native
lib = native.load_library("cpu")
lib.set_threads(2)
w = np.ones((2048, 1024), np.float32); x = np.ones((17, 1024), np.float32)
for _ in range(3): lib.linear_f32(x, w)
"""


@needs_cpu_library
def test_a_process_that_ends_right_after_a_parallel_call_exits_0():
    """The interpreter's exit closes the library (cffi's dlclose) while the OpenMP workers of the last parallel region
    may still spin in libgomp: unmapped, they died with SIGSEGV in ~1 exit of 5-15 (a failed exit code for every
    caller: a pipeline stage, a server, a subprocess test). The library is linked -z nodelete: 24 exits, all 0."""
    codes = []
    for _ in range(24):
        r = subprocess.run([sys.executable, "-c", _EXIT_AFTER_PARALLEL], capture_output=True, text=True, timeout=120)
        codes.append(r.returncode)
    assert codes.count(0) == len(codes), f"exit codes {codes}: the library was unmapped under its OpenMP workers"


@needs_cpu_library
def test_backend_threads_is_checked_and_set_process_wide(monkeypatch):
    """backend.threads: a bad value is one ConfigError naming it; a good one is what every parallel region of the
    library then uses (kd_threads), whichever thread calls; 0 gives OpenMP's default back. auto_threads: an
    explicit value wins, then OMP_NUM_THREADS, then cores / tp, less one for a serving process, at least 1."""
    import os
    import threading
    from types import SimpleNamespace

    from kdtree.errors import ConfigError
    for bad in (-1, "many"):
        with pytest.raises(ConfigError, match=r"backend.threads=.* must be an integer >= 0"):
            native.make_ops("cpu", SimpleNamespace(name="cpu", library="", threads=bad))
    ops = native.make_ops("cpu", SimpleNamespace(name="cpu", library="", threads=3))
    seen = []
    t = threading.Thread(target=lambda: seen.append(ops.lib.threads))
    t.start(), t.join()
    assert ops.lib.threads == 3 and seen == [3]                  # not omp_set_num_threads' calling thread only
    assert ops.lib.set_threads(0) >= 1
    cfg = SimpleNamespace(threads=0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert native.auto_threads(cfg) == cores
    assert native.auto_threads(cfg, tp=2, serving=True) == max(1, cores // 2 - 1)
    assert native.auto_threads(SimpleNamespace(threads=5), tp=8, serving=True) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert native.auto_threads(cfg, serving=True) == 7


@needs_cpu_library
@pytest.mark.parametrize("V", [5, 260, 5000, 163840])
def test_draft_topk_matches_the_numpy_reference(V):
    """kd_draft_topk (one C call per round instead of numpy's log-softmax + stable argsort): the reference's ids,
    its tie order (equal log-probs in ascending id) and NaN placement (after every number); log-probs within an
    ulp or two (the sum of exps accumulates in double here, pairwise float32 in numpy)."""
    ops = native.NativeOps("cpu")
    rng = np.random.default_rng(V)
    logits = (3 * rng.standard_normal((7, V))).astype(np.float32)
    logits[1] = 0.25                                                     # a flat row: the lowest ids
    logits[2, rng.choice(V, min(V, 6), replace=False)] = logits[2].max() + 2   # equal maxima across the w-th place
    logits[3, rng.choice(V, max(1, V // 2), replace=False)] = np.nan     # NaN anywhere: numpy's row is all NaN
    logits[4, -1] = -np.inf
    for width in (1, 4, 10):
        with np.errstate(invalid="ignore"):
            want_lp, want_ids = tree_ref.draft_topk(logits, width)
        lp, ids = ops.draft_topk(logits, width)
        assert lp.shape == ids.shape == (7, min(width, V))
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(lp, want_lp, rtol=1e-6, atol=1e-6, equal_nan=True)
    with pytest.raises(NativeError, match=r"draft_topk: width=0 must be an int >= 1"):
        ops.draft_topk(logits, 0)
    with pytest.raises(NativeError, match=r"draft_topk: logits shape \(3,\); expected \[depth, V\]"):
        ops.draft_topk(np.zeros(3, np.float32), 4)
