"""Fixtures of the checkpoint tests: the tiny model/quant configs, its weights, and a written checkpoint."""
from __future__ import annotations

import pytest

from kdtree.checkpoint.hf_config import target_config_json
from kdtree.model.names import init_weights, target_tensor_shapes
from kdtree.checkpoint.tiny import TINY_SHARD_BYTES
from kdtree.checkpoint.writer import write_checkpoint
from tests.checkpoint.configs import model_cfg, quant_cfg


@pytest.fixture(scope="session")
def cfg():
    c = model_cfg("tiny")
    c.init = "random"  # these tests are about the seeded generator; the shipped trained one has its own tests
    return c


@pytest.fixture(scope="session")
def fp32():
    return quant_cfg("fp32")


@pytest.fixture(scope="session")
def weights(cfg):
    return init_weights(target_tensor_shapes(cfg), cfg.seed)


@pytest.fixture
def write(tmp_path, cfg, weights):
    """write(**changes) -> a target checkpoint dir of the tiny weights with `changes` applied (None = drop)."""
    def _write(tensors=None, config=None, dtypes=None, max_shard_bytes=TINY_SHARD_BYTES, name="ckpt"):
        t = dict(weights if tensors is None else tensors)
        conf = target_config_json(cfg)
        conf.update(config or {})
        return write_checkpoint(tmp_path / name, t, conf, max_shard_bytes, dtypes=dtypes)
    return _write
