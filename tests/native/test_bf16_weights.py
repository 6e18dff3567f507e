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
from tests.weights import int4_experts

pytestmark = needs_cpu_library

TS = [1, 2, 3, 5, 9, 17, 33]
SIZES = [(1, 1), (7, 5), (15, 3), (16, 4), (17, 9), (33, 7), (100, 13), (257, 6), (1023, 5), (1030, 11),
         (2051, 3), (4113, 5)]   # (n_in, n_out): n_in % 16 != 0 mostly; > 1024: the k-blocked path; > 4096: the
                                 # BF16 GEMV's permuted copy of x on the heap


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


# ---- the absorbed MLA's per-head linears (kv_b_proj is BF16 in K2.6) ----------------------------------------

_HEAD_CASE = ("import numpy as np, sys; from kdtree.backends import native; from kdtree.bf16 import bf16_to_f32, "
              "f32_to_bf16\n"
              "lib = native.load_library('cpu'); ffi = lib.ffi; rng = np.random.default_rng(5); out = []\n"
              "def call(fn, x, w, T, H, n_in, n_out, pad):\n"
              "  o = np.zeros((T, H, n_out + pad), np.float32)\n"
              "  p = lambda a, t='float *': ffi.cast(t, a.ctypes.data)\n"
              "  lib.check(getattr(lib.c, fn)(p(x), H * (n_in + pad), n_in + pad, p(w, 'float *' if w.dtype == "
              "np.float32 else 'uint16_t *'), p(o), H * (n_out + pad), n_out + pad, T, H, n_in, n_out, ffi.NULL), fn)\n"
              "  return o\n"
              "for H, n_in, n_out in [(3, 20, 12), (4, 128, 33), (2, 512, 7), (2, 1030, 5)]:\n"
              "  w16 = f32_to_bf16(rng.standard_normal((H, n_out, n_in), dtype=np.float32))\n"
              "  w16[..., ::11] = 0x8000; w16[..., 3::13] = 0x0001\n"
              "  w32 = np.ascontiguousarray(bf16_to_f32(w16))\n"
              "  for T in (1, 2, 5, 17):\n"
              "    x = rng.standard_normal((T, H, n_in + 3), dtype=np.float32)\n"
              "    a = call('kd_head_linear_bf16', x, w16, T, H, n_in, n_out, 2)\n"
              "    b = call('kd_head_linear_f32', x, w32, T, H, n_in, n_out, 2)\n"
              "    assert np.array_equal(a, b), (H, n_in, n_out, T); assert (a[..., n_out:] == 0).all()\n"
              "    out.append(a.tobytes())\n"
              "sys.stdout.write(__import__('hashlib').sha256(b''.join(out)).hexdigest())\n")


def test_head_linear_bf16_equals_f32_on_widened_avx2_and_portable():
    """kd_head_linear_bf16 (W_uk^T / W_uv kept as kv_b_proj's BF16 bits) gives kd_head_linear_f32's bits on the
    widened weights -- strided rows, T = 1 (the streamed dots) and T >= 2 (the register tiles; n_in > 1024: the
    dots again), the padding untouched -- on the AVX2 path and the portable one (KDTREE_CPU_GENERIC=1), and both
    paths agree."""
    env, digests = dict(os.environ), []
    for generic in ("1", "0"):
        env["KDTREE_CPU_GENERIC"] = generic
        r = subprocess.run([sys.executable, "-c", _HEAD_CASE], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        digests.append(r.stdout)
    assert digests[0] == digests[1] and len(digests[0]) == 64


def test_head_linear_bf16_rejects_a_null_weight():
    lib = native.load_library("cpu")
    ffi = lib.ffi
    x, o = np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 3), np.float32)
    px, po = ffi.cast("float *", x.ctypes.data), ffi.cast("float *", o.ctypes.data)
    rc = lib.c.kd_head_linear_bf16(px, 8, 4, ffi.NULL, po, 6, 3, 1, 2, 4, 3, ffi.NULL)
    with pytest.raises(native.NativeError, match="kd_head_linear_bf16: w is NULL"):
        lib.check(rc, "kd_head_linear_bf16")


# ---- the whole native forward over BF16 weights --------------------------------------------------------------

