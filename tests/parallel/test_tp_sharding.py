"""The tensor-parallel sharding plan (kdtree/parallel/sharding.py) on the embedded tiny checkpoint, in one process:
the rank slices tile every split tensor exactly, each rank reads only its bytes (LoadStats == bytes_per_rank),
INT4 slices fall on pack/group boundaries and dequantize to the matching slice of the whole weight.

Run: .venv/bin/python -m pytest -q tests/parallel/test_tp_sharding.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from kdtree.model import names
from kdtree.checkpoint.index import open_checkpoint
from kdtree.checkpoint.loader import load_checkpoint
from kdtree.pipeline.registry import register_schema as register
from kdtree.engine import resolve_checkpoint
from kdtree.errors import ConfigError
from kdtree.parallel.sharding import ROWS, COLS, bytes_per_rank, shard_fn, shard_slices, split_axis

CONF = Path(__file__).resolve().parents[2] / "conf"
register()


@pytest.fixture(scope="module")
def compose_tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tp-sharding-cache")

    def _compose(*overrides):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="config", overrides=[f"cache_dir={cache}", *overrides])

    return _compose


def test_plan_splits_heads_and_intermediate_and_replicates_the_rest(compose_tiny):
    m = compose_tiny().model
    L = "model.layers.1"
    assert split_axis(f"{L}.self_attn.q_b_proj.weight") == (ROWS, "q_head")
    assert split_axis(f"{L}.self_attn.kv_b_proj.weight") == (ROWS, "kv_head")
    assert split_axis(f"{L}.self_attn.o_proj.weight") == (COLS, "v_head")
    for p in ("model.layers.0.mlp", f"{L}.mlp.shared_experts", f"{L}.mlp.experts.7"):
        assert split_axis(f"{p}.gate_proj.weight")[0] == ROWS and split_axis(f"{p}.up_proj.weight")[0] == ROWS
        assert split_axis(f"{p}.down_proj.weight")[0] == COLS
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", f"{L}.mlp.gate.weight",
                 f"{L}.mlp.gate.e_score_correction_bias", f"{L}.self_attn.q_a_proj.weight",
                 f"{L}.self_attn.kv_a_proj_with_mqa.weight", f"{L}.self_attn.kv_a_layernorm.weight"):
        assert split_axis(name) is None and shard_slices(m, name, (4, 4), 1, 2) is None, name
    # rank 3 of 8 holds head 3 of 8: its q_b rows are that head's [nope + rope] block
    qb = f"{L}.self_attn.q_b_proj.weight"
    per_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    sl = shard_slices(m, qb, names.target_tensor_shapes(m)[qb], 3, 8)
    assert sl[0] == slice(3 * per_head, 4 * per_head) and sl[1] == slice(None)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_slices_tile_every_tensor_exactly(compose_tiny, tp):
    m = compose_tiny().model
    for name, shape in names.target_tensor_shapes(m).items():
        cover = np.zeros(shape, np.int32)
        for r in range(tp):
            sl = shard_slices(m, name, shape, r, tp)
            cover[sl if sl is not None else ...] += 1
        expect = 1 if split_axis(name) else tp       # split: each element on exactly one rank; else on all
        assert (cover == expect).all(), name


def test_a_tp_that_splits_a_head_is_one_config_error(compose_tiny):
    m = compose_tiny().model
    name = "model.layers.1.self_attn.q_b_proj.weight"
    with pytest.raises(ConfigError, match=r"tp=16 cannot split tensor .*q_b_proj.* into whole q_head blocks"):
        shard_slices(m, name, names.target_tensor_shapes(m)[name], 0, 16)


@pytest.mark.parametrize("quant", ["fp32", "int4_w4a16"])
def test_each_rank_reads_only_its_bytes(compose_tiny, quant):
    """LoadStats.bytes_read of a rank's sliced load == bytes_per_rank; tp=1 == the whole target checkpoint."""
    cfg = compose_tiny(f"quant={quant}")
    ckpt = resolve_checkpoint(cfg)
    assert bytes_per_rank(cfg.model, cfg.quant, 1, float_bytes=4) == open_checkpoint(ckpt).data_bytes
    whole, _ = load_checkpoint(ckpt, cfg.model, cfg.quant)
    for tp in (2, 8):
        want = bytes_per_rank(cfg.model, cfg.quant, tp, float_bytes=4)
        for rank in (0, tp - 1):
            part, stats = load_checkpoint(ckpt, cfg.model, cfg.quant, shard=shard_fn(cfg.model, rank, tp))
            assert stats.bytes_read == want, (tp, rank)
            for name, w in part.items():           # the slice holds exactly the matching part of the whole
                sl = shard_slices(cfg.model, name, np.shape(whole[name]) if isinstance(whole[name], np.ndarray)
                                  else whole[name].shape, rank, tp)
                full = whole[name] if isinstance(whole[name], np.ndarray) else whole[name].dequantize()
                mine = w if isinstance(w, np.ndarray) else w.dequantize()
                np.testing.assert_array_equal(mine, full[sl] if sl is not None else full, err_msg=name)
    # sharded tensors dominate: at tp=8 a rank reads well under a quarter of the checkpoint
    assert bytes_per_rank(cfg.model, cfg.quant, 8, float_bytes=4) < open_checkpoint(ckpt).data_bytes / 4


def test_int4_down_proj_at_tp8_is_one_scale_group_per_row(compose_tiny):
    cfg = compose_tiny("quant=int4_w4a16", "tp='8'")
    ckpt = resolve_checkpoint(cfg)
    part, _ = load_checkpoint(ckpt, cfg.model, cfg.quant, shard=shard_fn(cfg.model, 5, 8))
    w = part["model.layers.1.mlp.experts.3.down_proj.weight"]
    inter = cfg.model.moe_intermediate_size // 8                    # 32 columns = one group of 32
    assert w.shape == (cfg.model.hidden_size, inter)
    assert w.packed.shape == (cfg.model.hidden_size, inter // 8) and w.scale.shape == (cfg.model.hidden_size, 1)
