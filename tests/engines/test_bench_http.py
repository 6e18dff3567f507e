"""Benchmarks over HTTP against any engine: pipeline=bench_http (single stream: tokens/s, TTFT, TPOT) and
pipeline=bench_serve with a second engine beside (`against=`), one table with a tokens-equal column, against real
server processes: kdtree vs kdtree here (both greedy on the same tiny weights: every prompt equal), and llama.cpp
vs kdtree where llama-cpp-python is installed (the peer extra).

Run: .venv/bin/python -m pytest -q tests/engines/test_bench_http.py
"""
from __future__ import annotations

import json
import re

import pytest

from tests.procs import alive
from tests.serve.served_engine import TREE, kdtree_run

PROMPTS = 6                                      # kdtree/assets/bench_prompts.json


def _stopped(run_dir):
    for pid_file in [run_dir / "engine.pid", *run_dir.glob("against-*/engine.pid")]:
        assert not alive(int(pid_file.read_text())), pid_file


def test_bench_http_kdtree_beside_kdtree(tmp_path, kdtree_cache):
    run_dir = tmp_path / "runs" / "http"
    r = kdtree_run(["pipeline=bench_http", "serve.port=0", f"hydra.run.dir={run_dir}", *TREE, "serve.demo_tokens=0",
                    "bench_http.max_tokens=8", "bench_http.repeats=1", "bench_http.against=kdtree"],
                   kdtree_cache, tmp_path / "runs", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    out = json.loads((run_dir / "bench_http.json").read_text())
    assert [x["engine"] for x in out["rows"]] == ["kdtree", "kdtree"]
    for x in out["rows"]:
        assert len(x["prompts"]) == PROMPTS and x["output_tokens"] == 8 * PROMPTS
        assert x["tokens_per_s"] > 0 and x["ttft_p50_s"] > 0 and x["tpot_p50_s"] > 0
        assert x["tokens_equal"] == f"{PROMPTS}/{PROMPTS}"
    assert out["rows"][0]["url"] != out["rows"][1]["url"]
    assert re.search(r"engine +tok/s +TTFT p50 s +TPOT p50 s +tokens +tokens-equal\n( *kdtree .* 6/6\n?){2}",
                     r.stdout), r.stdout
    _stopped(run_dir)


def test_bench_serve_one_table_with_a_second_engine(tmp_path, kdtree_cache):
    run_dir = tmp_path / "runs" / "serve"
    r = kdtree_run(["pipeline=bench_serve", "serve.port=0", f"hydra.run.dir={run_dir}", *TREE, "serve.demo_tokens=0",
                    "bench_serve.clients=[1,2]", "bench_serve.requests=1", "bench_serve.max_tokens=8",
                    "bench_serve.long_tokens=30", "bench_serve.against=kdtree"],
                   kdtree_cache, tmp_path / "runs", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    out = json.loads((run_dir / "bench_serve.json").read_text())
    other = out["compare"]
    assert other["engine"] == "kdtree" and other["tokens_equal"] == f"{PROMPTS}/{PROMPTS}"
    assert [x["clients"] for x in other["rounds"]] == [1, 2] and all(x["exact"] for x in other["rounds"])
    assert all(x["output_tokens"] == 8 * x["clients"] for x in other["rounds"])
    table = r.stdout.split("side by side (greedy, the same prompts):\n")[1].splitlines()[:5]
    assert table[0].split()[:3] == ["engine", "N", "tok/s"] and table[0].endswith("tokens-equal")
    assert [row.split()[:2] for row in table[1:]] == [["kdtree", "1"], ["kdtree", "2"]] * 2, table
    assert all(row.endswith("6/6") for row in table[1:])
    assert (run_dir / "bench_serve.png").stat().st_size > 1000
    _stopped(run_dir)


@pytest.mark.parametrize("pipeline", ["bench_http", "bench_serve"])
def test_llamacpp_beside_kdtree(tmp_path, kdtree_cache, pipeline):
    """engine=llamacpp (the tiny model exported to GGUF) with kdtree beside it, greedy on the same weights: one
    table, the tokens-equal column counted."""
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] not installed (pip install -e "
                                                       "'.[peer]'; it compiles llama.cpp, ~15 min)")
    from tests.conftest import free_port
    run_dir = tmp_path / "runs" / "peer"
    small = {"bench_http": ["bench_http.max_tokens=48", "bench_http.repeats=1"],
             "bench_serve": ["bench_serve.clients=[1,2]", "bench_serve.requests=1", "bench_serve.max_tokens=48",
                             "bench_serve.long_tokens=30"]}[pipeline]
    r = kdtree_run([f"pipeline={pipeline}", "engine=llamacpp", "tree=ar", f"serve.port={free_port()}",
                    f"hydra.run.dir={run_dir}", "health.interval_s=0.5", *small, f"{pipeline}.against=kdtree"],
                   kdtree_cache, tmp_path / "runs", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    out = json.loads((run_dir / f"{pipeline}.json").read_text())
    if pipeline == "bench_http":
        assert [x["engine"] for x in out["rows"]] == ["llamacpp", "kdtree"]
        assert all(x["tokens_per_s"] > 0 for x in out["rows"])
        equal = out["rows"][0]["tokens_equal"]
    else:
        assert out["engine"] == "llamacpp" and out["compare"]["engine"] == "kdtree"
        equal = out["compare"]["tokens_equal"]
        # two clients at once: llama.cpp queues the second (--interrupt_requests False), never cuts the first short
        assert all(x["exact"] for x in out["rounds"]), out["rounds"]
    # greedy on the same F32 weights, 48 tokens: the same text (F32 KV cache, repeat_penalty 1.0 sent to llama.cpp)
    assert equal == f"{PROMPTS}/{PROMPTS}", equal
    print(r.stdout.split(f"[{pipeline}] ")[-2])
    _stopped(run_dir)
