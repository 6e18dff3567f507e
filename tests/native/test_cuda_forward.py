"""The CUDA whole-model forward (native/src/cuda/kd_forward.cu) on a device: parity with the numpy reference,
batch invariance of the whole forward, CUDA graph replay == eager launch, the drafter's forward (native and per
op), and the decode-step times gpu_check.sh prints. Every test is marked gpu and skipped here with "no CUDA device: ...".

Tolerances: the CUDA kernels sum in warp lane order (kd_cuda.cu), not numpy's BLAS order; through the tiny model's
layers that stays within the CPU build's 1e-4 (the same float32 formulas, a different summation order).

Run: .venv/bin/python -m pytest -q -m gpu tests/native/test_cuda_forward.py -rs
"""
from __future__ import annotations

import gc
import json
import os
import time

import numpy as np
import pytest

from kdtree.backends import native
from kdtree.tree import ancestor_visibility
from tests.native.test_native_forward import PROMPT, TOL, _steps, check_paged_bits
from tests.weights import int4_experts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(native.cuda_device_count() == 0, reason=f"no CUDA device: {native.CUDA_REASON}")]


def _cuda_model(cfg, weights):
    from kdtree.backends.native_forward import NativeTarget
    from kdtree.model.target import build_target
    m = build_target(cfg, weights, native.NativeOps("cuda"))
    assert isinstance(m, NativeTarget) and m.lib.kind == "cuda", "backend=cuda did not pick the CUDA forward"
    return m


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_cuda_target_forward_matches_numpy_reference(tiny_cfg, tiny_weights, quant):
    from kdtree.backends.numpy_ops import NumpyOps
    from kdtree.model.k2 import K2Model
    weights = int4_experts(tiny_weights) if quant == "int4" else tiny_weights
    ref, cu = K2Model(tiny_cfg, weights, NumpyOps()), _cuda_model(tiny_cfg, weights)
    (r_out, r_cache), (c_out, c_cache) = _steps(ref), _steps(cu)
    for step, ((rl, rh), (cl, ch)) in enumerate(zip(r_out, c_out)):
        np.testing.assert_allclose(cl, rl, **TOL, err_msg=f"logits of step {step}")
        assert np.array_equal(cl.argmax(-1), rl.argmax(-1)), f"argmax of step {step}"
        for layer in rh:
            np.testing.assert_allclose(ch[layer], rh[layer], **TOL, err_msg=f"hidden {layer} of step {step}")
    assert c_cache.length == r_cache.length
    for layer in range(tiny_cfg.num_hidden_layers):   # the device cache, copied back, after keep()
        np.testing.assert_allclose(c_cache.kv[layer][:c_cache.length], r_cache.kv[layer][:r_cache.length], **TOL)


def test_cuda_paged_caches_scattered_pages_same_bits(tiny_cfg, tiny_weights):
    """The device arena through page tables: a forward over scattered 4-row pages (rows across a hole in the table,
    a tree block compacted across pages by the keep kernel) gives the bits of one over contiguous 16-row pages."""
    check_paged_bits(_cuda_model(tiny_cfg, tiny_weights), _cuda_model(tiny_cfg, tiny_weights))


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_cuda_forward_rows_are_batch_invariant(tiny_cfg, tiny_weights, quant):
    """A row's logits are bit-identical alone, inside a 33-row block, and beside another sequence's tree."""
    m = _cuda_model(tiny_cfg, int4_experts(tiny_weights) if quant == "int4" else tiny_weights)
    block = np.random.default_rng(3).integers(0, 256, 33).astype(np.int32)
    pos = len(PROMPT) + np.arange(len(block))

    def prefilled(prompt=PROMPT):
        c = m.new_cache(128)
        m.forward(prompt, np.arange(len(prompt)), c)
        return c

    lg, _ = m.forward(block, pos, prefilled())
    c2 = prefilled()
    one = np.concatenate([m.forward(block[i:i + 1], pos[i:i + 1], c2)[0] for i in range(len(block))])
    np.testing.assert_array_equal(lg, one)
    other = np.array([256, 3, 4], np.int32)
    parents = np.array([-1, 0, 0, 2], np.int32)
    tree_vis, tree_pos = ancestor_visibility(parents), len(other) + np.array([0, 1, 2, 2, 3])
    logits, argmax, _ = m.forward_batch([(block[:9], pos[:9], prefilled(), None),
                                         (block[:5], tree_pos, prefilled(other), tree_vis)])
    np.testing.assert_array_equal(logits[:9], lg[:9])
    alone, _ = m.forward(block[:5], tree_pos, prefilled(other), visibility=tree_vis)
    np.testing.assert_array_equal(logits[9:], alone)
    np.testing.assert_array_equal(argmax, logits.argmax(-1))


