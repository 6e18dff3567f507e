"""pipeline=plan: bytes per rank, latent KV bytes per token, shard files per rank, load time — from the config alone."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdtree.stages.plan import computed_layout, computed_tensors, make_plan, split_axis, _plain

REPO = Path(__file__).resolve().parents[2]


def test_k26_tp8_int4_prints_its_table_without_a_checkpoint(tmp_path, kdtree_cache):
    run_dir = tmp_path / "plan"
    env = dict(os.environ, KDTREE_CACHE=str(kdtree_cache), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "kdtree.run", "pipeline=plan", "model=k26", "tp=8",
                        "quant=int4_w4a16", f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert ("model=k26 quant=int4_w4a16 tp=8 backend=numpy load.strategy=mmap tree=ddtree   from computed layout "
            "(5 GB shards, non-quantized tensors bf16)") in out
    assert "KV cache per token         137.2 KiB   latent fp32, (512+64) x 61 layers x 4 B" in out
    assert sum(1 for line in out.splitlines() if line.strip().startswith(tuple(f"{r}  " for r in range(8)))) >= 8
    assert "2000 MB/s" in out and "240 MB/s" in out
    p = json.loads((run_dir / "plan.json").read_text())
    assert p["kv_cache"]["bytes_per_token"] == (512 + 64) * 61 * 4
    assert p["per_rank_bytes"] == pytest.approx(p["sharded_bytes"] / 8 + p["replicated_bytes"])
    assert 550e9 < p["total_bytes"] < 600e9  # K2.6 INT4: ~550-600 GB
    # replicated = embed + lm_head (bf16) + latent projections, norms, router gates: a few GB, far below a rank's share
    assert 2 * 163840 * 7168 * 2 < p["replicated_bytes"] < 10e9
    assert p["load_time_s"]["240"] == pytest.approx(p["node_read_bytes"] / 240e6)
    # rank 0 also reads the whole drafter (K2.6 DFlash: 6 layers, bf16), and the node's reads count it once
    r0, r1 = p["ranks"][0], p["ranks"][1]
    assert r0["read_total_bytes"] - r1["read_total_bytes"] == pytest.approx(r0["drafter"]["read_bytes"])
    assert 6e9 < r0["drafter"]["read_bytes"] < 8e9 and r1["drafter"] is None   # ~3.5 G parameters
    assert p["node_read_bytes"] == pytest.approx(8 * p["per_rank_bytes"] + r0["drafter"]["read_bytes"])
    # in memory (numpy/cpu) BF16 is float32: every rank holds more than it reads
    assert r1["resident_after_load_bytes"] > 1.5 * r1["read_total_bytes"]


@pytest.mark.parametrize("tensor,axis", [
    ("model.layers.3.self_attn.q_b_proj.weight", "rows"),
    ("model.layers.3.self_attn.kv_b_proj.weight", "rows"),
    ("model.layers.3.self_attn.o_proj.weight", "cols"),
    ("model.layers.3.self_attn.q_a_proj.weight", None),
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", None),
    ("model.layers.3.self_attn.kv_a_layernorm.weight", None),
    ("model.layers.0.mlp.gate_proj.weight", "rows"),
    ("model.layers.0.mlp.down_proj.weight", "cols"),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", "rows"),
    ("model.layers.3.mlp.experts.17.gate_proj.weight_packed", "rows"),
    ("model.layers.3.mlp.experts.17.down_proj.weight_scale", "cols"),
    ("model.layers.3.mlp.experts.17.down_proj.weight_shape", None),
    ("model.layers.3.mlp.gate.weight", None),
    ("model.layers.3.mlp.gate.e_score_correction_bias", None),
    ("model.embed_tokens.weight", None),
    ("lm_head.weight", None),
    ("model.norm.weight", None),
])
def test_sharding_rules(tensor, axis):
    got = split_axis(tensor)  # (axis, block) as kdtree.parallel.sharding splits the logical weight
    assert (None if got is None else ("rows", "cols")[got[0]]) == axis


def test_per_rank_bytes_follow_tp(compose_cfg):
    p1, p2 = make_plan(compose_cfg("tp='1'")), make_plan(compose_cfg("tp='2'"))
    assert p1["replicated_bytes"] == p2["replicated_bytes"] and p1["sharded_bytes"] == p2["sharded_bytes"]
    assert p2["per_rank_bytes"] == p1["sharded_bytes"] / 2 + p1["replicated_bytes"]
    assert len(p2["ranks"]) == 2


def test_reads_the_shard_files_from_the_checkpoint_index_when_present(compose_cfg):
    from kdtree.checkpoint.index import open_checkpoint
    from kdtree.checkpoint.tiny import ensure_tiny_checkpoint

    cfg = compose_cfg()
    ckpt = ensure_tiny_checkpoint(cfg.model, cfg.quant, cfg.cache_dir)
    p = make_plan(cfg)
    idx = open_checkpoint(ckpt)
    assert p["source"] == f"checkpoint index {ckpt}"
    assert p["ranks"][0]["files"] == sorted(f.path.name for f in idx.files) and len(idx.files) > 1
    assert p["total_bytes"] == idx.data_bytes
    # the computed layout (no checkpoint) predicts the very same bytes for the fp32 tiny model
    computed = dict(computed_tensors(_plain(cfg.model), _plain(cfg.quant), 4))
    assert sum(computed.values()) == idx.data_bytes
    assert set(computed) == set(idx.tensors)


def test_computed_layout_fills_shards_in_file_order():
    layout, n = computed_layout([("a", 4), ("b", 4), ("c", 3), ("d", 9)], shard_bytes=8)
    assert n == 3
    assert [f for _, f, _ in layout] == ["model-00001-of-00003.safetensors"] * 2 + [
        "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def test_plan_bytes_per_rank_equal_what_tp_ranks_read(compose_cfg):
    """The plan's numbers are the TP loader's: no second copy of the split rules to drift."""
    from kdtree.parallel.sharding import bytes_per_rank

    for q, tp, fb in (("int4_w4a16", 8, 2), ("fp32", 4, 4)):
        cfg = compose_cfg("model=k26" if q == "int4_w4a16" else "model=tiny", f"quant={q}", f"tp='{tp}'",
                          "cache_dir=/nonexistent")
        assert make_plan(cfg)["per_rank_bytes"] == bytes_per_rank(cfg.model, cfg.quant, tp, float_bytes=fb)


K26_CUDA = ("model=k26", "tp='8'", "quant=int4_w4a16", "backend=cuda", "cache_dir=/nonexistent")
RTX = "RTX PRO 6000 (96 GB)"


def test_k26_tp8_int4_cuda_prints_device_bytes_per_rank_and_fits_the_96gb_card(tmp_path, kdtree_cache):
    run_dir = tmp_path / "plan"
    env = dict(os.environ, KDTREE_CACHE=str(kdtree_cache), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "kdtree.run", "pipeline=plan", "model=k26", "tp=8",
                        "quant=int4_w4a16", "backend=cuda", f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "device bytes per rank (backend=cuda)" in out and "serve.kv_pool_tokens=16384" in out
    assert "int4 packed (int32)" in out and "int4 scales (bf16)" in out and "fp32" not in out.split("device bytes")[1]
    assert "fits RTX PRO 6000 (96 GB)" in out and "fits H200 (141 GB)" in out and "does NOT fit" not in out
    d = json.loads((run_dir / "plan.json").read_text())["device"]
    assert d["fits"] == {RTX: True, "H200 (141 GB)": True}
    assert len(d["ranks"]) == 8 and d["ranks"][0]["kv_cache_tokens"] == 16384


def test_device_weights_by_dtype_are_the_ranks_slices_int4_packed_and_bf16_kept(compose_cfg):
    """Weights on the device are the bytes the rank reads (minus weight_shape metadata): no float32 copy of BF16,
    INT4 experts as int32 words (1/8 of their float32 bytes) + bf16 group scales (1/16 byte per weight)."""
    from kdtree.model.names import target_tensor_shapes

    cfg = compose_cfg(*K26_CUDA)
    p = make_plan(cfg)
    r0, r1 = p["device"]["ranks"][0], p["device"]["ranks"][1]
    for r in (r0, r1):
        assert sum(r["weights_by_dtype"].values()) == pytest.approx(r["weights_bytes"])
        assert r["total_bytes"] == pytest.approx(r["weights_bytes"] + r["kv_cache_bytes"] + r["scratch_bytes"]
                                                 + r["graphs_bytes"] + r["reserve_bytes"])
    assert set(r1["weights_by_dtype"]) == {"bf16", "int4 packed (int32)", "int4 scales (bf16)"}
    shapes = target_tensor_shapes(_plain(cfg.model))
    n_shapes = sum(1 for n in shapes if ".mlp.experts." in n)   # one weight_shape int32 [2] per INT4 module
    assert r1["weights_bytes"] == pytest.approx(p["per_rank_bytes"] - n_shapes * 8)
    # rank 0 also holds the drafter (bf16, as read), and its KV cache
    assert r0["weights_bytes"] - r1["weights_bytes"] == pytest.approx(p["ranks"][0]["drafter"]["read_bytes"])
    assert r0["kv_cache_bytes"] > r1["kv_cache_bytes"] == 16384 * (512 + 64) * 61 * 4
    fp32_experts = sum(math.prod(s) * 4 for n, s in shapes.items()
                       if ".mlp.experts." in n) / 8                      # per rank: experts split over tp=8
    assert r1["weights_by_dtype"]["int4 packed (int32)"] == pytest.approx(fp32_experts / 8)
    assert r1["weights_by_dtype"]["int4 scales (bf16)"] == pytest.approx(fp32_experts / 4 / 32 * 2)


def test_device_fit_flips_when_the_cache_outgrows_the_card_and_says_the_fix(compose_cfg):
    most = make_plan(compose_cfg(*K26_CUDA))["device"]["ranks"][0]["max_kv_cache_tokens"][RTX]
    assert 16384 < most
    at = make_plan(compose_cfg(*K26_CUDA, f"serve.kv_pool_tokens={most}"))["device"]
    over = make_plan(compose_cfg(*K26_CUDA, f"serve.kv_pool_tokens={most + 1}"))["device"]
    assert at["fits"][RTX] and not over["fits"][RTX] and over["fits"]["H200 (141 GB)"]
    msg = over["does_not_fit"][RTX]
    assert f"serve.kv_pool_tokens={most + 1}" in msg and f"lower serve.kv_pool_tokens to <= {most}" in msg
    assert "raise tp (tp=8)" in msg
    # fewer ranks: the weights alone outgrow the card, and the message says so instead of a cache size
    tp4 = make_plan(compose_cfg(*[o if o != "tp='8'" else "tp='4'" for o in K26_CUDA]))["device"]
    assert not tp4["fits"][RTX] and "the weights alone do not fit" in tp4["does_not_fit"][RTX]


def test_device_plan_only_for_backend_cuda_and_keeps_fp32_tiny_fp32(compose_cfg):
    assert make_plan(compose_cfg())["device"] is None
    d = make_plan(compose_cfg("backend=cuda"))["device"]   # the embedded tiny checkpoint: float32 as stored
    assert set(d["ranks"][0]["weights_by_dtype"]) <= {"fp32", "drafter fp32"} and all(d["fits"].values())


def test_prefix_cache_pages_and_bytes_per_token_at_k26_dims(compose_cfg):
    """The paged pool at K2.6 dims: latent (512+64) x 4 B = 2304 B per token per layer, x 61 layers, on every rank;
    plus, on rank 0, the drafter's context K/V of the same positions (2 x 8 heads x 128 x 6 layers x 4 B = 48 KiB:
    a speculative hit maps them with the target's; the target's hidden rows of its 6 layers would be 168 KiB); pages
    of serve.prefix_cache_page tokens, serve.kv_pool_tokens / page per rank, the prefix cache's budget inside them;
    with backend=cuda the pool tokens that fit each rank after the weights."""
    from kdtree.stages.plan import format_plan
    p = make_plan(compose_cfg(*K26_CUDA, "serve.prefix_cache_tokens=4096", "serve.kv_pool_tokens=16384"))
    c = p["prefix_cache"]
    assert c["latent_bytes_per_token_per_layer"] == 2304 and c["latent_bytes_per_token"] == 2304 * 61
    assert c["drafter_hidden_bytes_per_token"] == 6 * 7168 * 4 and c["drafter_kv_bytes_per_token"] == 2 * 8 * 128 * 6 * 4
    assert c["bytes_per_token"] == 2304 * 61 + 2 * 8 * 128 * 6 * 4
    assert c["pages_per_rank"] == 1024 and c["budget_pages"] == 256 and c["page_bytes"] == 16 * c["bytes_per_token"]
    d = p["device"]
    for dev, cap in d["devices"].items():
        want = min(r["max_kv_cache_tokens"][dev] for r in d["ranks"])
        assert c["device_fit"][dev] == {"tokens": want // 16 * 16, "pages": want // 16} and want > 10000
    assert d["ranks"][0]["kv_bytes_per_token"] == c["bytes_per_token"]          # the pool rank 0 holds: the same
    assert d["ranks"][1]["kv_bytes_per_token"] == c["latent_bytes_per_token"]
    out = format_plan(p)
    assert ("paged pool           1024 pages of 16 tokens per rank (serve.kv_pool_tokens=16384); per token: latent "
            "137.2 KiB (2304 B per layer x 61) on every rank + drafter context KV 48.0 KiB (2 x 8 heads x 128 x 6 "
            "layers x 4 B; the target's hidden rows would be 168.0 KiB) on rank 0 = 185.2 KiB") in out
    assert "prefix cache         up to 4096 tokens (256 pages) of the pool" in out
    ar = make_plan(compose_cfg("model=k26", "tree=ar", "serve.prefix_cache=false"))["prefix_cache"]
    assert ar["drafter_hidden_bytes_per_token"] == 0 and not ar["enabled"] and "device_fit" not in ar


@pytest.mark.parametrize("quant", ["bf16", "fp32"])
def test_model_copies_are_what_the_native_target_builds(compose_cfg, quant):
    """backend=cpu keeps a BF16 kv_b_proj as stored, so its absorbed halves W_uk^T / W_uv are BF16 copies, and a BF16
    router gate is read where it is mapped: the plan's model_copies_bytes is what NativeTarget really builds beside
    the loaded tensors (W_uk/W_uv, and float32 router gates)."""
    from kdtree.engine import Engine
    from tests.native_lib import CPU_ERROR, CPU_SKIPPED
    if CPU_SKIPPED:
        pytest.skip(f"libkdtree_cpu.so not usable ({CPU_ERROR})")
    cfg = compose_cfg(f"quant={quant}", "backend=cpu", "tree=ar")
    engine = Engine.from_config(cfg)
    try:
        held = engine.model.weight_bytes()
    finally:
        engine.close()
    def held_as(suffixes):
        return (sum(b for name, (b, _) in held.items() if name.endswith(suffixes)),
                sum(n for name, (_, n) in held.items() if name.endswith(suffixes)))

    (absorbed, n_abs), (gates, n_gates) = held_as((".w_uk", ".w_uv")), held_as(".mlp.gate")
    width = 2 if quant == "bf16" else 4
    assert absorbed == n_abs * width and gates == n_gates * width > 0
    assert make_plan(cfg)["ranks"][0]["model_copies_bytes"] == absorbed + (0 if quant == "bf16" else gates)
