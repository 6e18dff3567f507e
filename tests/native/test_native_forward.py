"""The whole-model native forward (kd_model_forward, kd_drafter_extend / kd_drafter_draft: one library call each)
against the numpy reference (K2Model / DFlashDrafter over NumpyOps), and its batch invariance.

Tolerances: the native forward runs the same float32 formulas as the reference, but its fixed-order dot products
(16 lanes, pairwise combine) round differently from numpy's BLAS GEMVs, and expf/cos differ from numpy's by an
ulp; through 4 layers that stays below 1e-4 absolute on logits of magnitude ~1 (max seen ~1e-5). INT4 adds no
error of its own: the packed weights are dequantized to the same float32 values in both.

Run: .venv/bin/python -m pytest -q tests/native/test_native_forward.py
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from kdtree.backends import native
from kdtree.backends.native_drafter import NativeDrafter
from kdtree.backends.native_forward import NativeTarget
from kdtree.model.names import drafter_tensor_shapes, init_weights
from kdtree.model.target import build_drafter, build_target
from kdtree.tree import ancestor_visibility
from tests.native_lib import needs_cpu_library
from tests.weights import int4_experts

pytestmark = needs_cpu_library

PROMPT = np.array([256, 50, 43, 50, 61, 10, 99], np.int32)
TOL = dict(rtol=1e-4, atol=1e-4)


def _models(cfg, weights):
    from kdtree.backends.numpy_ops import NumpyOps
    from kdtree.model.k2 import K2Model
    ref = K2Model(cfg, weights, NumpyOps())
    nat = build_target(cfg, weights, native.NativeOps("cpu"))
    assert isinstance(nat, NativeTarget), "backend=cpu did not pick the native forward"
    return ref, nat


def _steps(m):
    """prefill, AR step, tree verify (ancestor visibility), then keep the accepted rows and one more AR step."""
    layers = (1, 3)
    c = m.new_cache(64)
    out = [m.forward(PROMPT, np.arange(len(PROMPT)), c, hidden_layers=layers)]
    out.append(m.forward(np.array([7], np.int32), np.array([len(PROMPT)]), c))
    parents = np.array([-1, 0, 0, 1, 3, -1], np.int32)
    vis = ancestor_visibility(parents)
    depths = np.array([1, 2, 2, 3, 4, 1])
    start = c.length
    block = np.array([5, 9, 10, 11, 12, 13, 14], np.int32)
    out.append(m.forward(block, start + np.concatenate([[0], depths]), c, visibility=vis, hidden_layers=layers))
    c.keep(start, start + np.array([0, 1, 2, 4]))
    out.append(m.forward(np.array([3], np.int32), np.array([start + 4]), c, hidden_layers=layers))
    return out, c


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_target_forward_matches_numpy_reference(tiny_cfg, tiny_weights, quant):
    weights = int4_experts(tiny_weights) if quant == "int4" else tiny_weights
    ref, nat = _models(tiny_cfg, weights)
    (r_out, r_cache), (n_out, n_cache) = _steps(ref), _steps(nat)
    for step, ((rl, rh), (nl, nh)) in enumerate(zip(r_out, n_out)):
        np.testing.assert_allclose(nl, rl, **TOL, err_msg=f"logits of step {step}")
        assert np.array_equal(nl.argmax(-1), rl.argmax(-1)), f"argmax of step {step}"
        assert sorted(nh) == sorted(rh)
        for layer in rh:
            np.testing.assert_allclose(nh[layer], rh[layer], **TOL, err_msg=f"hidden {layer} of step {step}")
    assert n_cache.length == r_cache.length
    for layer in range(tiny_cfg.num_hidden_layers):
        np.testing.assert_allclose(n_cache.kv[layer][:n_cache.length], r_cache.kv[layer][:r_cache.length], **TOL)


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_target_forward_rows_are_batch_invariant(tiny_cfg, tiny_weights, quant):
    """A row's logits are bit-identical alone, inside a longer block, and with another sequence in the call."""
    weights = int4_experts(tiny_weights) if quant == "int4" else tiny_weights
    _, m = _models(tiny_cfg, weights)
    block = np.random.default_rng(3).integers(0, 256, 33).astype(np.int32)
    pos = len(PROMPT) + np.arange(len(block))

    def prefilled(prompt=PROMPT):
        c = m.new_cache(128)
        m.forward(prompt, np.arange(len(prompt)), c)
        return c

    c1 = prefilled()
    lg, _ = m.forward(block, pos, c1)
    c2 = prefilled()
    one = np.concatenate([m.forward(block[i:i + 1], pos[i:i + 1], c2)[0] for i in range(len(block))])
    np.testing.assert_array_equal(lg, one)
    for layer in range(tiny_cfg.num_hidden_layers):
        np.testing.assert_array_equal(c1.kv[layer][:c1.length], c2.kv[layer][:c2.length])

    # two sequences in one call (the batched ABI): each row equals its own sequence's forward alone
    other = np.array([256, 3, 4], np.int32)
    ca, cb = prefilled(), prefilled(other)
    parents = np.array([-1, 0, 0, 2], np.int32)                     # sequence b verifies a small tree
    tree_vis, tree_pos = ancestor_visibility(parents), len(other) + np.array([0, 1, 2, 2, 3])
    logits, argmax, hid = m.forward_batch([(block[:9], pos[:9], ca, None),
                                           (block[:5], tree_pos, cb, tree_vis)], hidden_layers=(2,))
    np.testing.assert_array_equal(logits[:9], lg[:9])
    cc = prefilled(other)
    alone, alone_hid = m.forward(block[:5], tree_pos, cc, visibility=tree_vis, hidden_layers=(2,))
    np.testing.assert_array_equal(logits[9:], alone)
    np.testing.assert_array_equal(hid[2][9:], alone_hid[2])
    np.testing.assert_array_equal(argmax, logits.argmax(-1))
    assert (ca.length, cb.length) == (len(PROMPT) + 9, len(other) + 5)