def _bf16_pair(weights):
    """(BF16 bits of every float tensor, the same widened to float32); INT4 weights shared as they are"""
    bits, wide = {}, {}
    for k, v in weights.items():
        if isinstance(v, np.ndarray) and v.dtype == np.float32:
            bits[k] = f32_to_bf16(v)
            wide[k] = np.ascontiguousarray(bf16_to_f32(bits[k]))
        else:
            bits[k] = wide[k] = v
    return bits, wide


@pytest.mark.parametrize("quant", ["bf16", "int4_w4a16"])
def test_native_forward_of_bf16_weights_is_bit_identical_to_widened(tiny_cfg, tiny_weights, quant):
    """Every tensor BF16 bits (u16) vs the same widened to float32: logits, hidden states and latent caches equal
    bit for bit over prefill, an AR step, a tree verify and a keep; INT4 experts (K2.6's layout) likewise."""
    from kdtree.backends.native_forward import NativeTarget
    from tests.native.test_native_forward import _steps
    src = int4_experts(tiny_weights) if quant == "int4_w4a16" else tiny_weights
    bits, wide = _bf16_pair(src)
    ops = native.NativeOps("cpu")
    a, b = NativeTarget(tiny_cfg, bits, ops), NativeTarget(tiny_cfg, wide, ops)
    assert a.embed_tokens.dtype == np.uint16 and a._desc.embed_bf16 != native.load_library("cpu").ffi.NULL
    assert a._desc.lm_head.bf16 != native.load_library("cpu").ffi.NULL and a._desc.lm_head.f32 == \
        native.load_library("cpu").ffi.NULL
    ffi = native.load_library("cpu").ffi
    for ly in (a._desc.layers[i] for i in range(tiny_cfg.num_hidden_layers)):   # the absorbed MLA as BF16 too
        assert ly.w_uk_t_bf16 != ffi.NULL and ly.w_uv_bf16 != ffi.NULL and ly.w_uk_t == ffi.NULL and ly.w_uv == ffi.NULL
    moe = [a._desc.layers[i] for i in range(tiny_cfg.num_hidden_layers) if a._desc.layers[i].is_moe]
    assert moe and all(ly.router_bf16 != ffi.NULL and ly.router == ffi.NULL for ly in moe)   # the router gate too
    assert b._desc.layers[0].w_uk_t != ffi.NULL and b._desc.layers[0].w_uk_t_bf16 == ffi.NULL
    (oa, ca), (ob, cb) = _steps(a), _steps(b)
    for step, ((la, ha), (lb, hb)) in enumerate(zip(oa, ob)):
        np.testing.assert_array_equal(la, lb, err_msg=f"logits of step {step}")
        assert sorted(ha) == sorted(hb)
        for layer in ha:
            np.testing.assert_array_equal(ha[layer], hb[layer], err_msg=f"hidden {layer} of step {step}")
    for layer in range(tiny_cfg.num_hidden_layers):
        np.testing.assert_array_equal(ca.kv[layer][:ca.length], cb.kv[layer][:cb.length])


def test_int4_scales_held_as_bf16_give_the_bits_of_float32_scales(tiny_cfg, tiny_weights):
    """K2.6's INT4 experts keep their BF16 group scales (half the scale bytes the forward streams): the native
    forward over them equals, bit for bit, the same weights with the scales widened to float32 -- logits, hidden
    states and caches over prefill, an AR step, a tree verify and a keep."""
    from kdtree.backends.native_forward import NativeTarget
    from kdtree.quant.int4 import Int4Weight
    from tests.native.test_native_forward import _steps
    held = int4_experts(tiny_weights)
    wide = dict(held)
    for k, v in held.items():
        if isinstance(v, Int4Weight):
            assert v.scale_held.dtype == np.uint16                      # what the loader and the quantizer hold
            wide[k] = w = Int4Weight(v.packed, v.scale, v.shape, v.group_size)
            w._scale = v.scale                                   # the same values held as float32
            assert w.scale_held.dtype == np.float32 and w.nbytes > v.nbytes
    ops = native.NativeOps("cpu")
    a, b = NativeTarget(tiny_cfg, held, ops), NativeTarget(tiny_cfg, wide, ops)
    ffi = native.load_library("cpu").ffi
    e = a._desc.layers[1].experts[0].gate
    assert e.scales_bf16 != ffi.NULL and e.scales == ffi.NULL
    (oa, ca), (ob, cb) = _steps(a), _steps(b)
    for step, ((la, ha), (lb, hb)) in enumerate(zip(oa, ob)):
        np.testing.assert_array_equal(la, lb, err_msg=f"logits of step {step}")
        for layer in ha:
            np.testing.assert_array_equal(ha[layer], hb[layer], err_msg=f"hidden {layer} of step {step}")
    for layer in range(tiny_cfg.num_hidden_layers):
        np.testing.assert_array_equal(ca.kv[layer][:ca.length], cb.kv[layer][:cb.length])


