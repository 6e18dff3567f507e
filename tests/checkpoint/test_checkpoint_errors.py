"""Each broken checkpoint fails before loading with one line naming the file, the tensor and the fix."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kdtree.checkpoint.loader import load_checkpoint
from kdtree.errors import CheckpointError
from tests.checkpoint.configs import quant_cfg

NAME = "model.layers.2.mlp.experts.5.up_proj.weight"


def fails(d, cfg, quant, *needles):
    for strategy in ("mmap", "eager"):     # the same line from either load strategy
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(d, cfg, quant, strategy=strategy)
        msg = str(e.value)
        assert "\n" not in msg, msg
        for n in needles:
            assert str(n) in msg, msg
    return msg


def shard_of(d, name):
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_missing_tensor(write, cfg, fp32, weights):
    d = write({k: v for k, v in weights.items() if k != NAME})
    fails(d, cfg, fp32, "model.safetensors.index.json", NAME, "missing", "model=tiny")


def test_unexpected_tensor(write, cfg, fp32, weights):
    d = write({**weights, "model.layers.2.mlp.experts.99.up_proj.weight": weights[NAME]})
    fails(d, cfg, fp32, ".safetensors", "model.layers.2.mlp.experts.99.up_proj.weight", "unexpected")


def test_wrong_shape(write, cfg, fp32, weights):
    d = write({**weights, NAME: weights[NAME][:, :-1].copy()})
    fails(d, cfg, fp32, shard_of(d, NAME).name, NAME, "[256, 127]", "[256, 128]")


def test_wrong_dtype(write, cfg, fp32, weights):
    bad = "model.norm.weight"
    d = write({**weights, bad: weights[bad].astype(np.int32)})
    fails(d, cfg, fp32, shard_of(d, bad).name, bad, "I32", "F32")


def test_truncated_shard(write, cfg, fp32):
    d = write()
    f = shard_of(d, NAME)
    f.write_bytes(f.read_bytes()[:-1000])
    fails(d, cfg, fp32, f.name, "truncated", "re-download")


def test_corrupt_header(write, cfg, fp32):
    d = write()
    f = shard_of(d, NAME)
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"\x00garbage!!\xff\xfe"
    f.write_bytes(bytes(raw))
    fails(d, cfg, fp32, f.name, "corrupt safetensors header")


def test_header_length_beyond_file(write, cfg, fp32):
    d = write()
    f = shard_of(d, NAME)
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) * 2)
    f.write_bytes(bytes(raw))
    fails(d, cfg, fp32, f.name, "header length", "beyond the file size")


def test_data_offsets_beyond_file(write, cfg, fp32):
    d = write()
    f = shard_of(d, NAME)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    begin, end = header[NAME]["data_offsets"]
    header[NAME]["data_offsets"] = [begin + 10 ** 9, end + 10 ** 9]  # same length, far past the end
    new = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    fails(d, cfg, fp32, f.name, NAME, "truncated shard")


def test_index_points_at_missing_file(write, cfg, fp32):
    d = write()
    f = shard_of(d, NAME)
    f.unlink()
    fails(d, cfg, fp32, "model.safetensors.index.json", f.name, "does not exist")


@pytest.mark.parametrize("field,value", [("hidden_size", 256), ("num_hidden_layers", 3), ("rope_theta", 5e4),
                                         ("mask_token_id", 1)])
def test_config_json_field_disagrees(write, cfg, fp32, field, value):
    d = write(config={field: value})
    fails(d, cfg, fp32, "config.json", f"{field}={value}", f"model.{field}={cfg[field]}")


def test_config_json_without_the_architecture_dims_is_refused(write, cfg, fp32, tmp_path):
    d = write()
    conf = json.loads((d / "config.json").read_text())
    del conf["hidden_size"], conf["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(conf))
    fails(d, cfg, fp32, "config.json", "no hidden_size, num_hidden_layers", "not a K2-architecture")


def test_config_json_nested_rope_scaling(write, cfg, fp32):
    d = write(config={"rope_scaling": {**dict(cfg.rope_scaling), "factor": 8.0}})
    fails(d, cfg, fp32, "config.json", "rope_scaling.factor=8.0", "model.rope_scaling.factor=4.0")


def test_unquantized_checkpoint_with_int4_config(write, cfg):
    fails(write(), cfg, quant_cfg("int4_w4a16"), "config.json", "quant.method=int4_w4a16", "quant=fp32")


def test_not_a_checkpoint_directory(tmp_path, cfg, fp32):
    fails(tmp_path / "nope", cfg, fp32, "nope", "does not exist")
    fails(tmp_path, cfg, fp32, str(tmp_path), "model.safetensors")


@pytest.mark.parametrize("strategy", ["mmap", "eager"])
def test_shard_truncated_while_loading_is_an_error_not_a_crash(write, cfg, fp32, strategy):
    d = write()
    f = shard_of(d, NAME)

    def truncate_once(done, *_):
        if done == 0:                       # after validation and mapping, before the first read
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)

    with pytest.raises(CheckpointError, match=rf"{f.name}: truncated shard, .* re-download"):
        load_checkpoint(d, cfg, fp32, strategy=strategy, progress=truncate_once, chunk_mb=0.25)
