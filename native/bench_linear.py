"""Micro-benchmark of the multi-row CPU linear on memory-bound (K2-sized) weights: time of one call at T rows, the
weight bytes it streams per second, and its ratio to T = 1 (a forward of T rows should cost about one T = 1 step
while the weights are read once).

    .venv/bin/python native/bench_linear.py [--lib path/to/libkdtree_cpu.so] [--kind f32,w4] [--threads 1,2]
        [--shapes 18432x7168,2048x7168] [--T 1,2,5,9,17,33] [--reps 5]

Each call reads the next of several weight copies (> 2x the host's L3 in all: sysfs, at least 512 MiB), so every
call streams from memory. The kernel family follows the library's dispatch: KDTREE_CPU_ISA=avx2 keeps the AVX2
kernels on an AVX-512 host, KDTREE_CPU_GENERIC=1 the portable loops.
Best of --reps (the machine is shared: the minimum is the least disturbed run). With one thread the time is the
calling thread's CPU time (time.thread_time: what other processes' preemption does not add); with more, wall time.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from kdtree.backends import native
from kdtree.quant import int4



def l3_bytes() -> int:
    """the largest cache's size (sysfs), at least 256 MiB (a VM may report its host's share or nothing)"""
    best = 0
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        t = p.read_text().strip()
        best = max(best, int(t[:-1]) << {"K": 10, "M": 20, "G": 30}[t[-1]] if t[-1] in "KMG" else int(t))
    return max(best, 256 << 20)


L3_BYTES = l3_bytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="")
    ap.add_argument("--kind", default="f32")   # f32, bf16, w4
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default="18432x7168,2048x7168")   # n_out x n_in
    ap.add_argument("--T", default="1,2,5,9,17,33")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--resident", action="store_true",
                    help="one weight copy, read again and again (cache-resident when small): the compute-only time")
    a = ap.parse_args()
    lib = native.load_library("cpu", a.lib)
    rng = np.random.default_rng(0)
    Ts = [int(t) for t in a.T.split(",")]
    print(f"{'kind':4} {'shape':>11} {'thr':>3} {'T':>3} {'ms':>8} {'GB/s':>6} {'xT=1':>5}")
    for shape in a.shapes.split(","):
        n_out, n_in = (int(s) for s in shape.split("x"))
        for kind in a.kind.split(","):
            w0 = rng.standard_normal((n_out, n_in), dtype=np.float32)
            if kind == "f32":
                nbytes = w0.nbytes
            elif kind == "bf16":
                w16 = (w0.view(np.uint32) >> 16).astype(np.uint16)
                nbytes = w16.nbytes
            else:
                packed, scale, _ = int4.quantize_weight(w0, 32)
                scale = int4.bf16_to_f32(scale)
                nbytes = packed.nbytes + scale.nbytes
            copies = 1 if a.resident else max(1, -(-2 * L3_BYTES // nbytes) + (1 if nbytes < 4 * L3_BYTES else 0))
            if kind == "f32":
                ws = [w0] + [w0 + np.float32(i) for i in range(1, copies)]
                call = lambda x, i: lib.linear_f32(x, ws[i % copies])   # noqa: E731
            elif kind == "bf16":
                ws = [w16] + [w16.copy() for _ in range(1, copies)]
                call = lambda x, i: lib.linear_bf16(x, ws[i % copies])   # noqa: E731
            else:
                ps = [packed] + [packed.copy() for _ in range(1, copies)]
                ss = [scale] + [scale.copy() for _ in range(1, copies)]
                call = lambda x, i: lib.linear_w4a16(x, ps[i % copies], ss[i % copies], n_in, 32)  # noqa: E731
            del w0
            x = rng.standard_normal((max(Ts), n_in), dtype=np.float32)
            for thr in (int(t) for t in a.threads.split(",")):
                lib.set_threads(thr)
                base = None
                for T in Ts:
                    xt = np.ascontiguousarray(x[:T])
                    call(xt, 0)
                    best = float("inf")
                    clock = time.thread_time if thr == 1 else time.perf_counter
                    for r in range(a.reps * copies):
                        t0 = clock()
                        call(xt, r + 1)
                        best = min(best, clock() - t0)
                    base = base or best
                    print(f"{kind:4} {shape:>11} {thr:>3} {T:>3} {best * 1e3:8.2f} {nbytes / best / 1e9:6.1f} "
                          f"{best / base:5.2f}", flush=True)
            del call
    lib.set_threads(0)


if __name__ == "__main__":
    main()
