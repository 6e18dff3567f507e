"""A/B of two builds of the CPU library in ONE process, calls alternating, so both see the same state of a shared
host (this project's VMs change their memory speed for seconds at a time: runs minutes apart differ by 15-20 %).

    # one linear of T rows on 64-byte aligned weight copies (> 1 GB in all: every call streams from memory),
    # best of --reps alternations; `roof` = kd_roof_read over the same copies
    .venv/bin/python native/bench_ab.py linear --libs /tmp/old.so,native/build/libkdtree_cpu.so \
        [--shapes 2048x7168,7168x2048] [--kind f32,bf16,int4] [--T 1,2,4,9] [--threads 2]
    # (int4: K2.6's experts, group 32 with BF16 scales; GB/s counts the packed words, not the scales)
    # one tiny_wide target forward of T rows after a 64-token context: one engine per library on the same mapped
    # checkpoint (the page cache holds the weights once), forwards alternating; the logits must be equal
    .venv/bin/python native/bench_ab.py forward --libs /tmp/old.so,native/build/libkdtree_cpu.so \
        [--quant bf16] [--T 1,8,9,17] [--threads 2]

Build the other library from a commit with e.g. `git worktree add /tmp/old <commit> && make -C /tmp/old/native`.
The first library is the baseline: `ratio` = its time over the last one's (> 1: the last is faster).
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List

import numpy as np

from kdtree.aligned import aligned_copy
from kdtree.backends import native
from kdtree.quant import int4


def _alternate(calls: Dict[str, Callable[[int], object]], reps: int, per: int) -> Dict[str, float]:
    """best seconds of each call over `reps` rounds of `per` calls each, the calls taking turns round by round"""
    best = {name: float("inf") for name in calls}
    i = 0
    for _ in range(reps):
        for name, fn in calls.items():
            for _ in range(per):
                t0 = time.perf_counter()
                fn(i)
                best[name] = min(best[name], time.perf_counter() - t0)
                i += 1
    return best


def linear(a) -> None:
    libs = {path: native.load_library("cpu", path) for path in a.libs.split(",")}
    for lib in libs.values():
        lib.set_threads(a.threads)
    base = next(iter(libs.values()))
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        n_out, n_in = (int(s) for s in shape.split("x"))
        w0 = rng.standard_normal((n_out, n_in), dtype=np.float32)
        for kind in a.kind.split(","):
            if kind == "int4":   # K2.6's experts: group 32, BF16 scales; a copy is (packed, scales)
                packed, scale, _ = int4.quantize_weight(w0, 32)
                w = packed
                copies = [(aligned_copy(packed), aligned_copy(scale))
                          for _ in range(max(4, int(1.2e9 // (packed.nbytes + scale.nbytes))))]
            else:
                w = w0 if kind == "f32" else (w0.view(np.uint32) >> 16).astype(np.uint16)
                copies = [aligned_copy(w) for _ in range(max(4, int(1.2e9 // w.nbytes)))]
            for T in (int(t) for t in a.T.split(",")):
                x = rng.standard_normal((T, n_in), dtype=np.float32)
                calls: Dict[str, Callable[[int], object]] = {}
                for path, lib in libs.items():
                    if kind == "int4":
                        calls[path] = lambda i, lib=lib: lib.linear_w4a16(x, *copies[i % len(copies)], n_in, 32)
                        continue
                    f = lib.linear_f32 if kind == "f32" else lib.linear_bf16
                    calls[path] = lambda i, f=f: f(x, copies[i % len(copies)])
                calls["roof"] = lambda i: base.c.kd_roof_read(
                    base.ffi.cast("float *", (copies[i % len(copies)][0] if kind == "int4" else
                                              copies[i % len(copies)]).ctypes.data), w.nbytes // 4, a.threads)
                best = _alternate(calls, a.reps, len(copies))
                names = list(libs)
                print(f"{kind} {shape} threads {a.threads} T {T}: " + "  ".join(
                    f"{n.split('/')[-1]} {s * 1e3:.2f} ms ({w.nbytes / s / 1e9:.1f} GB/s)" for n, s in best.items())
                    + f"  ratio {best[names[0]] / best[names[-1]]:.3f}x", flush=True)


def forward(a) -> None:
    from hydra import compose, initialize_config_dir

    from kdtree.engine import Engine
    from kdtree.pipeline.registry import register_schema
    from kdtree.stages.bench import load_prompts
    from pathlib import Path

    register_schema()
    conf_dir = str(Path(__file__).resolve().parents[1] / "conf")
    paths = a.libs.split(",")
    engines = []
    for path in paths:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                f"model={a.model}", "backend=cpu", "tree=ar", f"quant={a.quant}", f"backend.library={path}",
                "load.progress=false"])
        engines.append(Engine.from_config(cfg))
        engines[-1].model.lib.set_threads(a.threads)
    ids: List[int] = []
    for text in load_prompts(""):
        ids += engines[0].tokenizer.encode(text)
    ctx, Ts = 64, [int(t) for t in a.T.split(",")]
    caches = []
    for e in engines:
        cache = e.model.new_cache(ctx + max(Ts) + 1)
        e.model.forward(np.asarray(ids[:ctx], np.int32), np.arange(ctx, dtype=np.int32), cache)
        caches.append(cache)
    for T in Ts:
        tokens = np.asarray(ids[ctx:ctx + T], np.int32)
        positions = np.arange(ctx, ctx + T, dtype=np.int32)
        logits: Dict[str, np.ndarray] = {}

        def call(path, e, cache):
            def run(_i):
                logits[path], _ = e.model.forward(tokens, positions, cache)
                cache.truncate(ctx)
            return run
        best = _alternate({p: call(p, e, c) for p, e, c in zip(paths, engines, caches)}, a.reps, 1)
        equal = all(np.array_equal(logits[paths[0]], logits[p]) for p in paths[1:])
        print(f"{a.model} {a.quant} threads {a.threads} T {T}: " + "  ".join(
            f"{p.split('/')[-1]} {s * 1e3:.1f} ms" for p, s in best.items())
            + f"  ratio {best[paths[0]] / best[paths[-1]]:.3f}x  logits_equal={equal}", flush=True)
        if not equal:
            raise SystemExit(f"T={T}: the libraries' logits differ -- a kernel change moved bits")
    for e in engines:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("linear", "forward"))
    ap.add_argument("--libs", required=True, help="comma-separated library paths; the first is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--T", default="1,2,4,9")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--shapes", default="2048x7168,7168x2048")   # linear: n_out x n_in
    ap.add_argument("--kind", default="f32,bf16")                # linear: weight dtype (f32, bf16, int4)
    ap.add_argument("--model", default="tiny_wide")              # forward
    ap.add_argument("--quant", default="bf16")                   # forward
    a = ap.parse_args()
    if len(a.libs.split(",")) < 2:
        raise SystemExit(f"--libs={a.libs!r}: give two or more library paths, comma-separated (baseline first)")
    (linear if a.what == "linear" else forward)(a)


if __name__ == "__main__":
    main()
