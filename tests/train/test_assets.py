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
