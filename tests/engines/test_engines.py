"""engine=sglang|vllm|llamacpp: the command lines the serve pipeline runs (golden argv against the engines'
documented CLIs, at model=k26 tp=8 quant=int4_w4a16), the compose-time errors for features an engine lacks,
`pipeline=plan engine=...` printing the command, and the life cycle of an SGLang-shaped stand-in (workers paging the
checkpoint in, the port closed until done) launched, watched (PROGRESSING with MB/s and ETA, then READY) and
stopped by the same pipelines as kdtree's own engine.

Run: .venv/bin/python -m pytest -q tests/engines/test_engines.py
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from kdtree.engines import command_line, printable
from tests.conftest import REPO, free_port
from tests.procs import alive
from tests.serve.served_engine import kdtree_run

K26 = ["model=k26", "tp='8'", "quant=int4_w4a16", "model.path=/models/Kimi-K2.6"]
STANDIN = Path(__file__).with_name("fake_sglang.py")


def test_sglang_command_line_at_k26_tp8_int4(compose_cfg):
    cfg = compose_cfg(*K26, "engine=sglang", "engine.python=/opt/sglang/bin/python", "tree=ddtree")
    assert command_line(cfg) == [
        "/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/Kimi-K2.6", "--tp-size", "8",
        "--host", "127.0.0.1", "--port", "30001", "--served-model-name", "k26", "--context-length", "262144",
        "--trust-remote-code", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/models/Kimi-K2.6/drafter", "--speculative-num-steps", "7",
        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "33"]
    ar = command_line(compose_cfg(*K26, "engine=sglang", "tree=ar", "serve.port=30009", "serve.model_name=kimi",
                                  "engine.extra_args=[--mem-fraction-static,'0.88']"))
    assert not any(a.startswith("--speculative") for a in ar)
    assert ar[-2:] == ["--mem-fraction-static", "0.88"] and ar[ar.index("--port") + 1] == "30009"
    assert ar[ar.index("--served-model-name") + 1] == "kimi" and ar[0] == sys.executable   # "": kdtree's Python


def test_vllm_command_line_at_k26_tp8_int4(compose_cfg):
    cfg = compose_cfg(*K26, "engine=vllm", "engine.python=/opt/vllm/bin/python", "tree=chain")
    argv = command_line(cfg)
    assert argv[:-2] == [
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/Kimi-K2.6",
        "--tensor-parallel-size", "8", "--host", "127.0.0.1", "--port", "30001", "--served-model-name", "k26",
        "--max-model-len", "262144", "--trust-remote-code"]
    assert argv[-2] == "--speculative-config"
    assert json.loads(argv[-1]) == {"method": "eagle3", "model": "/models/Kimi-K2.6/drafter",
                                    "num_speculative_tokens": 7}


def test_llamacpp_command_line(compose_cfg):
    cfg = compose_cfg("engine=llamacpp", "tree=ar", "engine.gguf=/tmp/tiny-f32.gguf", "backend.threads=2",
                      "serve.port=30002")
    assert command_line(cfg)[1:] == ["-m", "llama_cpp.server", "--model", "/tmp/tiny-f32.gguf", "--host", "127.0.0.1",
                                     "--port", "30002", "--model_alias", "tiny", "--n_ctx", "2048",
                                     "--interrupt_requests", "False", "--type_k", "0", "--type_v", "0",
                                     "--n_threads", "2"]


@pytest.mark.parametrize("overrides,match", [
    (["engine=vllm", "tree=ddtree"], r"engine=vllm drafts a chain.*tree.width=4.*use tree=chain"),
    (["engine=llamacpp", "tree=ddtree"], r"engine=llamacpp serves no draft model \(tree=ddtree\).*use tree=ar"),
    (["engine=llamacpp", "tree=ar", "tp=2"], r"engine=llamacpp has no tensor parallelism \(tp=2\)"),
    (["engine=sglang", "tree=ar", "serve.cors_origins=['http://a']"], r"engine=sglang has no CORS origins flag"),
    (["engine=nosuch"], r"engine=nosuch is not a known engine config; valid: kdtree, llamacpp, sglang, vllm"),
], ids=["vllm-tree", "llamacpp-tree", "llamacpp-tp", "sglang-cors", "unknown"])
def test_a_feature_the_engine_lacks_fails_at_compose_time(kdtree_cache, tmp_path, overrides, match):
    r = kdtree_run(["pipeline=plan", *overrides], kdtree_cache, tmp_path)
    assert r.returncode != 0
    assert re.search(match, r.stdout + r.stderr), r.stdout + r.stderr


def test_the_key_is_redacted_where_it_is_in_argv(compose_cfg):
    cfg = compose_cfg("engine=sglang", "tree=ar")
    argv = command_line(cfg, "s3cret")
    assert argv[-2:] == ["--api-key", "s3cret"] and "s3cret" not in printable(argv, "s3cret")


def test_plan_prints_the_exact_command_line(kdtree_cache, tmp_path, compose_cfg):
    cli = ["tp=8" if o.startswith("tp=") else o for o in K26]     # the command line's spelling
    r = kdtree_run(["pipeline=plan", *cli, "engine=sglang", "engine.python=/opt/sglang/bin/python"], kdtree_cache,
                   tmp_path)
    assert r.returncode == 0, r.stderr
    want = printable(command_line(compose_cfg(*K26, "engine=sglang", "engine.python=/opt/sglang/bin/python")))
    assert f"  {want}\n" in r.stdout


def test_sglang_shaped_stand_in_is_launched_watched_and_stopped(kdtree_cache, tmp_path):
    """serve engine=sglang with the stand-in as the command: PROGRESSING with a read rate and an ETA while its
    workers page the checkpoint in (port closed), then READY; pipeline=stop by port ends it and its process group."""
    port = free_port()
    biggest = max((p for p in (REPO / "kdtree" / "assets" / "tiny").rglob("*.safetensors")), key=lambda p: p.stat().st_size)
    common = [f"serve.port={port}", "engine=sglang", f"engine.command=[{sys.executable},{STANDIN}]"]
    run_dir = tmp_path / "serve"
    r = kdtree_run([*common, "tree=ar", "serve.detach=true", "serve.model_name=stand-in", "health.interval_s=0.5",
                    f"health.expected_bytes={biggest.stat().st_size}", f"hydra.run.dir={run_dir}"],
                   kdtree_cache, tmp_path, timeout=120, extra_env={"KDTREE_STANDIN_SECONDS": "4"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "launch engine=sglang: " in out and "sglang" not in out.split("launch engine=sglang: ")[1].split()[0]
    progressing = [line for line in out.splitlines() if " PROGRESSING " in line]
    assert progressing and any("MB/s" in line for line in progressing[:3]), out
    assert re.search(r"READY: completion answered", out), out
    stop_by_port(run_dir, port, kdtree_cache, tmp_path)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    launch = next(e for e in events if e.get("kind") == "engine_command")
    assert str(STANDIN) in launch["command"] and f"--port {port}" in launch["command"]


def test_llamacpp_serves_the_exported_gguf_and_stops(kdtree_cache, tmp_path):
    """engine=llamacpp (the peer extra): the launch stage exports the tiny model's GGUF into <cache_dir>/gguf (once:
    reused by later launches), starts llama.cpp's OpenAI server on it, health_poll watches it to READY, pipeline=stop
    ends it."""
    pytest.importorskip("llama_cpp.server.app",
                        reason="llama-cpp-python[server] not installed (pip install -e '.[peer]')")
    port = free_port()
    run_dir = tmp_path / "serve"
    r = kdtree_run([f"serve.port={port}", "engine=llamacpp", "tree=ar", "serve.detach=true", "health.interval_s=0.5",
                    f"hydra.run.dir={run_dir}"], kdtree_cache, tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "READY: completion answered" in r.stdout and list((kdtree_cache / "gguf").glob("tiny-*-f32.gguf"))
    assert not list(run_dir.glob("*.gguf"))
    stop_by_port(run_dir, port, kdtree_cache, tmp_path)


def stop_by_port(run_dir, port, kdtree_cache, tmp_path):
    """pipeline=stop by port reports the engine terminated, and its pid (from the run dir) is gone within 10 s."""
    pid = int((run_dir / "engine.pid").read_text())
    assert alive(pid)
    s = kdtree_run(["pipeline=stop", f"serve.port={port}"], kdtree_cache, tmp_path, timeout=60)
    assert s.returncode == 0 and "terminated" in s.stdout, s.stdout + s.stderr
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)