def test_native_forward_equals_per_op_path_tokens(tiny_cfg, tiny_weights):
    """The whole forward and the per-op native path (same kernels, routing in numpy) pick the same tokens."""
    from tests.decode.loops import generate_ar
    from kdtree.model.k2 import K2Model
    per_op = native.NativeOps("cpu")
    per_op.native_forward = False
    a = generate_ar(K2Model(tiny_cfg, tiny_weights, per_op), PROMPT, 24)
    b = generate_ar(build_target(tiny_cfg, tiny_weights, native.NativeOps("cpu")), PROMPT, 24)
    assert a.tokens == b.tokens


class _CallLog:
    """The library's function table, recording every name looked up on it (each call looks its function up)."""

    def __init__(self, c):
        self._c, self.names = c, set()

    def __getattr__(self, name):
        self.names.add(name)
        return getattr(self._c, name)


def test_the_factory_picks_the_target_and_k2model_is_always_the_per_op_path(tiny_cfg, tiny_weights, monkeypatch):
    """build_target: NativeTarget for backend=cpu, K2Model for numpy (and for a CUDA library without a device);
    build_drafter likewise. K2Model over NativeOps holds no native twin and its forward never reaches
    kd_model_forward: it runs the per-op kernels, whose results equal the whole forward's tokens."""
    from kdtree.backends.numpy_ops import NumpyOps
    from kdtree.model.drafter import DFlashDrafter
    from kdtree.model.k2 import K2Model
    from kdtree.model.target import Drafter, Target
    ops = native.NativeOps("cpu")
    dw = init_weights(drafter_tensor_shapes(tiny_cfg), seed=1)
    nat = build_target(tiny_cfg, tiny_weights, ops)
    assert isinstance(nat, NativeTarget) and isinstance(nat, Target)
    assert isinstance(build_drafter(tiny_cfg, dw, nat), NativeDrafter)
    ref = build_target(tiny_cfg, tiny_weights, NumpyOps())
    assert type(ref) is K2Model and isinstance(ref, Target)
    assert type(build_drafter(tiny_cfg, dw, ref)) is DFlashDrafter and isinstance(build_drafter(tiny_cfg, dw, ref),
                                                                                   Drafter)
    if native.library_path("cuda").exists() and native.load_library("cuda").device_count == 0:
        assert type(build_target(tiny_cfg, tiny_weights, native.NativeOps("cuda"))) is K2Model   # the per-op path

    per_op = K2Model(tiny_cfg, tiny_weights, ops)
    assert not [k for k in vars(per_op) if "native" in k], "K2Model holds a native twin"
    log = _CallLog(ops.lib.c)
    monkeypatch.setattr(ops.lib, "c", log)
    monkeypatch.setattr(ops, "_c", log)
    c = per_op.new_cache(32)
    logits, _ = per_op.forward(PROMPT, np.arange(len(PROMPT)), c)
    per_op.forward_batch([(PROMPT[:1], np.array([len(PROMPT)]), c, None)])
    assert type(c).__name__ == "LatentCache"
    assert "kd_model_forward" not in log.names and "kd_linear_f32" in log.names, sorted(log.names)
    monkeypatch.undo()
    want, _ = nat.forward(PROMPT, np.arange(len(PROMPT)), nat.new_cache(32))
    assert np.array_equal(logits.argmax(-1), want.argmax(-1))