def test_native_drafter_of_bf16_weights_is_bit_identical_to_widened(tiny_cfg, tiny_weights):
    from kdtree.backends.native_drafter import NativeDrafter
    from kdtree.model.names import drafter_tensor_shapes, init_weights
    tb, tw = _bf16_pair(tiny_weights)
    db, dw = _bf16_pair(init_weights(drafter_tensor_shapes(tiny_cfg), seed=1))
    ops = native.NativeOps("cpu")
    a = NativeDrafter(tiny_cfg, db, ops, tb["model.embed_tokens.weight"], tb["lm_head.weight"])
    b = NativeDrafter(tiny_cfg, dw, ops, tw["model.embed_tokens.weight"], tw["lm_head.weight"])
    rng = np.random.default_rng(0)
    ca, cb = a.new_cache(32), b.new_cache(32)
    for n in (6, 1, 3):
        chunk = {i: rng.standard_normal((n, tiny_cfg.hidden_size)).astype(np.float32)
                 for i in tiny_cfg.drafter.target_layer_ids}
        a.extend(ca, chunk), b.extend(cb, chunk)
        for bonus in (5, 200):
            np.testing.assert_array_equal(a.draft(ca, bonus), b.draft(cb, bonus))


# ---- quant=bf16 end to end: the loader keeps BF16, greedy DDTree == AR ----------------------------------------

def _engine(kdtree_cache, *overrides):
    from hydra import compose, initialize_config_dir
    from kdtree.engine import Engine
    from kdtree.pipeline.registry import register_schema
    from tests.conftest import REPO
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", *overrides])
    return Engine.from_config(cfg)


def test_quant_bf16_keeps_bf16_in_memory_and_ddtree_equals_ar(kdtree_cache):
    from kdtree.decode import generate
    from omegaconf import OmegaConf
    from tests.conftest import REPO
    engine = _engine(kdtree_cache, "quant=bf16", "backend=cpu", "tree=ddtree")
    try:
        m = engine.model
        assert m.embed_tokens.dtype == np.uint16                  # held as stored, not widened
        assert all(isinstance(x, np.ndarray) and x.dtype == np.uint16 for x in m._reg.keep
                   if isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[0] == m.vocab)
        ids = engine.tokenizer.encode("def f(x):")
        ar = generate(m, None, OmegaConf.load(REPO / "conf" / "tree" / "ar.yaml"), ids, 12).tokens
        dd = generate(m, engine.drafter, engine.cfg.tree, ids, 12)
        assert dd.tokens == ar and len(ar) == 12
    finally:
        engine.close()


def test_loader_bf16_keeps_uint16_views_and_widens_int4_scales(kdtree_cache, tiny_cfg):
    from kdtree.checkpoint.loader import load_checkpoint, plan_load
    from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
    from kdtree.config.schema import group_config
    q = group_config("quant", "bf16")
    path = ensure_tiny_checkpoint(tiny_cfg, q, str(kdtree_cache))
    kept, _ = load_checkpoint(path, tiny_cfg, q, bf16=True)
    wide, _ = load_checkpoint(path, tiny_cfg, q)
    assert set(kept) == set(wide)
    for k, v in kept.items():
        assert v.dtype == np.uint16 and wide[k].dtype == np.float32, k
        np.testing.assert_array_equal(bf16_to_f32(v), wide[k])
    p_kept, p_wide = plan_load(path, tiny_cfg, q, bf16=True), plan_load(path, tiny_cfg, q)
    assert p_kept.copied_bytes == 0 and p_kept.view_bytes * 2 == p_wide.copied_bytes
