"""kd_moe_f32 and kd_head_linear_f32 on both builds (cuda needs a device): close to a float64 reference, every
token's row independent of T, and (cpu) equal to the unfused ops bit for bit. Direct C calls; on cuda the
arrays go through kd_malloc/kd_memcpy and the expert pointer tables hold device addresses.

Run: .venv/bin/python -m pytest -q tests/native/test_fused_ops.py
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.backends import native
from tests.native_lib import needs_cpu_library

BACKENDS = [
    pytest.param("cpu", marks=needs_cpu_library),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        native.cuda_device_count() == 0, reason=f"no CUDA device: {native.CUDA_REASON}")]),
]


class _Mem:
    """Host arrays -> pointers for the library kind (cuda: device copies kept alive here)."""

    def __init__(self, lib):
        self.lib, self.keep = lib, []

    def ptr(self, a, ctype="float *"):
        ffi = self.lib.ffi
        if self.lib.kind == "cpu":
            self.keep.append(a)
            return ffi.cast(ctype, a.ctypes.data)
        d = self.lib.device_array(np.ascontiguousarray(a))
        self.keep.append(d)
        return ffi.cast(ctype, d.addr)

    def out(self, shape):
        a = np.zeros(shape, np.float32)
        return a, self.ptr(a)

    def fetch(self, a, p):
        if self.lib.kind == "cuda":
            self.lib.check(self.lib.c.kd_synchronize(self.lib.ffi.NULL), "sync")
            d = next(d for d in self.keep if not isinstance(d, np.ndarray) and d.addr == int(self.lib.ffi.cast("uintptr_t", p)))
            d.download(a)
        return a


def _moe_case(rng, T, E=6, D=24, I=40, Is=16, k=2, shared=True):
    x = rng.standard_normal((T, D), dtype=np.float32)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.random((T, k), dtype=np.float32)
    ex = [tuple(rng.standard_normal(s, dtype=np.float32) * 0.3 for s in ((I, D), (I, D), (D, I))) for _ in range(E)]
    sh = tuple(rng.standard_normal(s, dtype=np.float32) * 0.3 for s in ((Is, D), (Is, D), (D, Is))) if shared else None
    return x, experts, weights, ex, sh


def _moe_ref(x, experts, weights, ex, sh):
    x64 = x.astype(np.float64)
    silu = lambda g: g / (1 + np.exp(-g))
    mlp = lambda m, r: (silu(r @ m[0].T.astype(np.float64)) * (r @ m[1].T.astype(np.float64))) @ m[2].T.astype(np.float64)
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            out[t] += weights[t, j] * mlp(ex[experts[t, j]], x64[t:t + 1])[0]
        if sh is not None:
            out[t] += mlp(sh, x64[t:t + 1])[0]
    return out


def _moe_call(lib, x, experts, weights, ex, sh):
    mem, ffi = _Mem(lib), lib.ffi
    T, D = x.shape
    tabs = [ffi.new("float *[]", [mem.ptr(m[i]) for m in ex]) for i in range(3)]
    shp = [mem.ptr(a) for a in sh] if sh is not None else [ffi.NULL] * 3
    out, po = mem.out((T, D))
    rc = lib.c.kd_moe_f32(mem.ptr(x), ffi.cast("int32_t *", experts.ctypes.data), ffi.cast("float *", weights.ctypes.data),
                          *tabs, len(ex), *shp, po, T, D, ex[0][0].shape[0], sh[0].shape[0] if sh else 0,
                          experts.shape[1], ffi.NULL)
    lib.check(rc, "kd_moe_f32")
    return mem.fetch(out, po)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", [True, False])
def test_moe_f32_reference_and_row_invariance(backend, shared):
    lib = native.load_library(backend)
    rng = np.random.default_rng(11)
    x, experts, weights, ex, sh = _moe_case(rng, 13, shared=shared)
    full = _moe_call(lib, x, experts, weights, ex, sh)
    np.testing.assert_allclose(full, _moe_ref(x, experts, weights, ex, sh), rtol=1e-4, atol=1e-4)
    for t in range(13):
        one = _moe_call(lib, x[t:t + 1], experts[t:t + 1], weights[t:t + 1], ex, sh)
        np.testing.assert_array_equal(one[0], full[t])
    for s, e in [(0, 4), (3, 11), (5, 13)]:
        np.testing.assert_array_equal(_moe_call(lib, x[s:e], experts[s:e], weights[s:e], ex, sh), full[s:e])


def test_moe_f32_cpu_equals_unfused_ops():
    ops = native.NativeOps("cpu")
    rng = np.random.default_rng(12)
    x, experts, weights, ex, sh = _moe_case(rng, 9)
    fused = _moe_call(ops.lib, x, experts, weights, ex, sh)
    mlp = lambda m, r: ops.linear(ops.silu_mul(ops.linear(r, m[0]), ops.linear(r, m[1])), m[2])
    acc = np.zeros(x.shape, np.float32)
    for j in range(experts.shape[1]):
        y = np.stack([mlp(ex[experts[t, j]], x[t:t + 1])[0] for t in range(9)])
        acc = acc + weights[:, j:j + 1] * y
    acc = acc + mlp(sh, x)
    np.testing.assert_array_equal(fused, acc)


def test_moe_f32_rejects_bad_expert_ids():
    lib = native.load_library("cpu")
    rng = np.random.default_rng(13)
    x, experts, weights, ex, sh = _moe_case(rng, 3)
    experts[1, 0] = 6
    with pytest.raises(native.NativeError, match="expert id 6"):
        _moe_call(lib, x, experts, weights, ex, sh)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_linear_reference_and_row_invariance(backend):
    lib = native.load_library(backend)
    rng = np.random.default_rng(14)
    T, H, n_in, n_out, pad = 11, 5, 20, 12, 3
    x = rng.standard_normal((T, H, n_in + pad), dtype=np.float32)
    w = rng.standard_normal((H, n_out, n_in), dtype=np.float32)

    def call(rows):
        mem, ffi = _Mem(lib), lib.ffi
        xs = np.ascontiguousarray(x[rows])
        out, po = mem.out((len(xs), H, n_out + pad))
        lib.check(lib.c.kd_head_linear_f32(mem.ptr(xs), H * (n_in + pad), n_in + pad, mem.ptr(w), po, H * (n_out + pad),
                                           n_out + pad, len(xs), H, n_in, n_out, ffi.NULL), "kd_head_linear_f32")
        return mem.fetch(out, po)

    full = call(slice(0, T))
    ref = np.einsum("thi,hoi->tho", x[:, :, :n_in].astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(full[:, :, :n_out], ref, rtol=1e-4, atol=1e-4)
    assert (full[:, :, n_out:] == 0).all()
    for t in range(T):
        np.testing.assert_array_equal(call(slice(t, t + 1))[0], full[t])
    # BF16 weights (K2's kv_b_proj as stored): kd_head_linear_bf16 gives kd_head_linear_f32's bits on the widened ones
    from kdtree.bf16 import bf16_to_f32, f32_to_bf16
    w16 = f32_to_bf16(w)
    mem, ffi = _Mem(lib), lib.ffi
    xs = np.ascontiguousarray(x)
    outs = []
    for fn, wt, ctype in (("kd_head_linear_bf16", w16, "uint16_t *"),
                          ("kd_head_linear_f32", np.ascontiguousarray(bf16_to_f32(w16)), "float *")):
        out, po = mem.out((T, H, n_out + pad))
        lib.check(getattr(lib.c, fn)(mem.ptr(xs), H * (n_in + pad), n_in + pad, mem.ptr(wt, ctype), po,
                                     H * (n_out + pad), n_out + pad, T, H, n_in, n_out, ffi.NULL), fn)
        outs.append(mem.fetch(out, po))
    np.testing.assert_array_equal(outs[0], outs[1])
