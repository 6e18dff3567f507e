"""Every check that needs no weights runs before the first weight byte is read: a wrong drafter config.json, a
quantization_config that disagrees with quant=, a missing tokenizer file. The load is throttled (0.2 MB/s: the tiny
target alone would take a minute), so an error reported after the target's load could not come in time; the
progress callback proves that no byte was read."""
from __future__ import annotations

import json
import shutil

import pytest

from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
from kdtree.engine import Engine
from kdtree.errors import CheckpointError


@pytest.fixture
def tiny_copy(compose_cfg, tmp_path):
    cfg = compose_cfg()
    src = ensure_tiny_checkpoint(cfg.model, cfg.quant, cfg.cache_dir)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit(path, **fields):
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def _load(compose_cfg, ckpt, *overrides):
    progress = []
    cfg = compose_cfg(f"model.path={ckpt}", "load.throttle_mb_s=0.2", *overrides)
    with pytest.raises(CheckpointError) as err:
        Engine.from_config(cfg, progress=lambda *a: progress.append(a))
    return str(err.value), progress


def test_wrong_drafter_config_fails_before_the_target_is_read(compose_cfg, tiny_copy):
    _edit(tiny_copy / "drafter" / "config.json", num_key_value_heads=3)
    msg, progress = _load(compose_cfg, tiny_copy)
    assert "drafter/config.json: field num_key_value_heads=3" in msg and "model.drafter.num_key_value_heads=2" in msg
    assert progress == []          # not one chunk of the target was read


def test_missing_drafter_tensor_fails_before_the_target_is_read(compose_cfg, tiny_copy):
    _edit(tiny_copy / "drafter" / "config.json", num_hidden_layers=3)
    msg, progress = _load(compose_cfg, tiny_copy, "model.drafter.num_hidden_layers=3")
    assert "layers.2." in msg and "is missing" in msg
    assert progress == []


def test_quantization_config_mismatch_fails_before_any_read(compose_cfg, tiny_copy):
    msg, progress = _load(compose_cfg, tiny_copy, "quant=int4_w4a16")
    assert "no quantization_config" in msg and "use quant=fp32" in msg
    assert progress == []


def test_missing_tokenizer_file_fails_before_any_read(compose_cfg, tiny_copy):
    msg, progress = _load(compose_cfg, tiny_copy, "model.tokenizer=tiktoken")
    assert "tiktoken.model" in msg
    assert progress == []
