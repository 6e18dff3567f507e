"""The quantize stage and pipelines/quantize.yaml, run on a composed config; the result loads in kdtree."""
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from kdtree.checkpoint.loader import load_checkpoint
from kdtree.pipeline.registry import register_schema as register
from kdtree.errors import ConfigError
from kdtree.pipeline.context import StageContext
from kdtree.pipeline.spec import load_pipeline
from kdtree.quant.int4 import Int4Weight
from kdtree.stages import quantize

CONF = Path(__file__).resolve().parents[2] / "conf"
register()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=["pipeline=quantize", *overrides])


TWO_LAYERS = ["model.num_hidden_layers=2", "model.drafter.target_layer_ids=[0,1]"]   # = conftest's tiny_cfg


def test_pipeline_resolves_src_from_model_path(fp32_checkpoint):
    cfg = _compose("quant=int4_w4a16", f"model.path={fp32_checkpoint}", *TWO_LAYERS)
    spec = load_pipeline("quantize", cfg)
    assert [(s.stage, s.on, s.params) for s in spec.stages] == [
        ("quantize", "controller", {"dst": ""})]


def test_stage_writes_run_dir_int4_that_the_loader_reads(fp32_checkpoint, tmp_path):
    cfg = _compose("quant=int4_w4a16", f"model.path={fp32_checkpoint}", *TWO_LAYERS)
    events = []
    ctx = StageContext(cfg=cfg, run_dir=tmp_path, emit=lambda kind, **f: events.append((kind, f)))
    out = quantize.run(ctx, quantize.QuantizeConfig(**load_pipeline("quantize", cfg).stages[0].params))
    dst = tmp_path / "int4"
    assert out["dst"] == str(dst) and (dst / "config.json").exists() and (dst / "drafter").is_dir()
    assert events[0][0] == "quantized" and 0.1 < events[0][1]["ratio"] < 1.0
    weights, _ = load_checkpoint(dst, cfg.model, cfg.quant)
    expert = weights["model.layers.1.mlp.experts.2.gate_proj.weight"]
    assert isinstance(expert, Int4Weight) and expert.shape == (256, 128)
    assert isinstance(weights["model.layers.1.self_attn.q_b_proj.weight"], np.ndarray)   # ignored: FP32


def test_stage_needs_int4_quant(fp32_checkpoint, tmp_path):
    cfg = _compose(f"model.path={fp32_checkpoint}")
    with pytest.raises(ConfigError, match="pipeline=quantize with quant=fp32 has nothing to do; add quant=int4_w4a16"):
        quantize.run(StageContext(cfg=cfg, run_dir=tmp_path), quantize.QuantizeConfig())


def test_tiny_model_without_path_quantizes_the_embedded_checkpoint(tmp_path):
    cfg = _compose("quant=int4_w4a16", f"cache_dir={tmp_path / 'cache'}")
    out = quantize.run(StageContext(cfg=cfg, run_dir=tmp_path / "run"), quantize.QuantizeConfig(dst=str(tmp_path / "out")))
    from kdtree.checkpoint.tiny import ASSETS

    assert Path(out["src"]) == ASSETS                                       # the shipped trained fp32 checkpoint
    assert out["quantized_modules"] == 3 * 8 * 3                           # 3 MoE layers x 8 experts x 3 projections
