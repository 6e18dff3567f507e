"""bench_forward: the cost of ONE target forward of T rows at a fixed context, against this host's two roofs.

    python -m kdtree.run pipeline=bench_forward model=tiny_wide backend=cpu
    python -m kdtree.run pipeline=bench_forward bench_forward.rows=[1,2,9] bench_forward.threads=[2]

Decoding a memory-bound MoE streams the active weights once per forward: a forward of T rows (a tree verify, a
batch, a prefill chunk) should cost about one single-row step until its arithmetic catches up. For each thread count
and each T this measures the best of `repeats` forwards of T causal rows after a `context`-token prefill (real text:
the bench prompts, so the rows route as text does), and puts it next to its roofline time

    max(bytes / read roof, FLOPs / FMA roof)

where bytes = every linear the forward reads (the dense layers, attention, shared experts, routers, lm_head: as the
backend holds them, NativeTarget.weight_bytes) + the routed experts the T rows chose (the union per MoE layer, counted
by the forward itself: Target.moe_stats) + the latent cache rows it reads; FLOPs = 2 x T x (the multiply-adds of those
weights) (attention over the context is counted too). The roofs are measured in the same run with the same threads:
the faster of two streaming reads (kd_roof_read: a fresh `roof_mb` MB buffer, and the weights the forward itself
reads, where they outgrow the caches) and independent FMAs on registers (kd_roof_fma); each point also reads the
weights before each of its forwards, and its read roof is the fastest of those reads and the run's (a VM's memory
can change speed for seconds at a time: a roof read minutes earlier made one-row forwards "beat" it by 1.24x).
Each row also sums every matrix's own roofline (`op_roofline_s`, its share `op_roofline_share`): max(bytes, FLOPs) of
the whole forward lets a compute-bound dense layer hide behind memory-bound experts, which a forward running its
matrices one after another cannot do, so this per-matrix bound is the tighter (and op_roofline_share >= roofline_share).
When the held weights stream below 0.85 of a fresh buffer, a note line says so, with how many of their MB are mapped
in 2 MB pages and what to change (mmap'd page cache in small folios: load.strategy=eager).
Writes bench_forward.json (a row per (threads, T): seconds, ratio to T=1, bytes, GB/s, FLOPs, GFLOP/s, roofline
seconds, share of the roofline, the per-matrix roofline and its share, mean distinct experts per MoE layer) and
bench_forward.png (cost vs T).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kdtree.backends import native
from kdtree.engine import Engine, EngineState
from kdtree.stages.bench import load_prompts, provenance

SIDE = "host"


@dataclass
class BenchForwardConfig:
    rows: List[int] = field(default_factory=lambda: [1, 2, 5, 9, 17, 33, 65])  # T: rows of one forward
    threads: List[int] = field(default_factory=lambda: [1, 2])  # native threads per curve (kd_set_threads)
    context: int = 64  # tokens already in the latent cache before each forward
    repeats: int = 3  # forwards per point; the fastest is kept
    roof_mb: int = 1024  # bytes of the streaming-read roof (far beyond the caches)


CONFIG = BenchForwardConfig  # cfg.bench_forward: this stage's options (kdtree/pipeline/registry.py)


WEIGHT_ROOF_MIN_MB = 64   # the forward's own pages make the read roof only where they are more than the caches hold


def roofs(lib, threads: int, roof_mb: int, repeats: int = 3, arrays: Sequence[np.ndarray] = ()) -> Dict[str, Any]:
    """{read_gb_s, read_buffer_gb_s, read_weights_gb_s, fma_gflop_s} of this host with `threads` threads: best of
    `repeats`. Two streaming reads: a fresh `roof_mb` MB buffer, and `arrays` (the weights the forward reads, each
    array of >= 1 MiB; skipped below WEIGHT_ROOF_MIN_MB in all). read_gb_s, the roof, is the faster of the two: a
    roof a forward can beat is none, and on a VM one fresh buffer's pages may stream at a third of the rate of the
    weights' (measured on a Zen 4 guest: 12.8 vs 33 GB/s on one thread, while a T=1 forward read 17.9)."""
    buf = np.ones(max(1, roof_mb) * (1 << 20) // 4, np.float32)
    ptr = lib.ffi.cast("float *", buf.ctypes.data)
    lib.c.kd_roof_read(ptr, buf.size, threads)                     # pages touched before timing
    read = min(_timed(lambda: lib.c.kd_roof_read(ptr, buf.size, threads)) for _ in range(repeats))
    del buf
    sweep = weights_reader(lib, arrays, threads)
    weights = max(sweep() for _ in range(repeats)) if sweep else None
    iters = 20_000_000
    chains = int(getattr(lib.c, "KD_ROOF_CHAINS", 12))
    fma = min(_timed(lambda: lib.c.kd_roof_fma(iters, threads)) for _ in range(repeats))
    read_buffer = max(1, roof_mb) * (1 << 20) / read / 1e9
    return {"read_gb_s": max(read_buffer, weights or 0.0), "read_buffer_gb_s": read_buffer,
            "read_weights_gb_s": weights, "fma_gflop_s": threads * iters * chains * 16 / fma / 1e9}


def weights_reader(lib, arrays: Sequence[np.ndarray], threads: int) -> Optional[Callable[[], float]]:
    """A function that streams `arrays` (those of >= 1 MiB) once with `threads` threads and returns the GB/s; None
    below WEIGHT_ROOF_MIN_MB in all (they would be read from the caches)."""
    big = [a for a in arrays if a.nbytes >= (1 << 20)]
    total = sum(a.nbytes for a in big)
    if total < WEIGHT_ROOF_MIN_MB << 20:
        return None
    ptrs = [(lib.ffi.cast("float *", a.ctypes.data), a.nbytes // 4) for a in big]

    def sweep() -> float:
        t0 = time.perf_counter()
        for p, n in ptrs:
            lib.c.kd_roof_read(p, n, threads)
        return total / (time.perf_counter() - t0) / 1e9
    return sweep


def _read_from(r: Dict[str, Any]) -> str:
    """which streaming read set the roof, and the other's rate"""
    b, w = r["read_buffer_gb_s"], r["read_weights_gb_s"]
    if w is None:
        return "fresh buffer; weights too small to stream"
    return f"weights; fresh buffer {b:.1f}" if w >= b else f"fresh buffer; weights {w:.1f}"


WEIGHTS_SLOW = 0.85  # held weights streaming below this share of a fresh buffer: say why and what helps


def _huge_mapped_mb(path: str = "/proc/self/smaps_rollup") -> Dict[str, int]:
    """This process's memory mapped in 2 MB pages: {"file": page cache (FilePmdMapped), "anon": AnonHugePages}, MB."""
    out = {"file": 0, "anon": 0}
    try:
        for line in open(path):
            key, _, rest = line.partition(":")
            if key in ("FilePmdMapped", "AnonHugePages"):
                out["file" if key == "FilePmdMapped" else "anon"] = int(rest.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def weights_hint(roof: Dict[int, Dict[str, Any]], strategy: str, huge: Dict[str, int], held_mb: float) -> str:
    """One line when the held weights stream well below a fresh buffer (else ""): mmap'd weights are page-cache
    pages, mapped in 2 MB pages only where the page cache holds whole 2 MB folios; after memory pressure re-reads
    them in small folios, a one-row forward ran 1.17-1.37x slower than over copies (docs/measurements.md, 11th
    session). load.strategy=eager copies them into anonymous memory (huge pages)."""
    slow = {th: r["read_weights_gb_s"] / r["read_buffer_gb_s"] for th, r in roof.items()
            if r.get("read_weights_gb_s") and r.get("read_buffer_gb_s")}
    if not slow or min(slow.values()) >= WEIGHTS_SLOW:
        return ""
    th, share = min(slow.items(), key=lambda kv: kv[1])
    if strategy == "mmap":
        where = (f"load.strategy=mmap: page-cache pages, {huge['file']} of {held_mb:.0f} MB mapped in 2 MB pages; "
                 f"load.strategy=eager copies them into anonymous memory")
    else:
        where = (f"load.strategy={strategy}: {huge['anon']} of {held_mb:.0f} MB in 2 MB pages; transparent huge "
                 f"pages need 'madvise' or 'always' in /sys/kernel/mm/transparent_hugepage/enabled")
    return (f"note: the held weights stream at {share:.2f} of a fresh buffer's rate ({th} thr), so every forward "
            f"here is slower than this host allows ({where})")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _text_ids(engine, need: int) -> List[int]:
    ids: List[int] = []
    for text in load_prompts(""):
        ids += engine.tokenizer.encode(text)
    while len(ids) < need:
        ids = ids + ids
    return ids[:need]


def forward_cost(cfg, weight_bytes: Dict[str, Tuple[int, int]], experts: Dict[int, Dict[str, int]], T: int,
                 context: int) -> Dict[str, Any]:
    """bytes and FLOPs of one forward of T rows after `context` rows: the linears it reads (routed experts: the
    union its rows chose, per MoE layer, from the forward's own counters), the latent rows it attends to."""
    E, k = int(cfg.n_routed_experts or 0), int(cfg.num_experts_per_tok or 0)
    dense_b = dense_e = 0
    expert_b: Dict[int, float] = {}
    expert_e: Dict[int, float] = {}
    ops: List[Tuple[float, float]] = []              # (bytes, FLOPs) of each matrix the forward reads
    for name, (b, n) in weight_bytes.items():
        if ".mlp.experts." in name:                   # model.layers.L.mlp.experts.e.*: per-expert averages
            layer = int(name.split(".")[2])
            expert_b[layer] = expert_b.get(layer, 0.0) + b / E
            expert_e[layer] = expert_e.get(layer, 0.0) + n / E
        else:
            dense_b, dense_e = dense_b + b, dense_e + n
            ops.append((float(b), 2.0 * T * n))
    union = {layer: st["experts"] / max(st["forwards"], 1) for layer, st in experts.items()}
    routed_b = sum(expert_b.get(layer, 0.0) * u for layer, u in union.items())
    for layer, u in union.items():   # u experts, each T * k / u rows: together max(u bytes, all the rows' FLOPs)
        ops.append((expert_b.get(layer, 0.0) * u, 2.0 * T * k * expert_e.get(layer, 0.0)))
    width = int(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    layers = int(cfg.num_hidden_layers)
    kv_b = layers * (context + T) * width * 4
    attn_macs = layers * int(cfg.num_attention_heads) * (context + T) * (width + int(cfg.kv_lora_rank))
    ops.append((float(kv_b), 2.0 * T * attn_macs))
    flops = 2.0 * T * (dense_e + k * sum(expert_e.values()) + attn_macs)
    return {"bytes": dense_b + routed_b + kv_b, "dense_bytes": dense_b, "expert_bytes": routed_b, "kv_bytes": kv_b,
            "flops": flops, "experts_per_layer": union, "op_costs": ops}


def _curve(engine, conf: BenchForwardConfig, threads: int,
           sweep: Optional[Callable[[], float]] = None) -> List[dict]:
    """Each point: `repeats` times a read of the weights (sweep: the roof at that moment -- this VM's memory runs at
    ~33 or ~46-57 GB/s for seconds at a time) then the forward; the fastest of each."""
    target, cfg = engine.model, engine.cfg.model
    weight_bytes = target.weight_bytes()
    ids = _text_ids(engine, conf.context + max(conf.rows))
    cache = target.new_cache(conf.context + max(conf.rows) + 1)
    target.forward(np.asarray(ids[:conf.context], np.int32), np.arange(conf.context, dtype=np.int32), cache)
    rows = []
    for T in conf.rows:
        tokens = np.asarray(ids[conf.context:conf.context + T], np.int32)
        positions = np.arange(conf.context, conf.context + T, dtype=np.int32)
        best, near = float("inf"), 0.0
        target.moe_stats(reset=True)
        for _ in range(max(1, conf.repeats)):
            near = max(near, sweep()) if sweep else near
            t0 = time.perf_counter()
            target.forward(tokens, positions, cache)
            best = min(best, time.perf_counter() - t0)
            cache.truncate(conf.context)
        cost = forward_cost(cfg, weight_bytes, target.moe_stats(reset=True), T, conf.context)
        rows.append({"threads": threads, "rows": T, "seconds": best, "read_near_gb_s": near or None, **cost})
    return rows


def _table(rows: List[dict], roof: Dict[int, Dict[str, float]]) -> List[dict]:
    base = {r["threads"]: r["seconds"] for r in rows if r["rows"] == min(x["rows"] for x in rows)}
    for r in rows:
        rf = roof[r["threads"]]
        read = r["read_gb_s"] = max(rf["read_gb_s"], r.get("read_near_gb_s") or 0.0)   # the faster: a roof
        r["ratio_to_t1"] = r["seconds"] / base[r["threads"]]
        r["gb_s"] = r["bytes"] / r["seconds"] / 1e9
        r["gflop_s"] = r["flops"] / r["seconds"] / 1e9
        r["roofline_s"] = max(r["bytes"] / (read * 1e9), r["flops"] / (rf["fma_gflop_s"] * 1e9))
        r["bound"] = "memory" if r["bytes"] / read >= r["flops"] / rf["fma_gflop_s"] else "compute"
        r["roofline_share"] = r["roofline_s"] / r["seconds"]
        # each matrix against its own roofline, summed: a forward whose dense layers are compute-bound and whose
        # experts are memory-bound cannot reach the whole forward's max(bytes, FLOPs) without overlapping them
        ops = r.pop("op_costs", None) or []
        r["op_roofline_s"] = sum(max(b / (read * 1e9), f / (rf["fma_gflop_s"] * 1e9)) for b, f in ops) or None
        r["op_roofline_share"] = r["op_roofline_s"] / r["seconds"] if r["op_roofline_s"] else None
    return rows


def plot(rows: List[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for th in sorted({r["threads"] for r in rows}):
        pts = [r for r in rows if r["threads"] == th]
        ax.plot([r["rows"] for r in pts], [r["ratio_to_t1"] for r in pts], "o-", label=f"measured, {th} thr")
        t1 = pts[0]["seconds"]
        ax.plot([r["rows"] for r in pts], [r["roofline_s"] / t1 for r in pts], "--", label=f"roofline, {th} thr")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows T of one forward")
    ax.set_ylabel("seconds / seconds of T=1")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(ctx, conf: BenchForwardConfig) -> dict:
    cfg = ctx.cfg
    state = EngineState.of(ctx)
    if state.engine is None:
        state.engine = Engine.from_config(cfg, status=ctx.status)
    engine = state.engine
    target = engine.model
    # backend=cpu and the options: kdtree.config.validate.validate_bench_forward, at start-up
    lib = target.lib
    rows, roof = [], {}
    before = lib.c.kd_threads()
    try:
        for th in conf.threads:
            native.set_loaded_threads(int(th))
            roof[int(th)] = roofs(lib, int(th), conf.roof_mb, arrays=target.held_arrays())
            rows += _curve(engine, conf, int(th), weights_reader(lib, target.held_arrays(), int(th)))
    finally:
        native.set_loaded_threads(int(before))
    rows = _table(rows, roof)
    held_mb = sum(a.nbytes for a in target.held_arrays()) / 1e6
    huge = _huge_mapped_mb()
    hint = weights_hint(roof, str(cfg.load.strategy), huge, held_mb)
    out = {"model": cfg.model.name, "quant": cfg.quant.method, "backend": cfg.backend.name, "context": conf.context,
           "roofs": {str(k): v for k, v in roof.items()}, "load_strategy": str(cfg.load.strategy),
           "huge_mapped_mb": huge, "held_weights_mb": held_mb, "weights_hint": hint, "rows": rows,
           "provenance": provenance(ctx)}
    (ctx.run_dir / "bench_forward.json").write_text(json.dumps(out, indent=2))
    plot(rows, ctx.run_dir / "bench_forward.png", f"{cfg.model.name} {cfg.quant.method}: one forward of T rows")
    print(f"bench_forward {cfg.model.name} {cfg.quant.method} context={conf.context}: roofs "
          + ", ".join(f"{th} thr {r['read_gb_s']:.1f} GB/s read ({_read_from(r)}), {r['fma_gflop_s']:.0f} GFLOP/s FMA"
                      for th, r in roof.items()))
    if hint:
        print(hint)
    print("| threads | T | seconds | x T=1 | MB streamed | GB/s | read roof GB/s | GFLOP/s | bound | roofline share "
          "| per-matrix roofline share | experts/layer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ex = np.mean(list(r["experts_per_layer"].values())) if r["experts_per_layer"] else 0.0
        print(f"| {r['threads']} | {r['rows']} | {r['seconds']:.4f} | {r['ratio_to_t1']:.2f} | {r['bytes'] / 1e6:.0f} "
              f"| {r['gb_s']:.1f} | {r['read_gb_s']:.1f} | {r['gflop_s']:.1f} | {r['bound']} "
              f"| {r['roofline_share']:.2f} | {r['op_roofline_share'] or 0.0:.2f} | {ex:.2f} |")
    print(f"-> {ctx.run_dir / 'bench_forward.json'}")
    worst = min(r["roofline_share"] for r in rows if r["rows"] <= 33)
    return {"worst_roofline_share_t33": worst}