def test_bad_forward_input_is_one_clear_error(tiny_cfg, tiny_weights):
    _, m = _models(tiny_cfg, tiny_weights)
    c = m.new_cache(8)
    with pytest.raises(native.NativeError, match="token 999"):
        m.forward(np.array([999], np.int32), np.array([0]), c)
    with pytest.raises(Exception, match="cannot hold 0 \\+ 9 tokens"):
        m.forward(np.arange(9, dtype=np.int32), np.arange(9), c)
    m.forward(PROMPT[:3], np.arange(3), c)
    with pytest.raises(ValueError, match="rows must ascend"):
        c.keep(1, [2, 1])
    with pytest.raises(ValueError, match=r"within \[2, 3\)"):
        c.keep(2, [2, 3])
    with pytest.raises(ValueError, match=r"page table of 1 pages \(16 rows\) cannot hold 0 \+ 21 rows"):
        m.move_rows(c.pages, 0, np.array([20]))                       # the library's own reason, not a guess
    with pytest.raises(ValueError, match="outside"):
        c.truncate(5)
    n = int(tiny_cfg.num_hidden_layers)   # a layer that never comes: an error, not an unwritten (garbage) column
    with pytest.raises(native.NativeError, match=rf"hidden_layers\[1\]={n} is not a layer of this model \(0..{n - 1}\)"):
        m.forward(PROMPT[:1], np.array([3]), c, hidden_layers=[1, n])
    assert c.length == 3                              # refused before anything ran
    _, other = _models(tiny_cfg, tiny_weights)        # another model's pool: its page ids mean nothing here
    with pytest.raises(ValueError, match="not made by this model"):
        m.forward(PROMPT[:1], np.array([3]), other.new_cache(8))


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_drafter_matches_numpy_reference(tiny_cfg, tiny_weights, quant):
    from kdtree.backends.numpy_ops import NumpyOps
    from kdtree.model.drafter import DFlashDrafter
    weights = int4_experts(tiny_weights) if quant == "int4" else tiny_weights
    if quant == "int4":   # the shared lm_head packed too: the drafter must take it packed
        from kdtree.quant import int4
        packed, scale, shape = int4.quantize_weight(tiny_weights["lm_head.weight"], 32)
        weights["lm_head.weight"] = int4.Int4Weight(packed, int4.bf16_to_f32(scale), shape, 32)
    dw = init_weights(drafter_tensor_shapes(tiny_cfg), seed=1)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    ref = DFlashDrafter(tiny_cfg, dw, NumpyOps(), embed, head)
    nat = NativeDrafter(tiny_cfg, dw, native.NativeOps("cpu"), embed, head)
    rng = np.random.default_rng(0)
    D = tiny_cfg.hidden_size
    chunks = [{i: rng.standard_normal((n, D)).astype(np.float32) for i in tiny_cfg.drafter.target_layer_ids}
              for n in (6, 1, 3)]
    rc, nc = ref.new_cache(32), nat.new_cache(32)
    for chunk in chunks:
        ref.extend(rc, chunk)
        nat.extend(nc, chunk)
        assert nc.length == rc.length
        for bonus in (5, 200):
            np.testing.assert_allclose(nat.draft(nc, bonus), ref.draft(rc, bonus), **TOL)
    nc.truncate(4)
    assert nc.length == 4


