"""plan: memory and load-time plan of model/quant/tp from the config alone (no checkpoint, no GPU needed).

    python -m kdtree.run pipeline=plan model=k26 tp=8 quant=int4_w4a16 [plan.disk_mb_s=[2000,240]]

Per rank: the bytes of its slices of the sharded tensors (1/tp each) plus every replicated tensor; the
latent KV cache per token; the paged pool's pages per rank and bytes per page (the prefix cache lives in it); the shard files the rank reads (from the checkpoint's index when the checkpoint
is there, else a computed layout of `shard_gb` shards in file order); the load time of the whole node at
each disk rate. Sharding rules (kdtree/parallel/sharding.py): q_b_proj and kv_b_proj split by head
(rows), o_proj by input columns; dense/shared/routed expert gate/up by rows, down by columns; latent
projections (q_a, kv_a), norms, router gate, embed and lm_head replicated. Writes plan.json.
"""
from __future__ import annotations

import functools
import json
import math
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from omegaconf import OmegaConf

from kdtree.checkpoint.index import open_checkpoint
from kdtree.checkpoint.loader import _PAGE, _SPAN_GAP, plan_load
from kdtree.checkpoint.tiny import tiny_checkpoint_path
from kdtree.errors import ConfigError
from kdtree.model.names import drafter_tensor_shapes, target_linear_shapes, target_tensor_shapes
from kdtree.parallel.sharding import shard_fn
from kdtree.parallel.sharding import split_axis as logical_split
from kdtree.quant import int4
from kdtree.quant.int4 import module_is_quantized

SIDE = "controller"


@dataclass
class PlanConfig:
    disk_mb_s: List[float] = field(default_factory=lambda: [2000.0, 240.0])  # disk read rates to estimate load time
    float_dtype: str = "auto"  # non-quantized weights without a checkpoint: auto (fp32 for quant=fp32, else bf16) | fp32 | bf16
    shard_gb: float = 5.0  # shard size of the computed layout when there is no checkpoint index (GB = 1e9 B)


CONFIG = PlanConfig  # cfg.plan: this stage's options (kdtree/pipeline/registry.py)


GB, MB, KiB, MiB, GiB = 1e9, 1e6, 1024, 1024 ** 2, 1024 ** 3
FLOAT_BYTES = {"fp32": 4, "bf16": 2}
KV_DTYPE, KV_BYTES = "fp32", 4  # the latent cache is float32 in this engine
STORED_DTYPE = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "I32": "int32"}   # safetensors dtype -> plan label

# Device memory (backend=cuda): memory.total as nvidia-smi reports it on each card
DEVICES = {"RTX PRO 6000 (96 GB)": 97887 * MiB, "H200 (141 GB)": 143771 * MiB}
CUDA_RESERVE_BYTES = 1 * GiB        # CUDA context, cudart, NCCL channel buffers: an estimate (~0.5-1 GiB measured
                                    # on Hopper by other engines), not a measurement of this one
GRAPH_KERNELS_PER_LAYER = 24        # launches of one layer of the CUDA forward (norms, projections, rope, attention,
                                    # routing, grouped experts, all-reduces), an upper estimate
GRAPH_NODE_BYTES = 4 * KiB          # driver memory per captured kernel node: an estimate

@functools.lru_cache(maxsize=None)   # the plan asks for every tensor several times (k26: 200k tensors)
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


def _drafter_tensors(model, float_bytes: int) -> List[Tuple[str, str, int]]:
    return [(n, "drafter/model.safetensors", math.prod(s) * float_bytes)
            for n, s in drafter_tensor_shapes(model).items()]


