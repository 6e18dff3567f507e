"""Fixtures of the speculative-decoding tests: the tiny target (random weights, non-unit norms)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.backends import get_ops
from kdtree.checkpoint.names import init_weights, target_tensor_shapes
from kdtree.config.schema import ModelConfig
from kdtree.model.k2 import K2Model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_cfg():
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf/model/tiny.yaml"))


@pytest.fixture(scope="session")
def tiny_weights(tiny_cfg):
    w = init_weights(target_tensor_shapes(tiny_cfg), seed=0)
    rng = np.random.default_rng(7)
    for k in w:  # non-unit norms, so a norm applied to the wrong rows shows up
        if k.endswith("norm.weight"):
            w[k] = (1.0 + 0.3 * rng.standard_normal(w[k].shape)).astype(np.float32)
    return w


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg, tiny_weights):
    return K2Model(tiny_cfg, tiny_weights, get_ops("numpy"))
