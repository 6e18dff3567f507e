"""Shared fixtures of the K2 target tests: the tiny config and its random weights (non-unit norms)."""
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


def load_model_cfg(name: str):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / f"conf/model/{name}.yaml"))


@pytest.fixture(scope="session")
def k2_cfg():
    return load_model_cfg("tiny")


@pytest.fixture(scope="session")
def k2_weights(k2_cfg):
    w = init_weights(target_tensor_shapes(k2_cfg), seed=0)
    rng = np.random.default_rng(7)
    for k in w:  # non-unit norms, so a norm applied to the wrong tensor shows up
        if k.endswith("norm.weight"):
            w[k] = (1.0 + 0.3 * rng.standard_normal(w[k].shape)).astype(np.float32)
    return w


@pytest.fixture(scope="session")
def k2_model(k2_cfg, k2_weights):
    return K2Model(k2_cfg, k2_weights, get_ops("numpy"))
