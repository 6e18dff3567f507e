"""plan: memory and load-time plan of model/quant/tp from the config alone (no checkpoint, no GPU needed).

    python -m kdtree.run pipeline=plan model=k26 tp=8 quant=int4_w4a16 [plan.disk_mb_s=[2000,240]]

Per rank: the bytes of its slices of the sharded tensors (1/tp each) plus every replicated tensor; the
latent KV cache per token; the shard files the rank reads (from the checkpoint's index when the checkpoint
is there, else a computed layout of `shard_gb` shards in file order); the load time of the whole node at
each disk rate. Sharding rules (kdtree/parallel/sharding.py): q_b_proj and kv_b_proj split by head
(rows), o_proj by input columns; dense/shared/routed expert gate/up by rows, down by columns; latent
projections (q_a, kv_a), norms, router gate, embed and lm_head replicated. Writes plan.json.
"""
from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from omegaconf import OmegaConf

from kdtree.checkpoint.index import open_checkpoint
from kdtree.checkpoint.tiny import tiny_checkpoint_path
from kdtree.errors import ConfigError
from kdtree.model.names import target_linear_shapes, target_tensor_shapes
from kdtree.parallel.sharding import split_axis as logical_split
from kdtree.quant.int4 import module_is_quantized

SIDE = "controller"
PARAMS = {"disk_mb_s": list, "float_dtype": str, "shard_gb": float}

GB, MB, KiB = 1e9, 1e6, 1024
FLOAT_BYTES = {"fp32": 4, "bf16": 2}
KV_DTYPE, KV_BYTES = "fp32", 4  # the latent cache is float32 in this engine

def split_axis(tensor: str):
    """The TP split of a stored tensor (kdtree.parallel.sharding's rules), None for a replicated one.

    INT4 parts follow their logical weight: weight_packed/weight_scale split like `.weight`; weight_shape
    ([out, in], 2 integers) is read whole by every rank."""
    module, _, part = tensor.rpartition(".")
    if part == "weight_shape":
        return None
    return logical_split(f"{module}.weight" if part in ("weight_packed", "weight_scale") else tensor)


def _plain(node) -> types.SimpleNamespace:
    return types.SimpleNamespace(**OmegaConf.to_container(node, resolve=True))  # fast attribute access


def _checkpoint_dir(cfg) -> Optional[Path]:
    """The checkpoint to read the layout from, if it exists (never generated here)."""
    path = OmegaConf.select(cfg, "model.path", default="", throw_on_missing=False) or ""
    if path and path != "???":
        p = Path(str(path)).expanduser()
        return p if p.is_dir() else None
    try:
        p = tiny_checkpoint_path(cfg.model, cfg.quant, cfg.get("cache_dir", ""))
    except Exception:
        return None
    return p if (p / "config.json").exists() else None


def computed_tensors(model, quant, float_bytes: int) -> Iterator[Tuple[str, int]]:
    """(tensor name, bytes) in file order for a checkpoint of this config (INT4 modules as packed/scale/shape)."""
    group = int(quant.group_size)
    linear = target_linear_shapes(model)  # only Linear modules are quantized (not embeddings, not the router)
    for name, shape in target_tensor_shapes(model).items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in linear and module_is_quantized(module, quant):
            out, inp = shape
            yield f"{module}.weight_packed", out * math.ceil(inp / 8) * 4       # int32 [out, in/8]
            yield f"{module}.weight_scale", out * math.ceil(inp / group) * 2    # bf16 [out, in/group]
            yield f"{module}.weight_shape", 2 * 4                              # int32 [2]
        else:
            yield name, math.prod(shape) * float_bytes


def computed_layout(tensors, shard_bytes: float) -> Tuple[List[Tuple[str, str, int]], int]:
    """Greedy HF-style layout: fill `model-0000N-of-0000M.safetensors` up to shard_bytes, in file order."""
    rows, shard, used = [], 0, 0
    for name, nbytes in tensors:
        if used and used + nbytes > shard_bytes:
            shard, used = shard + 1, 0
        rows.append((name, shard, nbytes))
        used += nbytes
    n = shard + 1
    return [(name, f"model-{s + 1:05d}-of-{n:05d}.safetensors", b) for name, s, b in rows], n


