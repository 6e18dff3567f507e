"""Training loops and the train_tiny stage at toy sizes: losses fall, the written checkpoint loads with
the engine's loader, and DDTree over the trained pair reproduces AR.

Run: .venv/bin/python -m pytest -q tests/train/test_train_tiny.py
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from kdtree.model.names import drafter_tensor_shapes, target_tensor_shapes
from kdtree.train import loop
from kdtree.train.data import Corpus

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)  # shared CI cores: small ops gain nothing from more threads


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return tiny_cfg


@pytest.fixture(scope="module")
def corpus():
    return Corpus()


def test_corpus_split_and_provenance(corpus):
    prov = corpus.provenance()
    assert prov["n_files"] > 50 and 0 < prov["heldout_tokens"] < prov["train_tokens"]
    held = {r["file"] for r in prov["files"] if r["heldout"]}
    assert held and len(corpus.heldout_docs) == len(held)
    p = corpus.prompts(np.random.default_rng(0), 4, 32, "heldout")
    assert p.shape == (4, 32) and p.max() < 256


def test_target_and_drafter_losses_fall(cfg, corpus):
    t = loop.train_target(cfg, corpus, steps=8, batch=4, seq_len=64, lr=3e-3, warmup=2, log=lambda m: None,
                          eval_every=100)
    h = t["history"]
    assert h[-1]["heldout_loss"] < h[0]["heldout_loss"] - 1.0          # 5.5 nats (uniform) -> well below
    sets = loop.greedy_set(t["model"], corpus, 8, [16], 24, seed=0, log=lambda m: None)
    assert sets[0]["tokens"].shape == (8, 40)
    # greedy continuation == argmax of the teacher-forced forward (KV cache consistent)
    with torch.no_grad():
        logits, _, _ = t["model"](sets[0]["tokens"])
    assert torch.equal(logits[:, 15:-1].argmax(-1), sets[0]["tokens"][:, 16:])
    d = loop.train_drafter(cfg, t["model"], sets, steps=12, batch=4, anchors_per_seq=8, lr=3e-3, warmup=2,
                           log=lambda m: None, eval_every=100)
    assert d["history"][-1]["loss"] < d["history"][0]["loss"]


def test_stage_writes_loadable_checkpoint(cfg, tmp_path):
    from kdtree.checkpoint.loader import load_checkpoint, load_drafter
    from kdtree.stages import train_tiny

    ctx = SimpleNamespace(cfg=OmegaConf.create({"model": OmegaConf.to_container(cfg)}), run_dir=tmp_path,
                          emit=lambda kind, **f: None)
    out = train_tiny.run(ctx, train_tiny.TrainTinyConfig(target_steps=2, drafter_steps=2, batch=2, seq_len=32,
                                                         n_prompts=8, n_new=10, eval_prompts=1, eval_new=6, threads=1))
    ck = Path(out["out"])
    assert (ck / "config.json").exists() and (ck / "drafter" / "model.safetensors").exists()
    tw, _ = load_checkpoint(ck, cfg, None)
    dw, _ = load_drafter(ck, cfg, None)
    assert set(tw) == set(target_tensor_shapes(cfg)) and set(dw) == set(drafter_tensor_shapes(cfg))
    assert out["equal_to_ar"] is True
    assert json.loads((ck / "training.json").read_text())["target"]["corpus"]["corpus_sha256"]
    assert "| ddtree |" in (ck / "TRAINING.md").read_text()