def test_drafter_forward_per_op_knob_drafts_the_same(tiny_cfg, tiny_weights):
    """backend.drafter_forward=per_op (make_ops) keeps the drafter on the per-op path, the fallback for a device
    where the native drafter misbehaves: build_drafter picks DFlashDrafter over the ops, and the same drafts within
    the suite's tolerance."""
    from types import SimpleNamespace
    from kdtree.model.drafter import DFlashDrafter
    dw = init_weights(drafter_tensor_shapes(tiny_cfg), seed=1)
    drafters = {}
    for mode in ("native", "per_op"):
        ops = native.make_ops("cpu", SimpleNamespace(library="", threads=0, drafter_forward=mode))
        drafters[mode] = build_drafter(tiny_cfg, dw, build_target(tiny_cfg, tiny_weights, ops))
    assert isinstance(drafters["native"], NativeDrafter) and type(drafters["per_op"]) is DFlashDrafter
    rng = np.random.default_rng(3)
    chunk = {i: rng.standard_normal((5, tiny_cfg.hidden_size)).astype(np.float32)
             for i in tiny_cfg.drafter.target_layer_ids}
    caches = {k: d.new_cache(16) for k, d in drafters.items()}
    for k, d in drafters.items():
        d.extend(caches[k], chunk)
    np.testing.assert_allclose(drafters["per_op"].draft(caches["per_op"], 7),
                               drafters["native"].draft(caches["native"], 7), **TOL)
    with pytest.raises(native.ConfigError, match=r"backend.drafter_forward='fast'; use native .* or per_op"):
        native.make_ops("cpu", SimpleNamespace(library="", threads=0, drafter_forward="fast"))


def test_drafter_from_target_shares_the_targets_embed_and_lm_head(tiny_cfg, tiny_weights):
    """build_drafter over a native target hands the target's handle to kd_drafter_create (desc.target: the CUDA
    build then reads the target's device embed / lm_head instead of a second copy; the CPU build reads the same
    host arrays either way), keeps the target alive, and drafts as a drafter built without it."""
    import gc
    import weakref
    ops = native.NativeOps("cpu")
    model = build_target(tiny_cfg, tiny_weights, ops)
    dw = init_weights(drafter_tensor_shapes(tiny_cfg), seed=1)
    shared = build_drafter(tiny_cfg, dw, model)
    alone = NativeDrafter(tiny_cfg, dw, ops, model.embed_tokens.copy(), model.lm_head_w.copy())
    assert shared._target is model and shared._desc.target == model.handle
    assert alone._target is None
    rng = np.random.default_rng(4)
    chunk = {i: rng.standard_normal((4, tiny_cfg.hidden_size)).astype(np.float32)
             for i in tiny_cfg.drafter.target_layer_ids}
    cs, ca = shared.new_cache(16), alone.new_cache(16)
    shared.extend(cs, chunk), alone.extend(ca, chunk)
    target = weakref.ref(model)
    del model
    gc.collect()
    assert target() is not None   # the drafter keeps the target it reads alive
    np.testing.assert_array_equal(shared.draft(cs, 11), alone.draft(ca, 11))


def test_nccl_setup_falls_back_together_or_fails_when_asked_for(capfd):
    """attach_nccl in a real (one-rank, gloo) torch.distributed group, with the CUDA build where NCCL or a device
    is missing: the group agrees to keep the host all-reduce and says why once; with tp.collective=nccl (strict)
    it is an error naming the rank and the fix. The CPU build refuses both NCCL calls in one line."""
    import torch.distributed as dist
    from kdtree.backends.native_nccl import attach_nccl
    cpu = native.load_library("cpu")
    assert cpu.c.kd_model_set_nccl(cpu.ffi.NULL, cpu.ffi.NULL, cpu.ffi.NULL, 0, 0) == -1
    assert "NCCL is the CUDA build's" in cpu.last_error()
    if not native.library_path("cuda").exists():
        pytest.skip("libkdtree_cuda.so not built (no nvcc)")
    lib = native.load_library("cuda")
    if lib.device_count > 0:
        pytest.skip("a device is here: tests/native/test_cuda_forward.py covers NCCL")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert attach_nccl(lib, lib.ffi.NULL, 1, 0, strict=False) is False
        err = capfd.readouterr().err
        assert "NCCL on the forward's stream failed on rank 0" in err and "through the host" in err
        with pytest.raises(native.NativeError, match=r"tp.collective=nccl: rank 0 could not set up NCCL .* use "
                                                       r"tp.collective=host"):
            attach_nccl(lib, lib.ffi.NULL, 1, 0, strict=True)
    finally:
        dist.destroy_process_group()