def _computed_memory(layout, tp: int, stored_float: int, strategy: str, linear_rows: Dict[str, int],
                     keep_bf16: bool = False) -> dict:
    """Memory of one rank's load when there is no checkpoint to plan from: the loader's rules, per tensor.

    Float tensors are held as float32 (numpy): fp32 whole tensors and row slices are views of the mapped
    pages, bf16 ones are widened copies; column slices are gathered copies, and their pages are mapped whole
    when the row gap is under the loader's _SPAN_GAP (runs that close are read as one). keep_bf16 (backend=cpu:
    load_checkpoint(bf16=True)): bf16 tensors are held as stored (views). INT4 group scales stay bf16 either way."""
    read = mapped = copied = 0
    for name, _, nbytes in layout:
        axis = split_axis(name)
        share = nbytes / tp if axis else nbytes
        read += share
        part = name.rpartition(".")[2]
        widen = stored_float == 2 and part not in ("weight_packed", "weight_shape", "weight_scale") and \
            not keep_bf16                                                         # bf16 -> float32
        held = share * (2 if widen else 1)
        if strategy == "eager":
            copied += held
            continue
        if axis and axis[0] == 1 and tp > 1:     # a column slice: a copy, and the pages it spans
            copied += held
            rows = linear_rows.get(name.rpartition(".")[0], 1)
            row = nbytes / rows                   # bytes of one stored row; the rank reads row / tp of each
            mapped += nbytes if row - row / tp < _SPAN_GAP else rows * (math.ceil(row / tp / _PAGE) + 1) * _PAGE
        else:
            mapped += share
            copied += held if widen else 0
    return {"read_bytes": read, "mapped_bytes": mapped, "copied_bytes": copied}


def _model_copies(model, layout, tp: int, keep_bf16: bool = False) -> float:
    """Bytes the target builds at construction beside the loaded tensors: W_uk/W_uv per layer (kv_b_proj split per
    head, this rank's heads) and the router gate of every MoE layer, as float32 copies -- except where the loader
    keeps BF16 as stored (keep_bf16: backend=cpu's native forward): a BF16 kv_b_proj's halves are BF16 copies, a BF16
    router gate is read where it is mapped (no copy)."""
    def stored(suffix: str, elements: int) -> float:   # bytes per element of the first such tensor (4 if none)
        return next((nbytes / elements for name, _, nbytes in layout if name.endswith(suffix)), 4)

    heads = model.num_attention_heads // tp
    per_head = (model.qk_nope_head_dim + model.v_head_dim) * model.kv_lora_rank
    kv_b16 = keep_bf16 and stored(".self_attn.kv_b_proj.weight", model.num_attention_heads * per_head) == 2
    gate16 = keep_bf16 and stored(".mlp.gate.weight", model.n_routed_experts * model.hidden_size) == 2
    moe_layers = sum(1 for name, _, _ in layout if name.endswith(".mlp.gate.weight"))
    return (model.num_hidden_layers * heads * per_head * (2 if kv_b16 else 4)
            + (0 if gate16 else moe_layers * model.n_routed_experts * model.hidden_size * 4))


def _int4_unpacked(layout, tp: int) -> float:
    """float32 bytes of the unpacked q of this rank's INT4 modules (the numpy reference's UNPACKED cache)."""
    return sum(nbytes * 8 / (tp if split_axis(name) else 1)     # 8 values per 4-byte word -> 8 x 4 B / 4 B
               for name, _, nbytes in layout if name.endswith(".weight_packed"))


def _scratch(model, rows: int, tp: int) -> float:
    """Activations of one forward of `rows` rows (float32, the largest live set: logits, the MLP's gate/up,
    the absorbed queries), an estimate; the drafter's are of the same order and not added."""
    H = model.num_attention_heads // tp
    inter = max(model.intermediate_size, model.moe_intermediate_size * model.num_experts_per_tok) // tp
    per_row = (model.vocab_size + 3 * inter + H * (model.kv_lora_rank + 2 * model.qk_rope_head_dim
                                                   + model.qk_nope_head_dim) + 4 * model.hidden_size)
    return rows * per_row * 4


def _device_dtype(name: str, dtypes: Dict[str, str], float_label: str) -> Optional[str]:
    """The dtype a tensor keeps on the device (CUDA forward), None for one that is not uploaded.

    INT4 modules stay packed (int32 words) with their bf16 group scales; weight_shape is host metadata (the
    descriptor carries n_out/n_in). Every other tensor keeps its stored dtype: BF16 stays BF16 (no float32 copy);
    kv_b_proj is uploaded as its absorbed halves W_uk/W_uv, the same elements in the same dtype."""
    part = name.rpartition(".")[2]
    if part == "weight_shape":
        return None
    if part == "weight_packed":
        return "int4 packed (int32)"
    if part == "weight_scale":
        return "int4 scales (bf16)"
    return dtypes.get(name, float_label)


def _graph_bytes(model, buckets: List[int]) -> float:
    """Driver memory of the CUDA graphs (one per row-count bucket): nodes x an estimate per node. The activations
    of a replay live in the scratch (shared by every bucket), not in the graph."""
    nodes = model.num_hidden_layers * GRAPH_KERNELS_PER_LAYER + 8
    return len(buckets) * nodes * GRAPH_NODE_BYTES


