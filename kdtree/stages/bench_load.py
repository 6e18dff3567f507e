"""bench_load: checkpoint-loader throughput next to `cat file > /dev/null` of the same shards (issue 9).

    python -m kdtree.run pipeline=bench_load              # 2 GB; bench_load.json + bench_load.md in the run dir

Builds (once, cached under <cache>/bench_load/) a synthetic checkpoint of `gb` GB with the K2 layout and
K2's formats: routed experts INT4 (weight_packed I32, weight_scale BF16, weight_shape), everything else
BF16, random bytes (finite values; nobody runs it). Then, page cache hot (one cat first), one warm-up load
(first_load_s), then `repeats` rounds, each running in turn: `cat <shards> > /dev/null`; the loader
(`strategy`, tensors kept as stored: the headline `loader_mb_s` / `ratio`); the same with a
ProgressReporter; the same widened to float32 (what the fp32 numpy/cpu backends take: `float32_ratio`);
the other strategy. Then, where the page cache can be dropped (root), `repeats` cold rounds (drop, cat;
drop, loader) that measure the disk rather than memory bandwidth.

Every loader variant ends with every tensor byte resident in memory and usable (mmap: the pages are
read in and mapped before the load returns, not on first touch). progress_overhead = seconds inside the
progress callback / load seconds (a difference of two load times would drown in noise on a shared
machine). Rates use the median time and the shards' file bytes; MB = 10^6 bytes. first_touch_mb_s =
np.empty + one write per page of the same bytes: what any copy into fresh memory pays first.
"""
from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import numpy as np
from omegaconf import OmegaConf

from kdtree.checkpoint.hf_config import target_config_json
from kdtree.checkpoint.index import CONFIG_FILE
from kdtree.checkpoint.loader import load_checkpoint
from kdtree.checkpoint.progress import ProgressReporter
from kdtree.checkpoint.writer import write_checkpoint
from kdtree.config.paths import cache_root
from kdtree.config.schema import LoadConfig, ModelConfig, QuantConfig
from kdtree.model import names
from kdtree.quant.int4 import quantization_config_json

SIDE = "controller"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
FORMAT_VERSION = 1


@dataclass
class BenchLoadConfig:
    gb: float = 2.0  # size of the synthetic K2-layout checkpoint (built once, cached under cache_dir)
    repeats: int = 3  # alternating rounds (cat, loader variants); medians are reported
    shards: int = 8  # about this many shard files
    cold: bool = True  # also drop the page cache before each read (root only; skipped with a note otherwise)


CONFIG = BenchLoadConfig  # cfg.bench_load: this stage's options (kdtree/pipeline/registry.py)
_BLOCK = 128 * 2 ** 20          # one random block; every tensor is a view of part of it (no RAM per tensor)

# A wide K2: real head dims, 64 experts; for small `gb` the widths are divided by 2, 4, ... (smallest divisor
# that leaves room for a few layers), then MoE layers are added until the checkpoint holds `gb` GB.
_DIMS = dict(name="bench_load", vocab_size=8192, hidden_size=4096, intermediate_size=4096,
             moe_intermediate_size=1024, first_k_dense_replace=1, moe_layer_freq=1, num_attention_heads=32,
             num_key_value_heads=32, n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=1,
             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             max_position_embeddings=4096, bos_token_id=8188, eos_token_id=8189, mask_token_id=8190,
             pad_token_id=8191)
_SCALED = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
           "num_key_value_heads", "q_lora_rank", "kv_lora_rank")
