"""Tensor-parallel slice reads: the same values as slicing the full tensor, fewer bytes read."""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.checkpoint.loader import load_checkpoint
from kdtree.model.names import target_linear_shapes
from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
from tests.checkpoint.configs import quant_cfg

RANK, TP = 1, 4


def megatron(name, shape):
    """Rank RANK of TP: q_b/kv_b/experts' gate/up split rows, o_proj/down split columns, the rest whole."""
    if len(shape) != 2:
        return None
    if any(s in name for s in ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "embed_tokens")):
        n = shape[0] // TP
        return (slice(RANK * n, (RANK + 1) * n),)
    if any(s in name for s in ("o_proj", "down_proj")):
        n = shape[1] // TP
        return (slice(None), slice(RANK * n, (RANK + 1) * n))
    return None


@pytest.mark.parametrize("disk", ["F32", "BF16"])
@pytest.mark.parametrize("strategy", ["eager", "mmap"])
def test_slices_match_full_tensor_and_read_less(write, cfg, fp32, weights, disk, strategy):
    d = write(dtypes={k: disk for k in weights})
    full, full_stats = load_checkpoint(d, cfg, fp32, strategy=strategy)
    part, stats = load_checkpoint(d, cfg, fp32, strategy=strategy, shard=megatron, chunk_mb=0.05)
    assert set(part) == set(full)
    for k, w in full.items():
        sl = megatron(k, w.shape)
        want = w if sl is None else w[sl]
        assert part[k].shape == want.shape and np.array_equal(part[k], want), k
        assert part[k].flags.c_contiguous
    assert stats.bytes_read == sum(p.size for p in part.values()) * (2 if disk == "BF16" else 4)
    assert stats.bytes_read < 0.4 * full_stats.bytes_read


def test_three_dim_and_empty_slices(tmp_path):
    from kdtree.checkpoint.safetensors_io import write_file
    from kdtree.checkpoint.loader import _runs
    from kdtree.checkpoint.safetensors_io import read_header

    x = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    write_file(tmp_path / "x.safetensors", {"x": x})
    info = read_header(tmp_path / "x.safetensors").tensors["x"]
    raw = (tmp_path / "x.safetensors").read_bytes()
    for sl in [((1, 3), (0, 5), (0, 6)), ((1, 3), (2, 4), (0, 6)), ((0, 4), (1, 2), (3, 5)), ((2, 2), (0, 5), (0, 6))]:
        shape, offsets, run = _runs(info, sl)
        got = b"".join(raw[o:o + run] for o in offsets)
        want = x[tuple(slice(a, b) for a, b in sl)]
        assert shape == want.shape and got == want.tobytes()


def test_int4_slices_equal_rows_and_cols_of_the_full_weight(tmp_path, cfg):
    q = quant_cfg("int4_w4a16")
    d = ensure_tiny_checkpoint(cfg, q, str(tmp_path))
    seen = []

    def shard(name, shape):
        seen.append((name, shape))
        return megatron(name, shape)

    full, full_stats = load_checkpoint(d, cfg, q)
    part, stats = load_checkpoint(d, cfg, q, shard=shard)
    up, down = "model.layers.2.mlp.experts.6.up_proj.weight", "model.layers.2.mlp.experts.6.down_proj.weight"
    assert (up, target_linear_shapes(cfg)["model.layers.2.mlp.experts.6.up_proj"]) in seen  # logical name + shape
    r = slice(RANK * 64, (RANK + 1) * 64)
    assert np.array_equal(part[up].dequantize(), full[up].rows(r).dequantize())
    assert np.array_equal(part[down].dequantize(), full[down].cols(r).dequantize())
    assert stats.bytes_read < 0.4 * full_stats.bytes_read


def test_int4_column_slice_off_the_group_grid_is_refused(tmp_path, cfg):
    q = quant_cfg("int4_w4a16")
    d = ensure_tiny_checkpoint(cfg, q, str(tmp_path))
    with pytest.raises(ValueError, match="multiples of"):
        load_checkpoint(d, cfg, q, shard=lambda n, s: (slice(None), slice(4, 36)) if "experts" in n else None)