def test_cuda_forward_without_a_device_fails_in_one_clear_line():
    """libkdtree_cuda.so has the whole-model forward (kd_forward.cu); with no device, creating a model fails with
    KD_ENODEV and one line naming the cause and the fix; the drafter's likewise."""
    path = native.library_path("cuda")
    if not path.exists():
        pytest.skip("libkdtree_cuda.so not built (no nvcc)")
    lib = native.load_library("cuda")
    d = lib.ffi.new("kd_model_desc *")
    h = lib.ffi.new("kd_model **")
    rc = lib.c.kd_model_create(d, h)
    if lib.device_count == 0:
        assert rc == -2 and h[0] == lib.ffi.NULL
        msg = lib.last_error()
        assert msg.startswith("kd_model_create: no CUDA device (") and msg.endswith("use backend=cpu")
        assert "\n" not in msg
    else:
        assert rc == -1 and "bad sizes" in lib.last_error()   # an empty descriptor
    dh = lib.ffi.new("kd_drafter **")
    rc = lib.c.kd_drafter_create(lib.ffi.new("kd_drafter_desc *"), dh)
    assert dh[0] == lib.ffi.NULL
    if lib.device_count == 0:
        msg = lib.last_error()
        assert rc == -2 and msg.startswith("kd_drafter_create: no CUDA device (") and msg.endswith("use backend=cpu")
        assert "\n" not in msg
    else:
        assert rc == -1 and "bad sizes" in lib.last_error()
    ops = native.NativeOps("cuda")
    assert ops.native_forward == ops.native_drafter_forward == (lib.device_count > 0)


def test_cpu_build_accepts_graph_buckets_and_reports_no_graphs(tiny_cfg, tiny_weights):
    """The graph calls exist in both builds: on the CPU the bucket set is ignored and every counter is zero."""
    _, m = _models(tiny_cfg, tiny_weights)
    m.set_graph_rows([1, 33])
    assert m.graph_rows([1, 33]) is False             # what the engine asks: nothing to capture here
    c = m.new_cache(16)
    m.forward(PROMPT[:3], np.arange(3), c)
    assert m.graph_stats() == {"graphs": 0, "replays": 0, "eager": 0, "buckets": 0, "capture_s": 0.0}


def test_cache_pages_are_freed_and_reused(tiny_cfg, tiny_weights):
    """A dropped cache gives its pages back to the pool: a server making one cache per request does not grow the
    arena."""
    import gc
    _, m = _models(tiny_cfg, tiny_weights)
    tables = set()
    for _ in range(5):
        c = m.new_cache(16)
        m.forward(PROMPT[:3], np.arange(3), c)
        tables.add(tuple(c.pages))
        del c
        gc.collect()
    assert tables == {(0,)} and m.pages.held == 0 and m.pages.total == 64     # the first growth, never another


def test_group_limited_routing_matches_numpy_reference(tiny_cfg, tiny_weights):
    """n_group > 1 (K2's V3 ancestors): experts only from the topk_group best groups (sum of each group's top 2)."""
    cfg = copy.deepcopy(tiny_cfg)
    cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok = 4, 2, 3
    ref, nat = _models(cfg, tiny_weights)
    (r_out, _), (n_out, _) = _steps(ref), _steps(nat)
    for step, ((rl, _), (nl, _)) in enumerate(zip(r_out, n_out)):
        np.testing.assert_allclose(nl, rl, **TOL, err_msg=f"logits of step {step}")