def test_cuda_graph_replay_equals_eager(tiny_cfg, tiny_weights):
    """Row counts in the bucket set are captured once and replayed; the replay's bits are the eager launch's."""
    eager, graphed = _cuda_model(tiny_cfg, tiny_weights), _cuda_model(tiny_cfg, tiny_weights)
    assert graphed.graph_rows([1, 9])
    parents = np.array([-1, 0, 0, 1, 3, -1, 5, 6], np.int32)
    vis = ancestor_visibility(parents)
    outs = {}
    for name, m in (("eager", eager), ("graphed", graphed)):
        c = m.new_cache(64)
        got = [m.forward(PROMPT, np.arange(len(PROMPT)), c)[0]]            # 7 rows: eager in both
        for step in range(3):                                             # AR steps (1 row) and verifies (9 rows)
            got.append(m.forward(np.array([7 + step], np.int32), np.array([c.length]), c)[0])
            start = c.length
            got.append(m.forward(np.arange(9, dtype=np.int32) + step, start + np.concatenate([[0], [1, 2, 2, 3, 4, 1, 2, 3]]),
                                 c, visibility=vis)[0])
            c.truncate(start + 1)
        outs[name] = got
    for i, (a, b) in enumerate(zip(outs["eager"], outs["graphed"])):
        np.testing.assert_array_equal(b, a, err_msg=f"forward {i}")
    st = graphed.graph_stats()
    assert st["graphs"] == 2 and st["replays"] == 4 and st["eager"] == 1 and st["capture_s"] > 0, st
    assert eager.graph_stats()["graphs"] == 0


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_cuda_drafter_matches_numpy_reference(tiny_cfg, tiny_weights, quant):
    """The drafter's whole forward on the device (kd_drafter_extend / kd_drafter_draft of kd_forward.cu) vs numpy,
    over several context chunks and a truncation; and the per-op CUDA path (backend.drafter_forward=per_op) too."""
    from kdtree.backends.native_drafter import NativeDrafter
    from kdtree.backends.numpy_ops import NumpyOps
    from kdtree.model.drafter import DFlashDrafter
    from kdtree.model.names import drafter_tensor_shapes, init_weights
    weights = dict(tiny_weights)
    if quant == "int4":   # the shared lm_head packed: the drafter takes it packed
        from kdtree.quant import int4
        packed, scale, shape = int4.quantize_weight(tiny_weights["lm_head.weight"], 32)
        weights["lm_head.weight"] = int4.Int4Weight(packed, int4.bf16_to_f32(scale), shape, 32)
    dw = init_weights(drafter_tensor_shapes(tiny_cfg), seed=1)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    ref = DFlashDrafter(tiny_cfg, dw, NumpyOps(), embed, head)
    cu = NativeDrafter(tiny_cfg, dw, native.NativeOps("cuda"), embed, head)
    po = DFlashDrafter(tiny_cfg, dw, native.NativeOps("cuda"), embed, head)      # the per-op CUDA path
    rng = np.random.default_rng(0)
    chunks = [{i: rng.standard_normal((n, tiny_cfg.hidden_size)).astype(np.float32)
               for i in tiny_cfg.drafter.target_layer_ids} for n in (6, 1, 3)]
    rc, cc, pc = ref.new_cache(32), cu.new_cache(32), po.new_cache(32)
    for chunk in chunks:
        ref.extend(rc, chunk), cu.extend(cc, chunk), po.extend(pc, chunk)
        assert cc.length == rc.length
        for bonus in (5, 200):
            want = ref.draft(rc, bonus)
            np.testing.assert_allclose(cu.draft(cc, bonus), want, **TOL)
            np.testing.assert_allclose(po.draft(pc, bonus), want, **TOL)
    cc.truncate(4), rc.truncate(4)
    assert cc.length == 4
    np.testing.assert_allclose(cu.draft(cc, 9), ref.draft(rc, 9), **TOL)
    # a freed context's pages are taken by the next one; the device arena does not grow
    pages, total = list(cc.pages), cu.pages.total
    del cc
    gc.collect()
    c2, r2 = cu.new_cache(16), ref.new_cache(16)
    assert list(c2.pages) == pages[:1] and c2.length == 0 and cu.pages.total == total
    cu.extend(c2, chunks[0]), ref.extend(r2, chunks[0])
    np.testing.assert_allclose(cu.draft(c2, 5), ref.draft(r2, 5), **TOL)


