"""A small FP32 K2 checkpoint on disk (2 shards + index + drafter/), written with the project's writer."""
import copy

import pytest

from kdtree.checkpoint.hf_config import drafter_config_json, target_config_json
from kdtree.checkpoint.writer import write_checkpoint
from kdtree.config.schema import group_config
from kdtree.model import names


def quant_cfg(name: str, **overrides):
    cfg = group_config("quant", name)
    for k, v in overrides.items():
        cfg[k] = v
    return cfg


@pytest.fixture(scope="session")
def make_quant_cfg():
    """make_quant_cfg("int4_w4a16", ignore=[]) -> conf/quant/<name>.yaml over the QuantConfig schema."""
    return quant_cfg


@pytest.fixture(scope="session")
def tiny_cfg(tiny_cfg):
    """The tests' tiny_cfg cut to 2 layers for the quantization tests."""
    cfg = copy.deepcopy(tiny_cfg)
    cfg.num_hidden_layers = 2                       # layer 0 dense, layer 1 MoE: every kind of Linear, fast
    cfg.drafter.target_layer_ids = [0, 1]
    return cfg


@pytest.fixture(scope="session")
def fp32_checkpoint(tmp_path_factory, tiny_cfg):
    d = tmp_path_factory.mktemp("fp32") / "ckpt"
    tensors = names.init_weights(names.target_tensor_shapes(tiny_cfg), seed=0)
    write_checkpoint(d, tensors, target_config_json(tiny_cfg), max_shard_bytes=1_000_000)   # several shards
    drafter = names.init_weights(names.drafter_tensor_shapes(tiny_cfg), seed=1)
    write_checkpoint(d / "drafter", drafter, drafter_config_json(tiny_cfg), max_shard_bytes=0)
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "byte"}\n')
    return d