def _fmt_bytes(b: float) -> str:
    return f"{b / GB:,.2f} GB" if b >= 0.01 * GB else f"{b / MB:,.2f} MB"


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def make_plan(cfg, disk_mb_s=(2000.0, 240.0), float_dtype: str = "auto", shard_gb: float = 5.0) -> dict:
    model, quant = _plain(cfg.model), _plain(cfg.quant)
    tp = int(cfg.tp.size)
    if float_dtype == "auto":
        float_dtype = "fp32" if quant.method == "fp32" else "bf16"
    if float_dtype not in FLOAT_BYTES:
        raise ConfigError(f"plan.float_dtype={float_dtype}; use auto, fp32 or bf16")
    if not disk_mb_s or any(not isinstance(r, (int, float)) or r <= 0 for r in disk_mb_s):
        raise ConfigError(f"plan.disk_mb_s={list(disk_mb_s)}; give positive MB/s rates, e.g. [2000,240]")
    ckpt = _checkpoint_dir(cfg)
    if ckpt is not None:
        idx = open_checkpoint(ckpt)
        layout = [(t.name, t.path.name, t.nbytes) for t in idx.tensors.values()]
        n_files, source = len(idx.files), f"checkpoint index {ckpt}"
    else:
        layout, n_files = computed_layout(computed_tensors(model, quant, FLOAT_BYTES[float_dtype]), shard_gb * GB)
        source = f"computed layout ({shard_gb:g} GB shards, non-quantized tensors {float_dtype})"
    sharded = replicated = 0
    file_bytes: Dict[str, float] = {}  # bytes ONE rank reads from each file
    for name, fname, nbytes in layout:
        if split_axis(name):
            sharded += nbytes
            share = nbytes / tp
        else:
            replicated += nbytes
            share = nbytes
        file_bytes[fname] = file_bytes.get(fname, 0.0) + share
    per_rank = sharded / tp + replicated
    files = sorted(file_bytes)
    kv_per_token = (model.kv_lora_rank + model.qk_rope_head_dim) * model.num_hidden_layers * KV_BYTES
    node_bytes = per_rank * tp  # every rank reads its own slices; one host, one disk
    return {
        "model": model.name, "quant": quant.method, "tp": tp, "source": source, "files_total": n_files,
        "float_dtype": float_dtype if ckpt is None else "as stored",
        "total_bytes": sharded + replicated, "sharded_bytes": sharded, "replicated_bytes": replicated,
        "per_rank_bytes": per_rank,
        # the latent cache is not split by heads: every rank keeps all of it
        "kv_cache": {"dtype": KV_DTYPE, "bytes_per_token": kv_per_token, "per_rank": True,
                     "formula": f"({model.kv_lora_rank}+{model.qk_rope_head_dim}) x {model.num_hidden_layers} layers x {KV_BYTES} B"},
        "ranks": [{"rank": r, "bytes": per_rank, "files": files} for r in range(tp)],
        "node_read_bytes": node_bytes,
        "load_time_s": {f"{r:g}": node_bytes / (r * MB) for r in disk_mb_s},
    }


def format_plan(p: dict) -> str:
    kv = p["kv_cache"]
    lines = [
        f"plan  model={p['model']} quant={p['quant']} tp={p['tp']}   from {p['source']}",
        f"  weights total        {_fmt_bytes(p['total_bytes']):>14}   sharded {_fmt_bytes(p['sharded_bytes'])} "
        f"+ replicated {_fmt_bytes(p['replicated_bytes'])}",
        f"  weights per rank     {_fmt_bytes(p['per_rank_bytes']):>14}   sharded / {p['tp']} + replicated",
        f"  KV cache per token   {kv['bytes_per_token'] / KiB:>11,.1f} KiB   latent {kv['dtype']}, {kv['formula']}, "
        f"per rank ({kv['bytes_per_token'] * 8192 / GB:.2f} GB per 8k tokens)",
        "",
        f"  {'rank':>4}  {'files':>5}  {'bytes read':>14}  files",
    ]
    for r in p["ranks"]:
        f = r["files"]
        span = f"{f[0]} .. {f[-1]}" if len(f) > 1 else (f[0] if f else "-")
        lines.append(f"  {r['rank']:>4}  {len(f):>5}  {_fmt_bytes(r['bytes']):>14}  {span}")
    lines.append("")
    lines.append(f"  load time (the node reads {_fmt_bytes(p['node_read_bytes'])} = {p['tp']} ranks x per-rank bytes):")
    for rate, s in p["load_time_s"].items():
        lines.append(f"  {rate:>10} MB/s   {_fmt_s(s):>10}")
    return "\n".join(lines)


def run(ctx, disk_mb_s: list = (2000.0, 240.0), float_dtype: str = "auto", shard_gb: float = 5.0) -> dict:
    p = make_plan(ctx.cfg, [float(r) for r in disk_mb_s], float_dtype, float(shard_gb))
    print(format_plan(p), flush=True)
    (Path(ctx.run_dir) / "plan.json").write_text(json.dumps(p, indent=1))
    return {"per_rank_bytes": p["per_rank_bytes"], "files_total": p["files_total"],
            "kv_bytes_per_token": p["kv_cache"]["bytes_per_token"]}