def test_cuda_drafter_shares_the_targets_device_embed_and_lm_head(tiny_cfg, tiny_weights):
    """build_drafter on backend=cuda: the drafter reads the target's device embed / lm_head (desc.target) and
    drafts the same bits as a drafter with its own uploaded copies."""
    from kdtree.backends.native_drafter import NativeDrafter
    from kdtree.model.names import drafter_tensor_shapes, init_weights
    from kdtree.model.target import build_drafter
    model = _cuda_model(tiny_cfg, tiny_weights)
    dw = init_weights(drafter_tensor_shapes(tiny_cfg), seed=1)
    shared = build_drafter(tiny_cfg, dw, model)
    alone = NativeDrafter(tiny_cfg, dw, model.ops, model.embed_tokens.copy(), model.lm_head_w.copy())
    assert shared._target is model and alone._target is None
    rng = np.random.default_rng(4)
    chunk = {i: rng.standard_normal((5, tiny_cfg.hidden_size)).astype(np.float32)
             for i in tiny_cfg.drafter.target_layer_ids}
    cs, ca = shared.new_cache(16), alone.new_cache(16)
    shared.extend(cs, chunk), alone.extend(ca, chunk)
    for bonus in (3, 77):
        np.testing.assert_array_equal(shared.draft(cs, bonus), alone.draft(ca, bonus))


def test_cuda_nccl_on_the_stream_one_rank_equals_the_plain_forward(tiny_cfg, tiny_weights):
    """kd_model_set_nccl with one rank (all this device allows): every all-reduce becomes an ncclAllGather plus the
    rank-ordered sum on the forward's stream, and the forward's bits, eager and replayed from CUDA graphs that now
    contain the NCCL calls, are those of the model without it. (tp >= 2 needs a GPU per rank: the same code, with
    the rank-ordered sum equal to kdtree/parallel/comm.py's by construction.)"""
    from kdtree.backends.native_nccl import nccl_library_path
    plain, nccl = _cuda_model(tiny_cfg, tiny_weights), _cuda_model(tiny_cfg, tiny_weights)
    lib, ffi = nccl.lib, nccl.lib.ffi
    path = ffi.new("char[]", nccl_library_path().encode())
    uid = ffi.new("uint8_t[128]")
    if lib.c.kd_nccl_unique_id(path, uid) != 0:
        pytest.skip(f"NCCL does not load here: {lib.last_error()}")
    assert lib.c.kd_model_set_nccl(nccl.handle, path, uid, 1, 0) == 0, lib.last_error()
    nccl.set_graph_rows([1, 7])
    outs = {}
    for name, m in (("plain", plain), ("nccl", nccl)):
        c = m.new_cache(64)
        got = [m.forward(PROMPT, np.arange(len(PROMPT)), c)[0]]           # 7 rows: a graph bucket
        for step in range(4):                                           # 1 row: captured, then replayed
            got.append(m.forward(np.array([7 + step], np.int32), np.array([c.length]), c)[0])
        outs[name] = got
    for i, (a, b) in enumerate(zip(outs["plain"], outs["nccl"])):
        np.testing.assert_array_equal(b, a, err_msg=f"forward {i}")
    st = nccl.graph_stats()
    assert st["graphs"] == 2 and st["replays"] >= 3, st
    assert lib.c.kd_model_set_nccl(nccl.handle, path, ffi.NULL, 0, 0) == 0   # dropped again


def test_cuda_decode_step_times(tiny_cfg, tiny_weights):
    """AR step (1 row) and tree verify (33 rows) of the tiny model through CUDA graphs: times for gpu_check's table
    ($OUT/kd_gpu_steps.json); asserts only that replays happened, never a speed."""
    m = _cuda_model(tiny_cfg, tiny_weights)
    m.set_graph_rows([1, 33])
    vis = ancestor_visibility(np.concatenate([[-1], np.arange(31)]).astype(np.int32))
    times = {}
    for name, T in (("ar_step", 1), ("tree_verify_33", 33)):
        c = m.new_cache(256)   # prompt + one block; <= the tiny model's max_position_embeddings (2048)
        m.forward(PROMPT, np.arange(len(PROMPT)), c)
        toks = np.arange(T, dtype=np.int32)
        best = float("inf")
        for _ in range(50):
            start = c.length
            t0 = time.perf_counter()
            m.forward(toks, start + np.arange(T), c, visibility=vis if T > 1 else None)
            best = min(best, time.perf_counter() - t0)
            c.truncate(start)
        times[name] = best * 1e3
    st = m.graph_stats()
    assert st["graphs"] == 2 and st["replays"] >= 98, st
    times["graph_capture_s"] = st["capture_s"]
    from kdtree.model.names import drafter_tensor_shapes, init_weights   # one block draft after a 64-row context
    from kdtree.model.target import build_drafter
    dr = build_drafter(tiny_cfg, init_weights(drafter_tensor_shapes(tiny_cfg), seed=1), m)
    dc = dr.new_cache(128)
    dr.extend(dc, {i: np.ones((64, tiny_cfg.hidden_size), np.float32) for i in tiny_cfg.drafter.target_layer_ids})
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter()
        dr.draft(dc, 5)
        best = min(best, time.perf_counter() - t0)
    times["drafter_draft"] = best * 1e3
    out = os.environ.get("OUT") or "/tmp"
    with open(os.path.join(out, "kd_gpu_steps.json"), "w") as f:
        json.dump(times, f)
    print(f"\ntiny decode steps (min of 50, ms): {times}")