def check_paged_bits(plain, pooled) -> None:
    """pooled's pool reserved at 24 pages of 4 rows, three caches taken, the first and third dropped (a hole at pages
    2, 3); then _steps over the scattered table vs plain's contiguous 16-row pages: the same bits. CachePoolBusy for
    more pages than are free, and nothing taken by a refused cache."""
    from kdtree.errors import CachePoolBusy
    assert pooled.reserve_cache_pool(96, 4) and pooled.pages.total == 24 and pooled.pages.reserved
    a, b, c = pooled.new_cache(8), pooled.new_cache(8), pooled.new_cache(8)
    assert [list(x.pages) for x in (a, b, c)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(CachePoolBusy, match=r"18 free pages of 4 tokens, 20 asked \(24 pages"):
        pooled.new_cache(80)
    assert pooled.pages.free == 18                                 # a refused cache takes nothing
    a.release(), c.release()                                       # free: 0, 1, 4 .. 23 (a hole at 2, 3)
    (p_out, p_cache), (u_out, u_cache) = _steps(pooled), _steps(plain)
    assert list(p_cache.pages[:4]) == [0, 1, 4, 5] and list(u_cache.pages) == [0, 1, 2, 3]
    for (pl, ph), (ul, uh) in zip(p_out, u_out):
        assert np.array_equal(pl, ul) and all(np.array_equal(ph[k], uh[k]) for k in uh)
    n = u_cache.length
    assert p_cache.length == n and all(np.array_equal(p, u) for p, u in zip(p_cache.kv, u_cache.kv))
    b.release()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_paged_caches_share_one_arena_with_the_same_bits(tiny_cfg, tiny_weights, backend):
    """reserve_cache_pool: every cache is a page table into ONE arena of rows // page_rows pages; a full pool is
    CachePoolBusy naming the pages, not a crash; any free pages will do (no contiguous range needed); and a forward
    over scattered 4-row pages (prompt rows across pages 0 -> 1, the AR row, a tree block across the hole 1 -> 4,
    its compaction) gives the bits of one over contiguous 16-row pages (the numpy reference and the native build;
    backend=cuda: tests/native/test_cuda_forward.py)."""
    pick = 0 if backend == "numpy" else 1
    check_paged_bits(_models(tiny_cfg, tiny_weights)[pick], _models(tiny_cfg, tiny_weights)[pick])


_THREADS_SCRIPT = r"""
import sys
import numpy as np
from kdtree.backends import native
from kdtree.config.schema import group_config
from kdtree.model.names import init_weights, target_tensor_shapes
from kdtree.model.target import build_drafter, build_target
from kdtree.tree import ancestor_visibility
from tests.weights import int4_experts
cfg = group_config("model", "tiny")
w = init_weights(target_tensor_shapes(cfg), seed=0)
m = build_target(cfg, int4_experts(w) if sys.argv[2] == "int4" else w, native.NativeOps("cpu"))
rng = np.random.default_rng(5)
caches = [m.new_cache(128) for _ in range(12)]
for i, c in enumerate(caches):                                   # prompts of different lengths
    p = rng.integers(0, 256, 3 + 4 * i).astype(np.int32)
    m.forward(p, np.arange(len(p)), c)
seqs = [(rng.integers(0, 256, 1).astype(np.int32), np.array([c.length], np.int32), c, None) for c in caches[:10]]
parents = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 5], np.int32)      # two sequences verify trees of 10 rows
vis = ancestor_visibility(parents)
depth = np.array([0, 1, 1, 2, 2, 2, 3, 3, 3, 4])
for c in caches[10:]:
    seqs.append((rng.integers(0, 256, 10).astype(np.int32), (c.length + depth).astype(np.int32), c, vis))
logits, argmax, hid = m.forward_batch(seqs, hidden_layers=(0, 3))
kv = [c.kv[l][:c.length] for c in caches for l in range(cfg.num_hidden_layers)]
from kdtree.model.names import drafter_tensor_shapes            # the drafter's attention over a long context
dr = build_drafter(cfg, init_weights(drafter_tensor_shapes(cfg), seed=1), m)
dc = dr.new_cache(128)
dr.extend(dc, {i: rng.standard_normal((90, cfg.hidden_size)).astype(np.float32) for i in cfg.drafter.target_layer_ids})
draft = np.concatenate([dr.draft(dc, b) for b in (5, 200)])
np.savez(sys.argv[1], logits=logits, argmax=argmax, h0=hid[0], h3=hid[3], kv=np.concatenate(kv), draft=draft)
"""


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_forward_bits_do_not_depend_on_the_thread_count(tmp_path, quant):
    """A multi-row forward splits its linears' output tiles, the experts and the attention rows over the OpenMP
    threads (kd_par_worth); each output is still one thread's fixed-order computation, so 1 and 2 threads give the
    same logits, hidden states and latent-cache rows bit for bit (12 sequences: 10 AR steps and 2 tree verifies), and
    the same drafter block logits (its attention splits (query, head) pairs over a 90-row context)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = {}
    for n in (1, 2):
        env = dict(os.environ, OMP_NUM_THREADS=str(n), PYTHONPATH=str(root))
        f = tmp_path / f"threads{n}.npz"
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(f), quant], env=env, cwd=root, check=True,
                       timeout=120)
        out[n] = dict(np.load(f))
    for k in out[1]:
        np.testing.assert_array_equal(out[2][k], out[1][k], err_msg=f"{k} differs between 1 and 2 threads")
