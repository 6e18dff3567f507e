"""The torch training re-statements equal the numpy engine on the same weights.

Run: .venv/bin/python -m pytest -q tests/train/test_torch_models.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kdtree.backends.numpy_ops import NumpyOps
from kdtree.model.names import drafter_tensor_shapes, init_weights, target_tensor_shapes
from kdtree.model.drafter import DFlashDrafter
from kdtree.model.k2 import K2Model
from kdtree.train.drafter_torch import DrafterTorch
from kdtree.train.k2_torch import K2Torch

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)  # shared CI cores: small ops gain nothing from more threads


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return tiny_cfg


def _nonunit(w, seed):
    rng = np.random.default_rng(seed)
    for k in w:  # non-unit norms, so a norm applied to the wrong tensor shows up
        if k.endswith("norm.weight"):
            w[k] = (1.0 + 0.3 * rng.standard_normal(w[k].shape)).astype(np.float32)
    return w


@pytest.fixture(scope="module")
def target_w(cfg):
    return _nonunit(init_weights(target_tensor_shapes(cfg), seed=0), 7)


def test_k2_torch_matches_numpy(cfg, target_w):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, 12)
    np_model = K2Model(cfg, target_w, NumpyOps())
    cache = np_model.new_cache(16)
    logits_np, hid_np = np_model.forward(tokens, np.arange(12), cache, hidden_layers=(1, 3))
    tm = K2Torch(cfg, target_w)
    with torch.no_grad():
        logits_t, hid_t, _ = tm(torch.tensor(tokens)[None], hidden_layers=(1, 3))
    np.testing.assert_allclose(logits_t[0].numpy(), logits_np, atol=1e-4, rtol=0)
    for i in (1, 3):
        np.testing.assert_allclose(hid_t[i][0].numpy(), hid_np[i], atol=1e-4, rtol=0)
    # KV-cached continuation == one full forward
    with torch.no_grad():
        _, _, past = tm(torch.tensor(tokens[:7])[None])
        logits_c, _, _ = tm(torch.tensor(tokens[7:])[None], past=past)
    np.testing.assert_allclose(logits_c[0].numpy(), logits_np[7:], atol=1e-4, rtol=0)
    assert set(tm.export()) == set(target_tensor_shapes(cfg))


def test_drafter_torch_matches_numpy(cfg, target_w):
    dw = _nonunit(init_weights(drafter_tensor_shapes(cfg), seed=1), 3)
    embed, head = target_w["model.embed_tokens.weight"], target_w["lm_head.weight"]
    rng = np.random.default_rng(2)
    n, D = 10, cfg.hidden_size
    L = n + 3
    tokens = rng.integers(0, 256, L)
    hid = {i: rng.standard_normal((L, D)).astype(np.float32) for i in cfg.drafter.target_layer_ids}
    dt = DrafterTorch(cfg, dw, embed, head)
    anchors = [n, 4, 0]
    with torch.no_grad():
        out = dt({i: torch.tensor(h)[None] for i, h in hid.items()}, torch.tensor(tokens)[None],
                 torch.tensor([anchors]))
    nd = DFlashDrafter(cfg, dw, NumpyOps(), embed, head)
    for j, a in enumerate(anchors):
        cache = nd.new_cache(32)
        nd.extend(cache, {i: h[:a] for i, h in hid.items()})
        ref = nd.draft(cache, int(tokens[a]))
        np.testing.assert_allclose(out[0, j].numpy(), ref, atol=1e-4, rtol=0)