def _tree_and_batch_speed(engine, new_tokens=128, batch=16, rounds=3):
    """#16's and #18's figures on this backend (times only, the tokens checked): greedy AR vs DDTree tokens/s on the
    engine's model and tree, and one forward of `batch` sequences' 9-row trees against one sequence's."""
    from kdtree.engine import AR_TREE
    ids = engine.tokenizer.encode("def __init__(self, ")
    speed, tokens = {}, {}
    for name, tree in (("ar", AR_TREE), ("tree", None)):
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = engine.generate(ids, new_tokens, tree=tree)               # None: the configured tree
            best = min(best, time.perf_counter() - t0)
            tokens[name] = r.tokens
        speed[f"{name}_tokens_per_s"] = len(tokens[name]) / best
    assert tokens["tree"] == tokens["ar"]
    speed["tree_vs_ar"] = speed["tree_tokens_per_s"] / speed["ar_tokens_per_s"]
    m = engine.model
    parents = np.array([-1, 0, 0, 1, 3, -1, 5, 6], np.int32)           # 8 nodes + the root: 9 rows
    vis, toks = ancestor_visibility(parents), np.arange(9, dtype=np.int32)
    pos = len(PROMPT) + np.array([0, 1, 2, 2, 3, 4, 1, 2, 3])
    caches = [m.new_cache(64) for _ in range(batch)]
    for c in caches:
        m.forward(PROMPT, np.arange(len(PROMPT)), c)
    for name, seqs in (("verify_9_ms", caches[:1]), (f"verify_{batch}x9_ms", caches)):
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            m.forward_batch([(toks, pos, c, vis) for c in seqs])
            best = min(best, time.perf_counter() - t0)
            for c in seqs:
                c.truncate(len(PROMPT))
        speed[name] = best * 1e3
    speed["batch"] = batch
    speed["batch_rows_per_s_vs_one"] = batch * speed["verify_9_ms"] / speed[f"verify_{batch}x9_ms"]
    return speed


def test_cuda_tree_vs_ar_and_batched_verify_times(compose_cfg):
    """The figures #16 and #18 ask of a CPU, on the device, for gpu_check's table ($OUT/kd_gpu_speed.json): greedy
    AR vs DDTree w4 d7 b8 tokens/s on the trained tiny model (128 tokens, graphs for the AR step and the verify
    block), and one forward of 16 sequences' 9-row trees against one's. Asserts only DDTree == AR, never a speed."""
    from kdtree.engine import Engine
    engine = Engine.from_config(compose_cfg("backend=cuda", "tree=ddtree", "tree.width=4", "tree.depth=7",
                                            "tree.budget=8", "load.progress=false"))
    assert engine.graph_rows([1, 9, 144])
    speed = _tree_and_batch_speed(engine)
    out = os.environ.get("OUT") or "/tmp"
    with open(os.path.join(out, "kd_gpu_speed.json"), "w") as f:
        json.dump(speed, f)
    print(f"\ntiny model on the device: {speed}")


def test_warmup_buckets_are_captured_and_replayed(compose_cfg):
    """engine.graph_rows([1, budget + 1]) (what the warmup stage sets): the AR step and the verify block are
    captured once each, every later forward of those sizes replays, and a generation's tokens equal AR's."""
    from kdtree.engine import AR_TREE, Engine
    engine = Engine.from_config(compose_cfg("backend=cuda", "tree=ddtree", "tree.budget=8", "load.progress=false"))
    assert engine.graph_rows([1, 9])
    ids = engine.tokenizer.encode("def __init__(self, ")
    tree = engine.generate(ids, 32)
    ar = engine.generate(ids, 32, tree=AR_TREE)
    st = engine.graph_stats()
    assert tree.tokens == ar.tokens
    assert st["graphs"] >= 2 and st["replays"] >= 30 and st["capture_s"] > 0, st   # per output shape: >= 2
