"""Writing a checkpoint and loading it back gives the same tensors, in HF layout other tools can read."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from kdtree.checkpoint import loader
from kdtree.checkpoint.loader import load_checkpoint
from kdtree.bf16 import bf16_to_f32, f32_to_bf16
from kdtree.checkpoint.safetensors_io import read_header


def test_hf_layout_with_index_and_sizes(write, weights):
    d = write(max_shard_bytes=3_000_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(weights)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in weights.values())
    assert json.loads((d / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]


def test_shards_load_in_the_safetensors_package(write, weights):
    d = write(max_shard_bytes=3_000_000)
    seen = {}
    for f in d.glob("*.safetensors"):
        seen.update(load_file(str(f)))
        assert read_header(f).data_start % 8 == 0
    assert set(seen) == set(weights)
    assert all(np.array_equal(seen[k], weights[k]) for k in weights)


@pytest.mark.parametrize("threads,chunk_mb", [(1, 32), (4, 32), (3, 0.05)], ids=["1thread", "4threads", "tiny-chunks"])
def test_round_trip_eager(write, cfg, fp32, weights, threads, chunk_mb):
    loaded, stats = load_checkpoint(write(), cfg, fp32, threads=threads, chunk_mb=chunk_mb)
    assert list(loaded) == list(weights)
    for k, w in weights.items():
        assert loaded[k].dtype == np.float32 and np.array_equal(loaded[k], w), k
    assert stats.bytes_read == stats.bytes_total == sum(w.nbytes for w in weights.values())
    assert sum(s.bytes_read for s in stats.shards) == stats.bytes_read and len(stats.shards) == 4


def test_round_trip_mmap_equals_eager(write, cfg, fp32, weights):
    loaded, stats = load_checkpoint(write(), cfg, fp32, strategy="mmap")
    assert all(np.array_equal(loaded[k], w) for k, w in weights.items())
    assert stats.strategy == "mmap" and stats.bytes_read == stats.bytes_total


@pytest.mark.parametrize("disk", ["F32", "BF16"])
@pytest.mark.parametrize("strategy", ["eager", "mmap"])
def test_loaded_weights_start_on_cache_lines(write, cfg, fp32, weights, disk, strategy):
    """The native kernels read weight rows 64 bytes at a time; numpy's own allocations start 16 bytes past a line,
    where every such load straddles two (float32 2048x7168 at 9 rows: 1.4x slower on one thread). Eager copies
    and widened BF16 are placed on lines; mapped tensors are where the file puts them, and this writer puts every
    tensor of whole lines on one (the rest follow, element-aligned: safetensors allows no holes)."""
    d = write(dtypes={k: disk for k in weights})
    for f in d.glob("*.safetensors"):
        hdr = read_header(f)
        assert hdr.data_start % 64 == 0, f
        assert all(t.start % 64 == 0 for t in hdr.tensors.values() if t.nbytes % 64 == 0), f
    loaded, _ = load_checkpoint(d, cfg, fp32, strategy=strategy, chunk_mb=0.1)
    lines = {k: v for k, v in loaded.items() if v.nbytes % 64 == 0}
    assert len(lines) > len(loaded) // 2
    off = {k: v.ctypes.data % 64 for k, v in lines.items() if v.ctypes.data % 64}
    assert not off, f"{strategy}, {disk} on disk: {len(off)} of {len(lines)} weights off a line: {sorted(off.items())[:4]}"


@pytest.mark.parametrize("disk", ["BF16", "F16"])
@pytest.mark.parametrize("strategy,widen_block", [("eager", 1 << 18), ("eager", 1000), ("mmap", 0)])
def test_half_precision_on_disk_loads_as_float32(write, cfg, fp32, weights, disk, strategy, widen_block,
                                                 monkeypatch):
    monkeypatch.setattr(loader, "_WIDEN_BLOCK", widen_block or loader._WIDEN_BLOCK)  # 1000: many in-place blocks
    d = write(dtypes={k: disk for k in weights})
    loaded, stats = load_checkpoint(d, cfg, fp32, strategy=strategy, chunk_mb=0.1)
    assert stats.bytes_read == sum(w.nbytes for w in weights.values()) // 2
    for k, w in weights.items():
        want = bf16_to_f32(f32_to_bf16(w)) if disk == "BF16" else w.astype(np.float16).astype(np.float32)
        assert loaded[k].dtype == np.float32 and np.array_equal(loaded[k], want), k


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, np.nan], np.float32)  # ties at 1+2^-8, 1+3*2^-8
    back = bf16_to_f32(f32_to_bf16(x))
    assert back[:5].tolist() == [1.0, 1.0, 1.015625, -2.5, np.inf] and np.isnan(back[5])


def test_single_file_layout_without_index(write, cfg, fp32, weights):
    d = write(max_shard_bytes=0)
    assert (d / "model.safetensors").exists() and not (d / "model.safetensors.index.json").exists()
    loaded, stats = load_checkpoint(d, cfg, fp32)
    assert all(np.array_equal(loaded[k], w) for k, w in weights.items()) and len(stats.shards) == 1


def test_bf16_shards_load_in_torch_and_torch_written_shards_load_here(write, cfg, fp32, weights, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load, save_file as torch_save

    d = write(dtypes={k: "BF16" for k in weights}, max_shard_bytes=0)
    theirs = torch_load(str(d / "model.safetensors"))
    for k, w in weights.items():
        assert theirs[k].dtype == torch.bfloat16
        assert np.array_equal(theirs[k].float().numpy(), bf16_to_f32(f32_to_bf16(w))), k
    # and the other way round: a shard written by the safetensors package (as HF checkpoints are)
    other = tmp_path / "torch-written"
    other.mkdir()
    (other / "config.json").write_text((d / "config.json").read_text())
    torch_save({k: v.clone() for k, v in theirs.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    loaded, _ = load_checkpoint(other, cfg, fp32)
    assert all(np.array_equal(loaded[k], theirs[k].float().numpy()) for k in weights)