_QUANT = dict(method="int4_w4a16", group_size=32,
              ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"])


def _model(div: int, layers: int):
    dims = dict(_DIMS, num_hidden_layers=layers, **{k: _DIMS[k] // div for k in _SCALED})
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), dims)


def _size(cfg) -> int:
    return sum(_disk_bytes(n, s, cfg) for n, s in names.target_tensor_shapes(cfg).items())


def bench_configs(gb: float):
    """(model_cfg, quant_cfg) of a K2-layout checkpoint of about `gb` GB in INT4 experts + BF16 rest."""
    quant = OmegaConf.merge(OmegaConf.structured(QuantConfig), _QUANT)
    div = 1
    while div < 16 and _size(_model(div, 4)) > gb * 1e9:
        div *= 2
    per_layer = _size(_model(div, 3)) - _size(_model(div, 2))
    layers = max(2, 2 + round((gb * 1e9 - _size(_model(div, 2))) / per_layer))
    return _model(div, layers), quant


def _quantized(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def _disk_bytes(name: str, shape, cfg) -> int:
    if _quantized(name):
        o, i = shape
        return o * i // 2 + o * (i // 32) * 2 + 8
    return int(np.prod(shape)) * 2


def _tensors(cfg, block: np.ndarray) -> tuple:
    """name -> array view of `block` (uint16 for BF16, int32 packed), and name -> on-disk dtype."""
    out: Dict[str, np.ndarray] = {}
    dtypes: Dict[str, str] = {}
    pos = 0

    def take(nbytes: int) -> np.ndarray:
        nonlocal pos
        assert nbytes <= block.nbytes, f"a {nbytes}-byte tensor is bigger than the random block"
        if pos + nbytes > block.nbytes:
            pos = 0
        pos += nbytes
        return block[pos - nbytes: pos]

    for name, shape in names.target_tensor_shapes(cfg).items():
        if _quantized(name):
            m, (o, i) = name[: -len(".weight")], shape
            out[f"{m}.weight_packed"] = take(o * i // 2).view(np.int32).reshape(o, i // 8)
            scale = take(o * (i // 32) * 2).view(np.uint16).reshape(o, i // 32)
            out[f"{m}.weight_scale"] = scale
            out[f"{m}.weight_shape"] = np.array([o, i], np.int32)
            dtypes[f"{m}.weight_scale"] = "BF16"
        else:
            out[name] = take(int(np.prod(shape)) * 2).view(np.uint16).reshape(shape)
            dtypes[name] = "BF16"
    return out, dtypes


def ensure_bench_checkpoint(gb: float, shards: int, cache_dir: str = "") -> tuple:
    """(path, model_cfg, quant_cfg) of the synthetic checkpoint, built once (temp dir + atomic rename)."""
    model, quant = bench_configs(gb)
    key = json.dumps({"v": FORMAT_VERSION, "dims": OmegaConf.to_container(model), "shards": shards}, sort_keys=True)
    root = cache_root(cache_dir) / "bench_load"
    final = root / f"{gb:g}gb-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (final / CONFIG_FILE).exists():
        return final, model, quant
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(0)
    # finite bf16 everywhere: exponent bits kept below all-ones (scales in [2^-16, 2^-1))
    block = rng.integers(0, 2 ** 16, _BLOCK // 2, dtype=np.uint16) & np.uint16(0xBF7F)
    block = block.view(np.uint8)
    tensors, dtypes = _tensors(model, block)
    conf = target_config_json(model)
    conf["quantization_config"] = quantization_config_json(quant)
    total = sum(a.nbytes for a in tensors.values())
    try:
        write_checkpoint(tmp, tensors, conf, max(1, total // max(1, shards) + 1), dtypes=dtypes)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / CONFIG_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, model, quant


class _TimedProgress:
    """A progress callback that adds up the seconds spent inside the wrapped one."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def __call__(self, *args) -> None:
        t0 = time.perf_counter()
        self.inner(*args)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def _cat(files: List[Path]) -> float:
    t0 = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run(["cat", *map(str, files)], stdout=null, check=True)
    return time.perf_counter() - t0


def drop_page_cache() -> str:
    """Empty the kernel's page cache so the next read comes from the disk: '' when done, else why not."""
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return ""
    except OSError as e:  # not root, or a container that forbids it
        return f"cannot drop the page cache ({DROP_CACHES}: {e.strerror}); cold-cache figures need root"


def _cold_rounds(path, files, model, quant, threads: int, strategy: str, repeats: int) -> dict:
    """Disk-bound figures: page cache dropped before every read, loader and cat alternating."""
    loader_s: List[float] = []
    cat_s: List[float] = []
    for _ in range(repeats):
        why = drop_page_cache()
        if why:
            return {"cold": False, "cold_skipped": why}
        cat_s.append(_cat(files))
        drop_page_cache()
        loader_s.append(_load(path, model, quant, threads, strategy, raw=True)[0])
    nbytes = sum(f.stat().st_size for f in files)
    loader, plain = statistics.median(loader_s), statistics.median(cat_s)
    return {"cold": True, "cold_loader_mb_s": nbytes / 1e6 / loader, "cold_plain_read_mb_s": nbytes / 1e6 / plain,
            "cold_ratio": plain / loader, "cold_loader_s": loader_s, "cold_plain_read_s": cat_s}


def _load(path, model, quant, threads: int, strategy: str, progress=None, raw: bool = True) -> tuple:
    t0 = time.perf_counter()
    weights, stats = load_checkpoint(path, model, quant, threads=threads, strategy=strategy, progress=progress,
                                     raw=raw)
    seconds = time.perf_counter() - t0
    del weights
    gc.collect()
    return seconds, stats


def _other(strategy: str) -> str:
    return "eager" if strategy == "mmap" else "mmap"


def table(out: dict) -> str:
    """The figures people compare, as a markdown table (also printed by the stage)."""
    cold = out.get("cold")
    head = "| reader | hot MB/s | hot × cat |" + (" cold MB/s | cold × cat |" if cold else "")
    lines = [head, "|---|---:|---:|" + ("---:|---:|" if cold else "")]
    for row in out["rows"]:
        line = f"| {row['reader']} | {row['mb_s']:.0f} | {row['ratio']:.2f} |"
        if cold:
            key = {"cat": "cold_plain_read_mb_s", "loader": "cold_loader_mb_s"}.get(row["key"])
            line += (f" {out[key]:.0f} | {out[key] / out['cold_plain_read_mb_s']:.2f} |" if key else " | |")
        lines.append(line)
    return "\n".join(lines)


def run(ctx, conf: BenchLoadConfig) -> dict:
    gb, repeats, shards, cold = conf.gb, conf.repeats, conf.shards, conf.cold
    load = OmegaConf.merge(OmegaConf.structured(LoadConfig), (ctx.cfg or {}).get("load") or {})  # the loader's knobs
    strategy, threads = str(load.strategy), int(load.threads)
    if strategy not in ("mmap", "eager"):
        raise ValueError(f"bench_load strategy={strategy!r}; use mmap or eager (load.strategy)")
    if gb <= 0 or repeats < 1 or shards < 1:
        raise ValueError(f"bench_load gb={gb}, repeats={repeats}, shards={shards}: all must be positive "
                         f"(e.g. gb=2 repeats=3 shards=8)")
    cfg = ctx.cfg
    cache_dir = str(OmegaConf.select(cfg, "cache_dir", default="") or "") if cfg is not None else ""
    t_build = time.perf_counter()
    path, model, quant = ensure_bench_checkpoint(float(gb), int(shards), cache_dir)
    build_s = time.perf_counter() - t_build
    files = sorted(path.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    _cat(files)                                   # hot cache: every measurement below reads from memory
    t0 = time.perf_counter()                      # what materialising the weights in fresh memory costs here
    touched = np.empty(nbytes, np.uint8)          # (one write per 4 KiB page; slow in VMs whose host backs
    touched[::4096] = 1                           # guest pages lazily, or when huge pages need compaction)
    first_touch_s = time.perf_counter() - t0
    del touched
    other = _other(strategy)
    # (key, reader, how): the headline loader keeps the stored formats (packed INT4, BF16): bytes from the
    # files to resident, usable memory. "float32" adds the widening the numpy backend needs (backend=cpu keeps BF16).
    variants = [
        ("cat", "`cat shards > /dev/null`", None),
        ("loader", f"loader {strategy}, stored dtypes", dict(strategy=strategy)),
        ("progress", f"loader {strategy}, stored dtypes, progress on", dict(strategy=strategy, progress=True)),
        ("float32", f"loader {strategy}, widened to float32 (the numpy backend; cpu keeps BF16)",
         dict(strategy=strategy, raw=False)),
        ("other", f"loader {other}, stored dtypes", dict(strategy=other)),
    ]
    first_load_s = _load(path, model, quant, threads, strategy)[0]   # warm-up; not in the medians
    times: Dict[str, List[float]] = {k: [] for k, _, _ in variants}
    callback_s: List[float] = []
    stats = None
    for _ in range(int(repeats)):                 # alternate, so drift on a shared machine hits all alike
        for key, _, how in variants:
            if how is None:
                times[key].append(_cat(files))
                continue
            how = dict(how)
            reporter = None
            if how.pop("progress", False):
                reporter = _TimedProgress(ProgressReporter(io.StringIO(), tty=False, interval_s=1.0))
            s, st = _load(path, model, quant, threads, how["strategy"], progress=reporter,
                          raw=how.get("raw", True))
            times[key].append(s)
            if reporter is not None:
                callback_s.append(reporter.seconds / s)
            if key == "loader":
                stats = st
    med = {k: statistics.median(v) for k, v in times.items()}
    plain = med["cat"]
    rows = [{"key": k, "reader": reader, "mb_s": nbytes / 1e6 / med[k], "ratio": plain / med[k],
             "seconds": times[k]} for k, reader, _ in variants]
    out = {
        "bytes": nbytes,
        "gb": gb,
        "loader_mb_s": nbytes / 1e6 / med["loader"],
        "plain_read_mb_s": nbytes / 1e6 / plain,
        "ratio": plain / med["loader"],           # loader rate / cat rate
        "progress_overhead": statistics.median(callback_s),
        "progress_ratio": plain / med["progress"],
        "float32_loader_mb_s": nbytes / 1e6 / med["float32"],
        "float32_ratio": plain / med["float32"],
        f"{other}_loader_mb_s": nbytes / 1e6 / med["other"],
        f"{other}_ratio": plain / med["other"],
        "first_touch_mb_s": nbytes / 1e6 / first_touch_s,
        "first_load_s": first_load_s,
        "loader_s": times["loader"],
        "loader_with_progress_s": times["progress"],
        "plain_read_s": times["cat"],
        "rows": rows,
        "threads": threads,
        "strategy": strategy,
        "repeats": int(repeats),
        "shards": len(files),
        "tensors": stats.tensors if stats else 0,
        "checkpoint": str(path),
        "build_s": build_s,
        "cpus": os.cpu_count(),
    }
    out.update(_cold_rounds(path, files, model, quant, threads, strategy, int(repeats)) if cold
               else {"cold": False, "cold_skipped": "cold=false"})
    Path(ctx.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(ctx.run_dir) / "bench_load.json").write_text(json.dumps(out, indent=2) + "\n")
    (Path(ctx.run_dir) / "bench_load.md").write_text(table(out) + "\n")
    print(f"bench_load: {nbytes / 1e9:.2f} GB K2-layout checkpoint (INT4 experts, BF16 rest) in {len(files)} "
          f"shards, {threads} threads, median of {int(repeats)} alternating rounds")
    print(table(out))
    print(f"loader / cat (hot cache): {out['ratio']:.2f}; progress overhead {100 * out['progress_overhead']:.2f}% "
          f"of the load" + ("" if out["cold"] else f"; cold cache skipped ({out['cold_skipped']})"))
    keys = ("bytes", "loader_mb_s", "plain_read_mb_s", "ratio", "progress_overhead", "float32_ratio", "cold_ratio")
    ctx.emit("bench_load", **{k: out[k] for k in keys if k in out})
    return {k: out[k] for k in keys if k in out}
