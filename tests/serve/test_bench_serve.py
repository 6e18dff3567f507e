"""pipeline=bench_serve end to end, small: the real server process, 1 and 3 concurrent streaming clients, then the
server stopped; bench_serve.json holds every figure of every round, every answer equals its solo answer, and the
plot is written; the shared-prefix workload measures TTFT and tokens/s with the prefix cache off and on (same answers).

Run: .venv/bin/python -m pytest -q tests/serve/test_bench_serve.py
"""
from __future__ import annotations

import json

from served_engine import TREE, kdtree_run
from tests.procs import alive


def test_bench_serve_writes_its_figures_and_stops_the_server(tmp_path, kdtree_cache):
    run_dir = tmp_path / "runs" / "bench"
    r = kdtree_run(["pipeline=bench_serve", "serve.port=0", f"hydra.run.dir={run_dir}", *TREE,
                    "bench_serve.clients=[1,3]", "bench_serve.requests=1", "bench_serve.max_tokens=8",
                    "bench_serve.long_tokens=60", "bench_serve.shared_prefix_tokens=300",
                    "bench_serve.shared_prefix_clients=3", "bench_serve.shared_prefix_requests=3"],
                   kdtree_cache, tmp_path / "runs", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    out = json.loads((run_dir / "bench_serve.json").read_text())
    assert [x["clients"] for x in out["rounds"]] == [1, 3] and out["exact"] is True
    for x in out["rounds"]:
        assert x["requests"] == x["clients"] and x["output_tokens"] == 8 * x["clients"]
        assert x["tokens_per_s"] > 0 and 0 < x["ttft_p50_s"] <= x["ttft_p95_s"] and x["tpot_p50_s"] > 0
    assert out["scaling"]["1"] == 1.0 and out["short_latency_ratio"] > 0
    assert (run_dir / "bench_serve.png").stat().st_size > 1000
    # the shared-prefix workload: one server, the prefix cache off then on (POST /prefix_cache), the same answers
    sp = out["shared_prefix"]
    assert sp["exact"] is True and sp["shared_prefix_chars"] == 300 and sp["clients"] == 3 and sp["requests"] == 3
    assert sp["off"]["cached_tokens_p50"] == 0 and sp["on"]["cached_tokens_p50"] >= 288     # >= 18 whole pages
    assert sp["on"]["prompt_tokens_p50"] == sp["off"]["prompt_tokens_p50"] > 300
    for mode in ("off", "on"):
        assert sp[mode]["ttft_p50_s"] > 0 and sp[mode]["tokens_per_s"] > 0 and sp[mode]["ttft_p50_s_concurrent"] > 0
    assert sp["ttft_speedup"] > 0
    assert not alive(int((run_dir / "engine.pid").read_text()))      # the pipeline ended with the server
