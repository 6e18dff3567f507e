"""load.strategy=mmap: the pages are read in and mapped before the load returns, tensors are views of them.

What a user notices: right after load_checkpoint returns, the shards' bytes are resident in the process
(no page faults / disk reads later, at the first request), and the weights are not a second copy of the
checkpoint in memory (the mapping's pages are the page cache's, not private anonymous memory).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kdtree.checkpoint import loader
from kdtree.checkpoint.loader import load_checkpoint
from kdtree.bf16 import f32_to_bf16
from kdtree.checkpoint.safetensors_io import read_header


def _mapped(path) -> dict:
    """/proc/self/smaps totals (kB) of every mapping of `path`."""
    out, cur = {}, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:          # a mapping's first line
                cur = len(head) >= 6 and head[5] == str(path)
            elif cur and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out


def test_load_returns_with_every_shard_resident_and_shared(write, cfg, fp32, weights):
    d = write()
    loaded, stats = load_checkpoint(d, cfg, fp32, strategy="mmap", threads=2, chunk_mb=0.25)
    files = sorted(d.glob("*.safetensors"))
    assert len(files) == 4
    for f in files:
        h = read_header(f)
        data_kb = (f.stat().st_size - h.data_start) // 1024
        m = _mapped(f.resolve())
        assert m, f"{f.name} is not mapped after the load"
        assert m["Rss"] >= data_kb, f"{f.name}: {m['Rss']} kB resident of {data_kb} kB right after the load"
        assert m.get("Anonymous", 0) == 0       # the page cache's pages, not a private copy
    w = loaded["model.embed_tokens.weight"]
    assert not w.flags.writeable and np.array_equal(w, weights["model.embed_tokens.weight"])
    del loaded, w
    assert not _mapped(files[0].resolve()), "the mapping outlives the weights"


def test_kernels_without_madv_populate_read_fall_back_to_touching_pages(write, cfg, fp32, weights, monkeypatch):
    # an advice the kernel rejects (EINVAL) is what a kernel older than 5.14 answers to MADV_POPULATE_READ
    monkeypatch.setattr(loader._Resident, "MADV_POPULATE_READ", 0x7FFF)
    d = write()
    loaded, stats = load_checkpoint(d, cfg, fp32, strategy="mmap", chunk_mb=0.25)
    for f in sorted(d.glob("*.safetensors")):   # resident before anything touched the weights
        assert _mapped(f.resolve())["Rss"] >= (f.stat().st_size - read_header(f).data_start) // 1024
    assert all(np.array_equal(loaded[k], w) for k, w in weights.items())


@pytest.mark.parametrize("strategy", ["mmap", "eager"])
def test_raw_keeps_the_stored_bf16_bits(write, cfg, fp32, weights, strategy):
    d = write(dtypes={k: "BF16" for k in weights})
    raw, stats = load_checkpoint(d, cfg, fp32, strategy=strategy, raw=True, chunk_mb=0.1)
    widened, _ = load_checkpoint(d, cfg, fp32, strategy=strategy, chunk_mb=0.1)
    assert list(raw) == list(weights) and stats.bytes_read == sum(w.nbytes for w in weights.values()) // 2
    for k, w in weights.items():
        assert raw[k].dtype == np.uint16 and np.array_equal(raw[k], f32_to_bf16(w)), k
        assert np.array_equal(widened[k].view(np.uint32) >> 16, raw[k]), k


@pytest.mark.parametrize("strategy", ["mmap", "eager"])
def test_column_slices_under_mmap_and_eager_agree(write, cfg, fp32, weights, strategy):
    d = write()
    name = "model.layers.0.self_attn.o_proj.weight"
    cols = weights[name].shape[1]
    part, stats = load_checkpoint(d, cfg, fp32, strategy=strategy, chunk_mb=0.01,
                                  shard=lambda n, s: (slice(None), slice(cols // 4, cols // 2)) if n == name else None)
    assert part[name].flags.c_contiguous
    assert np.array_equal(part[name], weights[name][:, cols // 4: cols // 2])
    assert stats.bytes_read == stats.bytes_total - weights[name].nbytes * 3 // 4


def test_rewriting_a_mapped_checkpoint_leaves_the_loaded_weights_intact(write, cfg, fp32, weights):
    d = write()
    loaded, _ = load_checkpoint(d, cfg, fp32, strategy="mmap")
    before = {k: np.array(v) for k, v in loaded.items()}
    changed = {k: w + 1 for k, w in weights.items()}
    write(tensors=changed)                       # the same directory, rewritten (new files renamed in)
    assert all(np.array_equal(loaded[k], before[k]) for k in weights)   # not truncated under us (no SIGBUS)
    again, _ = load_checkpoint(d, cfg, fp32, strategy="mmap")
    assert all(np.array_equal(again[k], changed[k]) for k in weights)
    assert not list(d.glob(".*.tmp-*"))


def test_mlock_pins_the_mapped_weights_or_names_the_limit(write, cfg, fp32):
    import resource

    from kdtree.errors import CheckpointError

    d = write()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < need:
        with pytest.raises(CheckpointError, match=r"cannot lock .*memlock limit \(ulimit -l unlimited"):
            load_checkpoint(d, cfg, fp32, strategy="mmap", mlock=True)
        return
    loaded, _ = load_checkpoint(d, cfg, fp32, strategy="mmap", mlock=True)
    for f in sorted(d.glob("*.safetensors")):
        assert _mapped(f.resolve())["Locked"] >= (f.stat().st_size - read_header(f).data_start) // 1024, f.name
    with pytest.raises(ValueError, match="needs strategy='mmap'"):
        load_checkpoint(d, cfg, fp32, strategy="eager", mlock=True)