def _device_plan(cfg, model, layout, dtypes: Dict[str, str], float_label: str, tp: int, drafter_bytes: float,
                 kv_per_token: int, drafter_kv_per_token: int, tree_rows: int) -> dict:
    """Device bytes per rank of backend=cuda: weights by dtype, the latent KV cache of serve.kv_pool_tokens
    tokens (the scheduler's pool: every running request's prompt + output + tree), the scratch of the largest
    forward (serve.max_batch_tokens rows), the CUDA graphs of the row buckets, the runtime reserve; and whether it
    fits each device, with the largest cache that would."""
    cache_tokens = int(OmegaConf.select(cfg, "serve.kv_pool_tokens", default=16384))
    max_rows = max(tree_rows, int(OmegaConf.select(cfg, "serve.max_batch_tokens", default=512)))
    buckets = sorted({1, tree_rows, max_rows})     # decode, one tree verify, a full batch / prefill chunk
    by_dtype: Dict[str, float] = {}
    for name, _, nbytes in layout:
        dt = _device_dtype(name, dtypes, float_label)
        if dt is not None:
            by_dtype[dt] = by_dtype.get(dt, 0.0) + (nbytes / tp if split_axis(name) else nbytes)
    ranks = []
    for r in range(tp):
        weights = dict(by_dtype)
        if r == 0 and drafter_bytes:   # rank 0 drafts: the drafter's weights in their stored dtype
            weights[f"drafter {float_label}"] = float(drafter_bytes)
        kv = cache_tokens * (kv_per_token + (drafter_kv_per_token if r == 0 else 0))
        row = {"rank": r, "weights_by_dtype": weights, "weights_bytes": sum(weights.values()),
               "kv_cache_tokens": cache_tokens, "kv_cache_bytes": kv,
               "kv_bytes_per_token": kv_per_token + (drafter_kv_per_token if r == 0 else 0),
               "scratch_rows": max_rows, "scratch_bytes": _scratch(model, max_rows, tp),
               "graph_buckets": buckets, "graphs_bytes": _graph_bytes(model, buckets),
               "reserve_bytes": CUDA_RESERVE_BYTES}
        row["total_bytes"] = (row["weights_bytes"] + kv + row["scratch_bytes"] + row["graphs_bytes"]
                              + row["reserve_bytes"])
        fixed = row["total_bytes"] - kv
        row["fits"] = {dev: row["total_bytes"] <= cap for dev, cap in DEVICES.items()}
        # the largest serve.kv_pool_tokens that would fit each device (0 when even the weights do not)
        row["max_kv_cache_tokens"] = {dev: max(0, int((cap - fixed) // row["kv_bytes_per_token"]))
                                      for dev, cap in DEVICES.items()}
        ranks.append(row)
    worst = max(ranks, key=lambda x: x["total_bytes"])
    fits = {dev: all(x["fits"][dev] for x in ranks) for dev in DEVICES}
    advice = {}
    for dev, ok in fits.items():
        if ok:
            continue
        most = min(x["max_kv_cache_tokens"][dev] for x in ranks)
        fix = (f"lower serve.kv_pool_tokens to <= {most}" if most > 0
               else f"the weights alone do not fit (rank {worst['rank']}: {_fmt_bytes(worst['weights_bytes'])})")
        advice[dev] = (f"rank {worst['rank']} needs {_fmt_bytes(worst['total_bytes'])} > {_fmt_bytes(DEVICES[dev])} "
                       f"with serve.kv_pool_tokens={cache_tokens}; {fix}, or raise tp (tp={tp})")
    return {"devices": {dev: cap for dev, cap in DEVICES.items()}, "ranks": ranks, "fits": fits,
            "does_not_fit": advice, "max_rank_bytes": worst["total_bytes"]}


def _prefix_plan(cfg, model, with_drafter: bool, kv_per_token: int, drafter_kv_per_token: int, device) -> dict:
    """The paged latent-cache pool and the prefix cache inside it (serve.kv_pool_tokens in pages of
    serve.prefix_cache_page; kdtree/model/pages.py, kdtree/decode/prefix_cache.py): pages per rank, bytes per token
    and per page (every rank: the latent rows of every layer; rank 0 also the drafter's context K/V of the same
    positions, so a speculative hit maps both -- the target's hidden rows it would otherwise keep are the
    alternative not taken), the cached tokens serve.prefix_cache_tokens allows, and with backend=cuda the most pool
    tokens that fit each rank's device after the weights, scratch, graphs and reserve (running requests and cached
    pages share them)."""
    page = int(OmegaConf.select(cfg, "serve.prefix_cache_page", default=16))
    pool = int(OmegaConf.select(cfg, "serve.kv_pool_tokens", default=16384))
    budget = int(OmegaConf.select(cfg, "serve.prefix_cache_tokens", default=8192))
    pages = pool // page
    hidden = len(model.drafter.target_layer_ids) * model.hidden_size * KV_BYTES if with_drafter else 0
    dkv = drafter_kv_per_token if with_drafter else 0
    d = model.drafter
    out = {"enabled": bool(OmegaConf.select(cfg, "serve.prefix_cache", default=True)) and budget >= page,
           "page_tokens": page, "pages_per_rank": pages, "pool_tokens": pages * page,
           "budget_tokens": min(budget, pages * page) // page * page, "budget_pages": min(budget // page, pages),
           "latent_bytes_per_token_per_layer": (model.kv_lora_rank + model.qk_rope_head_dim) * KV_BYTES,
           "latent_bytes_per_token": kv_per_token,
           "drafter_kv_bytes_per_token": dkv,
           "drafter_kv_formula": (f"2 x {d.num_key_value_heads} heads x {d.head_dim} x {d.num_hidden_layers} layers x "
                                  f"{KV_BYTES} B" if with_drafter else ""),
           "drafter_hidden_bytes_per_token": hidden,         # the alternative not taken (the target's hidden rows)
           "drafter_hidden_formula": (f"{len(model.drafter.target_layer_ids)} layers x {model.hidden_size} x "
                                      f"{KV_BYTES} B" if with_drafter else ""),
           "bytes_per_token": kv_per_token + dkv,            # rank 0; ranks 1.. hold the latent rows only
           "page_bytes": page * (kv_per_token + dkv), "pool_bytes_rank0": pages * page * (kv_per_token + dkv),
           "held_by": "every rank's paged pool (rank 0: + the drafter's context pages)"}
    if device is not None:
        fit = {dev: min(r["max_kv_cache_tokens"][dev] for r in device["ranks"]) for dev in device["devices"]}
        out["device_fit"] = {dev: {"tokens": t // page * page, "pages": t // page} for dev, t in fit.items()}
    return out


def format_prefix(c: dict, layers: int) -> List[str]:
    dkv = c["drafter_kv_bytes_per_token"]
    line = (f"  paged pool           {c['pages_per_rank']} pages of {c['page_tokens']} tokens per rank "
            f"(serve.kv_pool_tokens={c['pool_tokens']}); per token: latent {c['latent_bytes_per_token'] / KiB:,.1f} "
            f"KiB ({c['latent_bytes_per_token_per_layer']} B per layer x {layers}) on every rank"
            + (f" + drafter context KV {dkv / KiB:,.1f} KiB ({c['drafter_kv_formula']}; the target's hidden rows "
               f"would be {c['drafter_hidden_bytes_per_token'] / KiB:,.1f} KiB) on rank 0" if dkv else "")
            + f" = {c['bytes_per_token'] / KiB:,.1f} KiB; {_fmt_bytes(c['pool_bytes_rank0'])} on rank 0")
    lines = [line, f"  prefix cache         up to {c['budget_tokens']} tokens ({c['budget_pages']} pages) of the pool "
                   f"(serve.prefix_cache_tokens){'' if c['enabled'] else ' (off)'}: a hit maps them, zero-copy"]
    for dev, f in (c.get("device_fit") or {}).items():
        lines.append(f"  pool fit             {dev}: {f['tokens']} tokens ({f['pages']} pages) per rank (the tightest) "
                     f"after the weights, scratch and graphs; running requests and cached pages share them")
    return lines


def make_plan(cfg, disk_mb_s=(2000.0, 240.0), float_dtype: str = "auto", shard_gb: float = 5.0) -> dict:
    model, quant = _plain(cfg.model), _plain(cfg.quant)
    model.drafter = types.SimpleNamespace(**model.drafter)
    tp = int(cfg.tp.size)
    backend = str(OmegaConf.select(cfg, "backend.name", default="numpy"))
    # the native CPU forward takes BF16 as stored (native_forward.keeps_bf16; not with the per-op drafter)
    keep_bf16 = backend == "cpu" and str(OmegaConf.select(cfg, "backend.drafter_forward", default="native")) != "per_op"
    strategy = str(OmegaConf.select(cfg, "load.strategy", default="mmap"))
    tree = OmegaConf.select(cfg, "tree", default=None)
    with_drafter = tree is not None and str(tree.kind) != "ar"
    rows = int(tree.budget) + 1 if with_drafter else 1
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
        dtypes = {t.name: STORED_DTYPE.get(t.dtype, t.dtype.lower()) for t in idx.tensors.values()}
        emb = idx.tensors.get("model.embed_tokens.weight")
        float_label = dtypes[emb.name] if emb is not None else "fp32"
    else:
        layout, n_files = computed_layout(computed_tensors(model, quant, FLOAT_BYTES[float_dtype]), shard_gb * GB)
        source = f"computed layout ({shard_gb:g} GB shards, non-quantized tensors {float_dtype})"
        dtypes, float_label = {}, float_dtype
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
    d = model.drafter
    drafter_kv_per_token = 2 * d.num_key_value_heads * d.head_dim * d.num_hidden_layers * KV_BYTES

    unpacked = 0
    if backend == "numpy":   # the numpy reference's cache of unpacked INT4 weights, at most its limit
        unpacked = min(int4.UNPACKED.limit, _int4_unpacked(layout, tp))
    copies = _model_copies(model, layout, tp, keep_bf16)
    ranks = []
    for r in range(tp):
        if ckpt is not None:   # the loader's own plan: same slices, same span merging, nothing read
            m = plan_load(ckpt, cfg.model, cfg.quant, shard=shard_fn(cfg.model, r, tp) if tp > 1 else None,
                          strategy=strategy, bf16=keep_bf16)
            mem = {"read_bytes": m.read_bytes, "mapped_bytes": m.mapped_bytes, "copied_bytes": m.copied_bytes}
            dm = plan_load(ckpt, cfg.model, cfg.quant, drafter=True, strategy=strategy, bf16=keep_bf16) \
                if with_drafter and r == 0 \
                else None
            dmem = dm and {"read_bytes": dm.read_bytes, "mapped_bytes": dm.mapped_bytes, "copied_bytes": dm.copied_bytes}
        else:
            if r == 0:   # every rank holds the same amount of its own slices
                out_rows = {m: shape[0] for m, shape in target_linear_shapes(model).items()}
                mem = _computed_memory(layout, tp, FLOAT_BYTES[float_dtype], strategy, out_rows, keep_bf16)
            dmem = (_computed_memory(_drafter_tensors(model, FLOAT_BYTES[float_dtype]), 1,
                                     FLOAT_BYTES[float_dtype], strategy, {}, keep_bf16)
                    if with_drafter and r == 0 else None)
        row = {"rank": r, "files": files, "bytes": per_rank, **mem, "model_copies_bytes": copies,
               "drafter": dmem, "kv_bytes_per_token": kv_per_token + (drafter_kv_per_token if dmem else 0),
               "scratch_bytes": _scratch(model, rows, tp),
               "int4_unpacked_bytes": unpacked}
        d_bytes = (dmem["mapped_bytes"] + dmem["copied_bytes"]) if dmem else 0
        # what this rank holds once loaded: mapped pages (views and the pages of copied tensors) + copies
        row["resident_after_load_bytes"] = (mem["mapped_bytes"] + mem["copied_bytes"] + row["model_copies_bytes"]
                                            + d_bytes)
        row["read_total_bytes"] = mem["read_bytes"] + (dmem["read_bytes"] if dmem else 0)
        ranks.append(row)
    node_bytes = sum(r["read_total_bytes"] for r in ranks)  # every rank reads its own slices; rank 0 the drafter
    device = None
    if backend == "cuda":
        device = _device_plan(cfg, model, layout, dtypes, float_label, tp,
                              ranks[0]["drafter"]["read_bytes"] if ranks[0]["drafter"] else 0,
                              kv_per_token, drafter_kv_per_token if with_drafter else 0, rows)
    return {
        "model": model.name, "quant": quant.method, "tp": tp, "source": source, "layers": model.num_hidden_layers, "files_total": n_files,
        "backend": backend, "strategy": strategy, "tree": str(tree.kind) if tree is not None else "ar",
        "float_dtype": float_dtype if ckpt is None else "as stored",
        "total_bytes": sharded + replicated, "sharded_bytes": sharded, "replicated_bytes": replicated,
        "per_rank_bytes": per_rank,
        # the latent cache is not split by heads: every rank keeps all of it
        "kv_cache": {"dtype": KV_DTYPE, "bytes_per_token": kv_per_token, "per_rank": True,
                     "drafter_bytes_per_token": drafter_kv_per_token if with_drafter else 0,
                     "formula": f"({model.kv_lora_rank}+{model.qk_rope_head_dim}) x {model.num_hidden_layers} layers x {KV_BYTES} B"},
        "prefix_cache": _prefix_plan(cfg, model, with_drafter, kv_per_token,
                                     drafter_kv_per_token if with_drafter else 0, device),
        "ranks": ranks,
        "node_read_bytes": node_bytes,
        "load_time_s": {f"{r:g}": node_bytes / (r * MB) for r in disk_mb_s},
        "device": device,
    }


def format_device(d: dict) -> List[str]:
    """The backend=cuda section of the plan: device bytes per rank and the verdict per device."""
    r0 = d["ranks"][0]
    dtypes = sorted({k for r in d["ranks"] for k in r["weights_by_dtype"]})
    lines = [f"  device bytes per rank (backend=cuda): weights as the device keeps them (INT4 packed, BF16 as BF16), "
             f"latent cache of serve.kv_pool_tokens={r0['kv_cache_tokens']} tokens, scratch of "
             f"{r0['scratch_rows']} rows, graphs of row buckets {r0['graph_buckets']}",
             "  " + f"{'rank':>4}  " + "  ".join(f"{t:>19}" for t in dtypes)
             + f"  {'weights':>9}  {'KV cache':>9}  {'scratch':>9}  {'graphs':>9}  {'reserve':>9}  {'total':>9}"]
    for r in d["ranks"]:
        w = r["weights_by_dtype"]
        lines.append("  " + f"{r['rank']:>4}  " + "  ".join(f"{_fmt_bytes(w[t]) if t in w else '-':>19}" for t in dtypes)
                     + f"  {_fmt_bytes(r['weights_bytes']):>9}  {_fmt_bytes(r['kv_cache_bytes']):>9}  "
                       f"{_fmt_bytes(r['scratch_bytes']):>9}  {_fmt_bytes(r['graphs_bytes']):>9}  "
                       f"{_fmt_bytes(r['reserve_bytes']):>9}  {_fmt_bytes(r['total_bytes']):>9}")
    lines.append("  graphs and reserve (CUDA context, NCCL buffers) are estimates; the rest is counted tensor by tensor")
    for dev, cap in d["devices"].items():
        most = min(r["max_kv_cache_tokens"][dev] for r in d["ranks"])
        if d["fits"][dev]:
            lines.append(f"  fits {dev}: largest rank {_fmt_bytes(d['max_rank_bytes'])} of {_fmt_bytes(cap)} with "
                         f"serve.kv_pool_tokens={r0['kv_cache_tokens']} (up to {most} tokens would fit)")
        else:
            lines.append(f"  does NOT fit {dev}: {d['does_not_fit'][dev]}")
    return lines


def format_plan(p: dict) -> str:
    kv = p["kv_cache"]
    lines = [
        f"plan  model={p['model']} quant={p['quant']} tp={p['tp']} backend={p['backend']} load.strategy="
        f"{p['strategy']} tree={p['tree']}   from {p['source']}",
        f"  weights total        {_fmt_bytes(p['total_bytes']):>14}   sharded {_fmt_bytes(p['sharded_bytes'])} "
        f"+ replicated {_fmt_bytes(p['replicated_bytes'])}",
        f"  weights per rank     {_fmt_bytes(p['per_rank_bytes']):>14}   sharded / {p['tp']} + replicated (on disk)",
        f"  KV cache per token   {kv['bytes_per_token'] / KiB:>11,.1f} KiB   latent {kv['dtype']}, {kv['formula']}, "
        f"per rank ({kv['bytes_per_token'] * 8192 / GB:.2f} GB per 8k tokens)"
        + (f"; drafter {kv['drafter_bytes_per_token'] / KiB:,.1f} KiB on rank 0" if kv["drafter_bytes_per_token"] else ""),
        *format_prefix(p["prefix_cache"], p["layers"]),
        "",
        f"  {'rank':>4}  {'files':>5}  {'read':>10}  {'mapped':>10}  {'copied':>10}  {'drafter':>10}  "
        f"{'resident':>10}  {'scratch':>9}  files",
    ]
    for r in p["ranks"]:
        f = r["files"]
        span = f"{f[0]} .. {f[-1]}" if len(f) > 1 else (f[0] if f else "-")
        d = r["drafter"]
        lines.append(f"  {r['rank']:>4}  {len(f):>5}  {_fmt_bytes(r['read_total_bytes']):>10}  "
                     f"{_fmt_bytes(r['mapped_bytes']):>10}  {_fmt_bytes(r['copied_bytes'] + r['model_copies_bytes']):>10}"
                     f"  {_fmt_bytes(d['mapped_bytes'] + d['copied_bytes']) if d else '-':>10}  "
                     f"{_fmt_bytes(r['resident_after_load_bytes']):>10}  {_fmt_bytes(r['scratch_bytes']):>9}  {span}")
    r0 = p["ranks"][0]
    lines += [
        "  read: tensor bytes read (rank 0: + the whole drafter); mapped: page cache pages each rank maps and keeps",
        "  (column slices of o_proj/down_proj map whole rows where the row gap is < 64 KiB: the loader reads runs that",
        "  close as one); copied: float32 widening of bf16 (backend=cpu: none, bf16 weights and INT4 scales held",
        "  as stored), gathered column slices, W_uk/W_uv; resident = mapped +",
        "  copied + drafter, after the load; then + KV per token + scratch (one forward of the tree's rows)"
        + (f" + up to {_fmt_bytes(r0['int4_unpacked_bytes'])} of unpacked INT4 (numpy, $KDTREE_INT4_CACHE_MB caps it)"
           if r0["int4_unpacked_bytes"] else ""),
    ]
    if p.get("device"):
        lines += [""] + format_device(p["device"])
    lines += [
        "",
        f"  load time (the node reads {_fmt_bytes(p['node_read_bytes'])} = every rank's slices + the drafter once):",
    ]
    for rate, s in p["load_time_s"].items():
        lines.append(f"  {rate:>10} MB/s   {_fmt_s(s):>10}")
    return "\n".join(lines)


def engine_command(cfg) -> str:
    """The launch stage's command line for cfg (the key shown as <redacted> when one is set; llama.cpp's GGUF as
    the file the launch exports when engine.gguf is empty)."""
    from kdtree.config.secrets import api_key
    from kdtree.engines import command_line, printable
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if c.engine.name == "llamacpp" and not c.engine.gguf:
        c.engine.gguf = f"<cache_dir>/gguf/{c.model.name}-<checkpoint>-<fingerprint>-f32.gguf"
    if not c.model.path:
        c.model.path = str(_checkpoint_dir(cfg) or "<embedded checkpoint>")
    key = api_key(c.serve)
    return printable(command_line(c, key if c.engine.name == "sglang" else ""), key)


def run(ctx, conf: PlanConfig) -> dict:
    disk_mb_s, float_dtype, shard_gb = conf.disk_mb_s, conf.float_dtype, conf.shard_gb
    p = make_plan(ctx.cfg, [float(r) for r in disk_mb_s], float_dtype, float(shard_gb))
    print(format_plan(p), flush=True)
    engine = str(ctx.cfg.engine.name)
    if engine != "kdtree":                     # what the serve pipeline's launch stage would run on the host
        p["engine"] = {"name": engine, "command": engine_command(ctx.cfg)}
        print(f"\nengine={engine} command line (the serve pipeline's launch stage, on host {ctx.cfg.host.name}):\n"
              f"  {p['engine']['command']}", flush=True)
    (Path(ctx.run_dir) / "plan.json").write_text(json.dumps(p, indent=1))
    return {"per_rank_bytes": p["per_rank_bytes"], "files_total": p["files_total"],
            "kv_bytes_per_token": p["kv_cache"]["bytes_per_token"],
            "prefix_cache_bytes_per_token": p["prefix_cache"]["bytes_per_token"],
            "resident_after_load_bytes": [r["resident_after_load_bytes"] for r in p["ranks"]],
            **({"device_bytes_per_rank": [r["total_bytes"] for r in p["device"]["ranks"]],
                "device_fits": p["device"]["fits"]} if p.get("device") else {})}
