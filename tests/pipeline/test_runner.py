"""The runner end to end: events.jsonl, failures naming the stage, timeouts, one engine process per host group
(locally and through the fixture sshd), detach + stop, Ctrl-C. Real processes, no mocks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdtree.pipeline.events import read_events
from kdtree.pipeline.runner import run_pipeline

REPO = Path(__file__).resolve().parents[2]

# a host stage that runs until stopped (fail after 60 s), then a controller stage: the engine keeps running
LONG_ENGINE = ("name: long\nstages:\n  - {stage: fail, on: host, params: {message: never, delay_s: 60}}\n"
               "  - {stage: plan, on: controller}\n")


def _pipeline(tmp_path, body: str) -> str:
    p = tmp_path / "pipeline.yaml"
    p.write_text(body)
    return str(p)


def _ssh_overrides(sshd):
    keys = ("name", "kind", "address", "user", "port", "key_file", "known_hosts", "workdir", "python",
            "connect_timeout_s", "command_timeout_s")
    return [f"host.{k}={sshd[k]}" for k in keys]


def _kinds(run_dir, **match):
    return [e for e in read_events(run_dir) if all(e.get(k) == v for k, v in match.items())]


def test_failing_host_stage_exits_nonzero_names_it_and_is_recorded(compose_cfg, run_dir, tmp_path, capsys):
    path = _pipeline(tmp_path, "name: boom\nstages:\n  - {stage: fail, on: host, params: {message: kaput}}\n")
    code = run_pipeline(compose_cfg(f"pipeline={path}"), run_dir)
    err = capsys.readouterr().err
    assert code == 1
    assert "error: pipeline boom: stage 'fail' (#0, host) failed: PipelineError: kaput" in err
    (fail,) = _kinds(run_dir, kind="stage_fail")
    assert (fail["where"], fail["stage"], fail["error_type"], fail["error"]) == ("engine", "fail", "PipelineError", "kaput")
    assert isinstance(fail["seconds"], float)
    assert (run_dir / "engine.exit").read_text().strip() == "1"
    assert {"config.yaml", "pipeline.json", "engine.pid", "engine.log", "events.jsonl"} <= {p.name for p in run_dir.iterdir()}
    assert _kinds(run_dir, kind="pipeline_end")[0]["code"] == 1


def test_stage_timeout_on_host_and_controller(compose_cfg, run_dir, tmp_path, capsys):
    path = _pipeline(tmp_path, "stages:\n  - {stage: fail, on: host, params: {delay_s: 30, timeout_s: 0.5}}\n")
    t0 = time.monotonic()
    assert run_pipeline(compose_cfg(f"pipeline={path}"), run_dir) == 1
    assert time.monotonic() - t0 < 15
    (fail,) = _kinds(run_dir, kind="stage_fail")
    assert fail["error_type"] == "StageTimeout" and "timeout_s=0.5" in fail["error"] and fail["seconds"] < 5
    path = _pipeline(tmp_path, "stages:\n  - {stage: fail, on: controller, params: {delay_s: 30, timeout_s: 0.3}}\n")
    assert run_pipeline(compose_cfg(f"pipeline={path}"), tmp_path / "r2") == 1
    assert "stage 'fail' (#0, controller) failed: StageTimeout" in capsys.readouterr().err


def test_bad_plan_exits_2_before_any_work(compose_cfg, run_dir, tmp_path, capsys):
    path = _pipeline(tmp_path, "stages:\n  - {stage: fail, on: host, params: {delay: 1}}\n")
    assert run_pipeline(compose_cfg(f"pipeline={path}"), run_dir) == 2
    assert "unknown parameter(s) delay" in capsys.readouterr().err
    assert [e["kind"] for e in read_events(run_dir)] == ["plan_error"]
    assert not (run_dir / "engine.pid").exists()


def test_generate_runs_in_one_engine_process_and_tails_its_log(compose_cfg, run_dir, capsys):
    code = run_pipeline(compose_cfg("pipeline=generate", "prompt='2+2='", "max_new_tokens=3"), run_dir)
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads((run_dir / "result.json").read_text())
    assert result["prompt"] == "2+2=" and len(result["tokens"]) == 3
    ends = _kinds(run_dir, kind="stage_end")
    assert [(e["stage"], e["where"]) for e in ends] == [("load", "engine"), ("generate", "engine")]
    assert len({e["pid"] for e in ends}) == 1 and ends[0]["pid"] != os.getpid()
    assert "target forwards" in out  # the generate stage's own print, tailed from engine.log


def test_generate_through_the_fixture_sshd(sshd, compose_cfg, run_dir):
    code = run_pipeline(compose_cfg("pipeline=generate", "max_new_tokens=2", *_ssh_overrides(sshd)), run_dir)
    assert code == 0
    (start,) = _kinds(run_dir, kind="engine_start")
    assert start["ssh"].split()[-1] == str(sshd["port"])  # the engine really ran in that sshd's session
    (launch,) = _kinds(run_dir, kind="engine_launch")
    assert launch["host"] == f"{sshd['user']}@127.0.0.1:{sshd['port']}"
    assert json.loads((run_dir / "result.json").read_text())["tokens"]


def test_failure_through_sshd_is_propagated(sshd, compose_cfg, run_dir, tmp_path, capsys):
    path = _pipeline(tmp_path, "name: rf\nstages:\n  - {stage: fail, on: host, params: {message: remote kaput}}\n")
    assert run_pipeline(compose_cfg(f"pipeline={path}", *_ssh_overrides(sshd)), run_dir) == 1
    assert "stage 'fail' (#0, host) failed: PipelineError: remote kaput" in capsys.readouterr().err


def test_unreachable_host_fails_the_run_with_one_line(sshd, compose_cfg, run_dir, port, capsys):
    over = [o for o in _ssh_overrides(sshd) if not o.startswith("host.port=")] + [f"host.port={port}"]
    assert run_pipeline(compose_cfg("pipeline=generate", *over), run_dir) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: cannot reach {sshd['user']}@127.0.0.1:{port}: ")


def test_detached_engine_through_sshd_is_stopped_by_the_stop_pipeline(sshd, compose_cfg, run_dir, tmp_path, capsys):
    path = _pipeline(tmp_path, LONG_ENGINE)
    assert run_pipeline(compose_cfg(f"pipeline={path}", "serve.detach=true", *_ssh_overrides(sshd)), run_dir) == 0
    pid = int((run_dir / "engine.pid").read_text())
    assert Path(f"/proc/{pid}").exists() and _kinds(run_dir, kind="engine_detached")
    stop_dir = tmp_path / "stop-run"
    assert run_pipeline(compose_cfg("pipeline=stop", f"stop.run_dir={run_dir}", "stop.timeout_s=5"), stop_dir) == 0
    (end,) = _kinds(stop_dir, kind="stage_end", stage="stop")
    assert end["result"]["result"] == "terminated" and end["result"]["host"].endswith(f":{sshd['port']}")
    assert (run_dir / "engine.exit").read_text().strip() == "143"
    assert _kinds(run_dir, kind="engine_terminated")
    assert {"config.yaml", "engine.log", "engine.pid", "events.jsonl"} <= {p.name for p in run_dir.iterdir()}
    # stopping again is harmless; stopping by a port nothing serves on says so
    assert run_pipeline(compose_cfg("pipeline=stop", f"stop.run_dir={run_dir}"), tmp_path / "again") == 0
    assert run_pipeline(compose_cfg("pipeline=stop", "serve.port=1"), tmp_path / "byport") == 1
    assert "serve.port=1: no running engine" in capsys.readouterr().err


def test_stop_kills_an_engine_that_ignores_sigterm(compose_cfg, tmp_path, run_dir):
    from kdtree.hosts import connect
    from kdtree.pipeline.engine_process import stop_engine

    host = connect({"kind": "local"})
    pid = host.start_detached([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
                              str(run_dir / "e.log"), str(run_dir / "e.pid"))
    for _ in range(50):  # until the handler is installed
        if "up" in (run_dir / "e.log").read_text():
            break
        time.sleep(0.1)
    assert stop_engine(host, pid, grace_s=0.5) == "killed"
    assert not host.is_alive(pid)


def _signal_foreground_run(tmp_path, kdtree_cache, body: str, run_dir: Path, sig, ready, preexec_fn=None):
    """Run `python -m kdtree.run pipeline=<body>` in the foreground, send it `sig` once ready(events) holds;
    (its exit code, its output, the engine's pid)."""
    path = _pipeline(tmp_path, body)
    env = dict(os.environ, KDTREE_CACHE=str(kdtree_cache), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "kdtree.run", f"pipeline={path}", f"hydra.run.dir={run_dir}",
                             "stop.timeout_s=5"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn)
    try:
        for _ in range(300):
            if ready(read_events(run_dir)):
                break
            time.sleep(0.1)
        pid = int((run_dir / "engine.pid").read_text())
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, out, pid


@pytest.mark.parametrize("sig, inherit_ignored_int", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                                     (signal.SIGHUP, False), (signal.SIGINT, True)],
                         ids=["ctrl-c", "sigterm", "sighup", "sigint-to-a-background-job"])
