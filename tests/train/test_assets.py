"""The committed trained tiny checkpoint (kdtree/assets/tiny): loads with the engine's loader, and its
drafter makes DDTree commit several tokens per target forward while reproducing greedy AR exactly.

Run: .venv/bin/python -m pytest -q tests/train/test_assets.py
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)  # shared CI cores: small ops gain nothing from more threads
ASSETS = ROOT / "kdtree/assets/tiny"

pytestmark = pytest.mark.skipif(not (ASSETS / "config.json").exists(), reason="no trained tiny assets")


def test_trained_pair_accepts_and_equals_ar(tiny_cfg):
    from tests.decode.loops import generate_ar
    from tests.decode.loops import generate_ddtree
    from kdtree.train.evaluate import load_engine

    cfg = tiny_cfg
    model, drafter = load_engine(ASSETS, cfg)
    prompt = list(b"    def __init__(self, name, value=None):\n        self.name = name\n")
    ar = generate_ar(model, prompt, 40)
    dd = generate_ddtree(model, drafter, SimpleNamespace(kind="ddtree", width=4, depth=7, budget=32), prompt, 40)
    assert dd.tokens == ar.tokens
    assert dd.mean_acceptance_length >= 3.0, dd.acceptance_lengths
    info = json.loads((ASSETS / "training.json").read_text())
    assert info["target"]["corpus"]["corpus_sha256"] and info["target"]["history"]


def test_block16_drafter_drafts_deeper_and_equals_ar(tiny_cfg, kdtree_cache):
    """kdtree/assets/tiny/drafter_b16 (model.drafter.block_size=16) commits more tokens per target forward than the
    default block-8 drafter on held-out prompts, at its full depth 15, and still reproduces greedy AR exactly."""
    from omegaconf import OmegaConf

    from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
    from kdtree.train.evaluate import evaluate, heldout_prompts, load_engine

    cfg16 = OmegaConf.merge(tiny_cfg, {"drafter": {"block_size": 16}})
    prompts = heldout_prompts(12, 64)   # measured: 8.35 vs 6.03 tokens per verify (1.38x)
    quiet = lambda *_: None  # noqa: E731
    ev8 = evaluate(*load_engine(ASSETS, tiny_cfg), prompts, 96, shapes=[("chain", 1, 7, 7)], log=quiet)
    ev16 = evaluate(*load_engine(ensure_tiny_checkpoint(cfg16, None, str(kdtree_cache)), cfg16), prompts, 96,
                    shapes=[("chain", 1, 15, 15)], log=quiet)
    r8, r16 = ev8["shapes"][0], ev16["shapes"][0]
    assert r8["equal_to_ar"] and r16["equal_to_ar"]
    assert r16["tokens_per_verify"] >= 1.2 * r8["tokens_per_verify"], (r16, r8)
    info = json.loads((ASSETS / "drafter_b16" / "training.json").read_text())
    assert info["drafter"]["block_size"] == 16 and info["drafter"]["history"]


def test_export_drafter_rewrites_the_shipped_block16_drafter_from_its_training_record(tmp_path):
    """`python -m kdtree.train.run export-drafter --drafter-block 16` on a work dir holding drafter_b16's weights and
    training record (drafter.json, eval.json, COMMANDS) writes kdtree/assets/tiny/drafter_b16 byte for byte: the
    shipped files are what the documented commands produce."""
    from safetensors.numpy import load_file, save_file

    from kdtree.train.run import main

    shipped = ASSETS / "drafter_b16"
    info = json.loads((shipped / "training.json").read_text())
    work = tmp_path / "work"
    work.mkdir()
    save_file(load_file(str(shipped / "model.safetensors")), str(work / "drafter.safetensors"))
    (work / "drafter.json").write_text(json.dumps({k: v for k, v in info["drafter"].items() if k != "block_size"}))
    (work / "eval.json").write_text(json.dumps(info["eval"]))
    md = (shipped / "TRAINING.md").read_text()
    (work / "COMMANDS").write_text(md.split("## Commands\n\n```\n")[1].split("```")[0])
    assert main(["export-drafter", "--work", str(work), "--drafter-block", "16", "--out", str(tmp_path)]) == 0
    out = tmp_path / "drafter_b16"
    for f in ("config.json", "model.safetensors", "training.json", "TRAINING.md"):
        assert (out / f).read_bytes() == (shipped / f).read_bytes(), f
