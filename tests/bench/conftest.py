"""Bandwidth beside time for the benchmark suites (llm.c dev/cuda style), printed after pytest-benchmark's tables.

A benchmark that sets extra_info["bytes"] (bytes one call moves) gets MB, GB/s (bytes / min time) and, when the run
measured a roof (a benchmark with extra_info["roof"], e.g. test_native_bench.py::test_memory_roof), the share of it;
extra_info["baseline"] names the implementation of its group the row is compared with (speedup = baseline / row).
"""
from __future__ import annotations

import re


def _impl(name: str) -> str:
    """test_gemv[4096x4096-native_w4a16-1] -> the parameter that names the implementation."""
    params = re.search(r"\[(.*)\]", name)
    return next((p for p in (params.group(1).split("-") if params else []) if not p.replace("x", "").isdigit()), name)


def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    done = [b for b in (session.benchmarks if session else [])
            if b and ("bytes" in b.extra_info or "baseline" in b.extra_info)]
    if not done:
        return
    roofs = [b.extra_info["bytes"] / b.stats.min / 1e9 for b in done if b.extra_info.get("roof")]
    roof = max(roofs) if roofs else None
    w = terminalreporter.write_line
    w("")
    w("bandwidth and speedups (min times)" + (f"; roof = numpy copy {roof:.1f} GB/s (read + write)" if roof else ""))
    w(f"{'group':44} {'impl':14} {'min ms':>9} {'MB':>8} {'GB/s':>7} {'%roof':>6} {'speedup':>8}  vs")
    groups = {}
    for b in done:
        groups.setdefault(b.group, []).append(b)
    for group, rows in groups.items():
        base = {_impl(b.name): b.stats.min for b in rows}
        for b in rows:
            mb = b.extra_info.get("bytes")
            gbs = mb / b.stats.min / 1e9 if mb else None
            name = b.extra_info.get("baseline", "")
            speed = base[name] / b.stats.min if name in base else None
            w(f"{group:44} {_impl(b.name):14} {b.stats.min * 1e3:9.3f} "
              + (f"{mb / 1e6:8.1f} {gbs:7.1f} " if mb else f"{'':8} {'':7} ")
              + (f"{100 * gbs / roof:5.0f}% " if mb and roof else f"{'':6} ")
              + (f"{speed:8.2f}  {name}" if speed else ""))