def test_ctrl_c_or_a_supervisor_signal_in_the_foreground_stops_the_engine(tmp_path, kdtree_cache, sig,
                                                                          inherit_ignored_int):
    # inherit_ignored_int: started as a script's background job is (SIGINT ignored on entry), which Python keeps
    run_dir = tmp_path / "fg"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherit_ignored_int else None
    # until the controller is past its last stage, waiting on the engine (whose SIGTERM handler is installed by then)
    code, out, pid = _signal_foreground_run(
        tmp_path, kdtree_cache, LONG_ENGINE, run_dir, sig,
        lambda events: {"stage_end", "engine_start"} <= {e["kind"] for e in events}, preexec_fn=ignore)
    assert code == 130, out
    assert not Path(f"/proc/{pid}/cmdline").exists() or not open(f"/proc/{pid}/cmdline").read()
    assert [e["outcome"] for e in read_events(run_dir) if e["kind"] == "engine_stop"] == ["terminated"]
    assert (run_dir / "engine.exit").read_text().strip() == "143"


def test_a_stop_that_the_interrupted_code_turns_into_another_error_still_ends_the_engine_as_terminated(
        tmp_path, kdtree_cache):
    # SIGTERM raises inside whatever the engine runs; a library may catch that and raise its own error (OmegaConf did,
    # loading the config: the engine then exited 1 with a ConfigKeyError). The engine still ends as terminated.
    run_dir = tmp_path / "wrapped"
    code, out, _pid = _signal_foreground_run(  # once the engine is inside the stage's wrapped sleep
        tmp_path, kdtree_cache, LONG_ENGINE.replace("delay_s: 60}", "delay_s: 60, wrap_interrupts: true}"), run_dir,
        signal.SIGTERM, lambda events: any(e["kind"] == "stage_start" and e["where"] == "engine" for e in events))
    assert code == 130, out
    engine = [e for e in read_events(run_dir) if e["where"] == "engine"]
    assert [e["signal"] for e in engine if e["kind"] == "engine_terminated"] == ["SIGTERM"]
    assert not [e for e in engine if e["kind"] == "engine_error"]
    assert [e["outcome"] for e in read_events(run_dir) if e["kind"] == "engine_stop"] == ["terminated"]
    assert (run_dir / "engine.exit").read_text().strip() == "143"


def test_remote_run_dir_on_another_filesystem_is_copied_there_and_back(sshd, compose_cfg, run_dir, tmp_path,
                                                                       monkeypatch, capsys):
    from kdtree.pipeline import engine_process as ep

    remote = tmp_path / "remote-run"  # what a host without the controller's filesystem would use
    monkeypatch.setattr(ep, "_host_run_dir", lambda host, local: (str(remote), False))
    code = run_pipeline(compose_cfg("pipeline=generate", "max_new_tokens=2", *_ssh_overrides(sshd)), run_dir)
    assert code == 0
    assert (remote / "config.yaml").exists() and (remote / "result.json").exists()
    assert json.loads((run_dir / "result.json").read_text()) == json.loads((remote / "result.json").read_text())
    assert (run_dir / "engine.log").read_text() == (remote / "engine.log").read_text()
    assert [e["stage"] for e in _kinds(run_dir, kind="stage_end", where="engine")] == ["load", "generate"]
    assert "target forwards" in capsys.readouterr().out
