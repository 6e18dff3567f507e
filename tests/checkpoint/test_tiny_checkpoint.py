"""The embedded tiny checkpoint: generated on first use, byte-identical every time, reused, race-safe."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from kdtree.checkpoint.loader import load_checkpoint, load_drafter
from kdtree.model.names import drafter_tensor_shapes, init_weights, target_tensor_shapes
from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
from kdtree.quant.int4 import Int4Weight
from tests.checkpoint.configs import ROOT, model_cfg, quant_cfg


def tree_bytes(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_generates_loadable_target_and_drafter(tmp_path, cfg, fp32):
    d = ensure_tiny_checkpoint(cfg, fp32, str(tmp_path))
    assert d.parent == tmp_path / "checkpoints" and d.name.startswith("tiny-fp32-")
    conf = json.loads((d / "config.json").read_text())
    assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["hidden_size"] == 128
    assert not {"name", "path", "tokenizer", "seed", "drafter"} & set(conf)
    w, _ = load_checkpoint(d, cfg, fp32)
    ref = init_weights(target_tensor_shapes(cfg), cfg.seed)
    assert all(np.array_equal(w[k], ref[k]) for k in ref)
    dw, dstats = load_drafter(d, cfg)
    assert set(dw) == set(drafter_tensor_shapes(cfg)) and dstats.bytes_read > 0
    assert (d / "drafter" / "model.safetensors").exists()
    assert json.loads((d / "drafter" / "config.json").read_text())["target_layer_ids"] == [1, 3]


def test_two_generations_are_byte_identical(tmp_path, cfg, fp32):
    a = ensure_tiny_checkpoint(cfg, fp32, str(tmp_path / "a"))
    b = ensure_tiny_checkpoint(cfg, fp32, str(tmp_path / "b"))
    assert a.name == b.name and tree_bytes(a) == tree_bytes(b)


def test_reused_not_regenerated(tmp_path, cfg, fp32):
    d = ensure_tiny_checkpoint(cfg, fp32, str(tmp_path))
    stamp = {p: p.stat().st_mtime_ns for p in d.rglob("*")}
    assert ensure_tiny_checkpoint(cfg, fp32, str(tmp_path)) == d
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == stamp
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [d.name]  # no temp dirs left behind


def test_other_config_gets_its_own_directory(tmp_path, cfg, fp32):
    other = cfg.copy()
    other.seed = 1
    a, b = ensure_tiny_checkpoint(cfg, fp32, str(tmp_path)), ensure_tiny_checkpoint(other, fp32, str(tmp_path))
    assert a != b and tree_bytes(a)["config.json"] == tree_bytes(b)["config.json"]
    assert tree_bytes(a) != tree_bytes(b)


def test_cache_dir_from_environment(tmp_path, cfg, fp32, monkeypatch):
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "env"))
    assert ensure_tiny_checkpoint(cfg, fp32, "").parent == tmp_path / "env" / "checkpoints"


def test_racing_processes_both_get_the_complete_checkpoint(tmp_path):
    code = ("import sys; from tests.checkpoint.configs import model_cfg, quant_cfg;"
            "from kdtree.checkpoint.tiny import ensure_tiny_checkpoint;"
            "print(ensure_tiny_checkpoint(model_cfg(), quant_cfg(), sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1
    d = Path(paths.pop())
    assert tree_bytes(d) == tree_bytes(ensure_tiny_checkpoint(model_cfg(), quant_cfg(), str(tmp_path / "ref")))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [d.name]


def test_int4_tiny_checkpoint_loads_packed_experts(tmp_path, cfg):
    q = quant_cfg("int4_w4a16")
    d = ensure_tiny_checkpoint(cfg, q, str(tmp_path))
    assert d.name.startswith("tiny-int4_w4a16-")
    assert tree_bytes(d) == tree_bytes(ensure_tiny_checkpoint(cfg, q, str(tmp_path / "again")))
    w, stats = load_checkpoint(d, cfg, q)
    ref = init_weights(target_tensor_shapes(cfg), cfg.seed)
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert isinstance(w[expert], Int4Weight) and w[expert].shape == (128, 256)
    err = np.abs(w[expert].dequantize() - ref[expert]).max()
    assert err <= np.abs(ref[expert]).max() / 7  # half a step of the coarsest group, with margin
    assert isinstance(w["model.layers.1.mlp.shared_experts.up_proj.weight"], np.ndarray)  # ignored by quant
    assert stats.bytes_read < sum(a.nbytes for a in ref.values()) / 2
    dw, _ = load_drafter(d, cfg, q)
    assert all(isinstance(v, np.ndarray) for v in dw.values())


def test_default_tiny_is_the_shipped_trained_checkpoint(tmp_path, fp32):
    from kdtree.checkpoint.tiny import ASSETS

    trained = model_cfg("tiny", init="trained")
    assert ensure_tiny_checkpoint(trained, fp32, str(tmp_path)) == ASSETS
    assert not (tmp_path / "checkpoints").exists()          # nothing generated
    w, _ = load_checkpoint(ASSETS, trained, fp32)
    ref = init_weights(target_tensor_shapes(trained), trained.seed)
    assert not np.array_equal(w["lm_head.weight"], ref["lm_head.weight"])   # trained, not the seeded init


def test_trained_int4_is_quantized_from_the_shipped_checkpoint_once(tmp_path):
    trained = model_cfg("tiny", init="trained")
    d = ensure_tiny_checkpoint(trained, quant_cfg("int4_w4a16"), str(tmp_path))
    assert "-trained-" in d.name and d.parent == tmp_path / "checkpoints"
    w, _ = load_checkpoint(d, trained, quant_cfg("int4_w4a16"))
    assert isinstance(w["model.layers.1.mlp.experts.0.down_proj.weight"], Int4Weight)
    assert ensure_tiny_checkpoint(trained, quant_cfg("int4_w4a16"), str(tmp_path)) == d


def test_another_architecture_gets_seeded_weights_not_the_shipped_ones(tmp_path, fp32):
    other = model_cfg("tiny", init="trained")
    other.num_hidden_layers = 3
    other.drafter.target_layer_ids = [1, 2]
    d = ensure_tiny_checkpoint(other, fp32, str(tmp_path))
    assert d.parent == tmp_path / "checkpoints" and json.loads((d / "config.json").read_text())["num_hidden_layers"] == 3


def test_block16_drafter_is_shipped_beside_the_default_and_joins_the_shipped_target(tmp_path, fp32):
    """model.drafter.block_size=16: the shipped target with kdtree/assets/tiny/drafter_b16, assembled once into the
    cache (the default block 8 stays kdtree/assets/tiny itself); a block size with no shipped drafter is no longer
    the trained model."""
    from safetensors.numpy import load_file

    from kdtree.checkpoint.tiny import ASSETS, trained_drafter

    cfg = model_cfg("tiny", init="trained")
    cfg.drafter.block_size = 16
    assert trained_drafter(cfg) == ASSETS / "drafter_b16"
    d = ensure_tiny_checkpoint(cfg, fp32, str(tmp_path))
    assert d.parent == tmp_path / "checkpoints" and "-trained-" in d.name
    w, _ = load_checkpoint(d, cfg, fp32)
    ref, _ = load_checkpoint(ASSETS, model_cfg("tiny", init="trained"), fp32)
    assert set(w) == set(ref) and all(np.array_equal(w[k], ref[k]) for k in ref)
    dw, _ = load_drafter(d, cfg, fp32)
    shipped = load_file(str(ASSETS / "drafter_b16" / "model.safetensors"))
    assert set(dw) == set(shipped) and all(np.array_equal(dw[k], shipped[k]) for k in shipped)
    assert json.loads((d / "drafter" / "config.json").read_text())["dflash_config"]["block_size"] == 16
    assert ensure_tiny_checkpoint(cfg, fp32, str(tmp_path)) == d           # reused
    cfg.drafter.block_size = 12
    assert trained_drafter(cfg) is None
