"""Checkpoint-loader throughput (issue 9): the bench_load stage end to end, and pytest-benchmark timings.

    .venv/bin/python -m pytest tests/bench/test_load_bench.py --benchmark-enable --benchmark-only

Nothing about speed is asserted; the rates land in bench_load.json / the benchmark JSON (extra_info
carries the `cat > /dev/null` rate of the same files, measured beside it).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kdtree.checkpoint.loader import load_checkpoint
from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
from kdtree.pipeline.context import StageContext
from kdtree.stages import bench_load
from tests.checkpoint.configs import model_cfg, quant_cfg

GB = 0.02


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-load-cache")


def ctx_for(cache, run_dir, events):
    cfg = OmegaConf.create({"cache_dir": str(cache), "load": {"threads": 2}})
    return StageContext(cfg=cfg, run_dir=run_dir, emit=lambda kind, **f: events.append((kind, f)))


def test_stage_writes_bench_load_json_and_reuses_its_checkpoint(cache, tmp_path):
    events = []
    out = bench_load.run(ctx_for(cache, tmp_path / "a", events), bench_load.BenchLoadConfig(gb=GB, repeats=1))
    saved = json.loads((tmp_path / "a" / "bench_load.json").read_text())
    for key in ("loader_mb_s", "plain_read_mb_s", "ratio", "bytes", "progress_overhead"):
        assert saved[key] == out[key] and key in events[0][1]
    assert abs(saved["bytes"] - GB * 1e9) < 0.15 * GB * 1e9
    assert saved["loader_mb_s"] > 0 and saved["plain_read_mb_s"] > 0
    assert saved["ratio"] == pytest.approx(saved["loader_mb_s"] / saved["plain_read_mb_s"])
    rows = {r["key"]: r for r in saved["rows"]}
    assert list(rows) == ["cat", "loader", "progress", "float32", "other"] and rows["cat"]["ratio"] == 1
    assert rows["loader"]["mb_s"] == pytest.approx(saved["loader_mb_s"])
    assert rows["float32"]["ratio"] == pytest.approx(saved["float32_ratio"])
    assert saved["strategy"] == "mmap" and "eager_ratio" in saved
    md = (tmp_path / "a" / "bench_load.md").read_text()
    assert md.startswith("| reader | hot MB/s | hot × cat |") and "loader mmap, stored dtypes" in md
    if saved["cold"]:  # root: the page cache was dropped before each cold read
        assert saved["cold_ratio"] == pytest.approx(saved["cold_loader_mb_s"] / saved["cold_plain_read_mb_s"])
    else:
        assert "drop the page cache" in saved["cold_skipped"]
    ckpt = saved["checkpoint"]
    stamp = {p: p.stat().st_mtime_ns for p in Path(ckpt).iterdir()}
    again = bench_load.run(ctx_for(cache, tmp_path / "b", []), bench_load.BenchLoadConfig(gb=GB, repeats=1))
    assert json.loads((tmp_path / "b" / "bench_load.json").read_text())["checkpoint"] == ckpt
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp and again["bytes"] == saved["bytes"]


def test_synthetic_checkpoint_has_the_k2_layout_and_int4_experts(cache):
    from kdtree.quant.int4 import Int4Weight

    path, model, quant = bench_load.ensure_bench_checkpoint(GB, 8, str(cache))
    weights, stats = load_checkpoint(path, model, quant)
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    assert isinstance(weights["model.layers.1.mlp.experts.63.down_proj.weight"], Int4Weight)
    assert weights["model.layers.1.self_attn.kv_b_proj.weight"].dtype.name == "float32"
    assert stats.bytes_read == stats.bytes_total


def _cat_mb_s(files) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return sum(f.stat().st_size for f in files) / 1e6 / (time.perf_counter() - t0)


@pytest.mark.parametrize("strategy,raw", [("mmap", True), ("mmap", False), ("eager", True)],
                         ids=["mmap-stored", "mmap-float32", "eager-stored"])
@pytest.mark.parametrize("threads", [1, 4])
def test_bench_load_synthetic(benchmark, cache, threads, strategy, raw):
    path, model, quant = bench_load.ensure_bench_checkpoint(0.2, 8, str(cache))
    files = sorted(path.glob("*.safetensors"))
    _cat_mb_s(files)  # hot cache
    _, stats = benchmark(load_checkpoint, path, model, quant, threads=threads, strategy=strategy, raw=raw)
    benchmark.extra_info.update(bytes=stats.bytes_read, cat_mb_s=_cat_mb_s(files), threads=threads,
                                strategy=strategy, raw=raw)


def test_bench_load_tiny(benchmark, cache):
    path = ensure_tiny_checkpoint(model_cfg(), quant_cfg(), str(cache))
    _, stats = benchmark(load_checkpoint, path, model_cfg(), quant_cfg())
    benchmark.extra_info.update(bytes=stats.bytes_read)


def test_the_command_line_sizes_the_checkpoint_and_prints_the_table(cache, tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "kdtree.run", "pipeline=bench_load", "bench_load.gb=0.03",
                        "bench_load.repeats=1", "bench_load.cold=false", "load.threads=2", f"cache_dir={cache}",
                        f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((run_dir / "bench_load.json").read_text())
    assert abs(saved["bytes"] - 0.03e9) < 0.15 * 0.03e9 and saved["threads"] == 2 and saved["repeats"] == 1
    assert "| `cat shards > /dev/null` |" in r.stdout and "loader / cat (hot cache)" in r.stdout
