"""A fleet: N replicas of the same engine config (one per entry of fleet.hosts) behind sglang-router.

    python -m kdtree.run pipeline=fleet_serve 'fleet.hosts=[local,local,local]' serve.port=31000 fleet.router_port=30000
    python -m kdtree.run pipeline=fleet_restart 'fleet.hosts=[local,local,local]' serve.port=31000   # rolling
    python -m kdtree.run pipeline=fleet_stop 'fleet.hosts=[local,local,local]' serve.port=31000

Replica i is the serve pipeline itself (`python -m kdtree.run pipeline=serve host=<hosts[i]> serve.port=<port + i>
serve.detach=true` plus this run's own overrides), so each replica is launched, watched and stopped exactly as one
server is, on its host (local or fabric), with any engine=. The router is sglang-router (SGLang Model Gateway, a
Rust load balancer that routes to any OpenAI-compatible worker, with health checks), started on the controller and
given its workers through its HTTP API (/add_worker, /remove_worker, /workers). The fleet's record (router pid,
replica ports, run dirs) is <cache_dir>/fleets/<router_port>.json, which fleet_stop and fleet_restart read.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from omegaconf import OmegaConf

from kdtree.config.paths import cache_dir
from kdtree.config.schema import CONF_DIR
from kdtree.errors import PipelineError

VERDICT = re.compile(r"^\s*[\d.]+s\s+(READY|PROGRESSING|STALLED|CRASHED|UNREACHABLE|WAITING|QUIET)\b")
FINAL = re.compile(r"^(READY|STALLED|CRASHED|UNREACHABLE): ")   # the monitor's last word: verdict, reason, seconds
ETA = re.compile(r"ETA (\d+(?:\.\d+)?) s")
DROPPED = ("pipeline=", "fleet.", "serve.port=", "serve.detach=", "host=", "hydra.")   # set per replica instead


@dataclass
class Replica:
    index: int
    host: str
    port: int
    run_dir: str
    verdict: str = "STARTING"
    eta_s: Optional[float] = None
    last: str = ""
    evidence: str = ""                     # the monitor's last verdict line (its reason)

    def url(self, cfg) -> str:
        """Where the router reaches it: 127.0.0.1 on the controller, else its host's address."""
        address = host_address(self.host) if self.host != "local" else ""
        return f"http://{address or '127.0.0.1'}:{self.port}"


def _host_file(entry: str) -> Path:
    return CONF_DIR / "host" / f"{entry}.yaml"


def host_address(entry: str) -> str:
    """A fleet.hosts entry's address: a host config's host.address, or the entry itself ([user@]ADDRESS[:port])."""
    if _host_file(entry).is_file():
        return str(OmegaConf.load(_host_file(entry)).get("address") or "")
    return entry.rpartition("@")[2].split(":")[0]


def host_args(entry: str) -> List[str]:
    """The overrides that put a replica on fleet.hosts entry `entry`: `local`; a host config name (conf/host/NAME.yaml);
    or an address, [user@]ADDRESS[:port], reached over SSH with the rest of host.* from this run's command line
    (host.key_file, host.known_hosts, host.workdir, host.python: one set for identical machines). A replica on
    another host binds its address (serve.host; an explicit serve.host= wins) so the router reaches it."""
    if entry == "local":
        return ["host=local"]
    if _host_file(entry).is_file():
        address = host_address(entry)
        return [f"host={entry}"] + ([f"serve.host={address}"] if address else [])
    user, _, rest = entry.rpartition("@")
    address, _, port = rest.partition(":")
    if not address:
        raise PipelineError(f"fleet.hosts entry {entry!r} is neither a host config (conf/host/*.yaml) nor an "
                            f"address ([user@]ADDRESS[:port])")
    return (["host=local", "host.kind=ssh", f"host.name={address}", f"host.address={address}"]
            + ([f"host.user={user}"] if user else []) + ([f"host.port={port}"] if port else [])
            + [f"serve.host={address}"])


@dataclass
class Fleet:
    router_port: int
    router_pid: int = 0
    replicas: List[Replica] = field(default_factory=list)


def record_path(cfg) -> Path:
    return Path(cache_dir(cfg)) / "fleets" / f"{int(cfg.fleet.router_port)}.json"


def save(cfg, fleet: Fleet) -> None:
    p = record_path(cfg)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = {"router_port": fleet.router_port, "router_pid": fleet.router_pid,
           "replicas": [{"index": r.index, "host": r.host, "port": r.port, "run_dir": r.run_dir} for r in fleet.replicas]}
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, p)


def load(cfg) -> Fleet:
    p = record_path(cfg)
    if not p.is_file():
        raise PipelineError(f"no fleet behind router port {cfg.fleet.router_port} ({p} is missing); start one with "
                            f"pipeline=fleet_serve, or give the fleet.router_port it was started with")
    doc = json.loads(p.read_text())
    return Fleet(int(doc["router_port"]), int(doc.get("router_pid", 0)),
                 [Replica(r["index"], r["host"], r["port"], r["run_dir"]) for r in doc["replicas"]])


def plan_replicas(cfg, run_dir: Path) -> List[Replica]:
    hosts = list(cfg.fleet.hosts)
    if not hosts:
        raise PipelineError("fleet.hosts is empty; list one host per replica, e.g. 'fleet.hosts=[local,local,local]'")
    base = int(cfg.serve.port)
    if base <= 0:
        raise PipelineError(f"serve.port={base}: a fleet needs a real first port (replica i serves on serve.port + i)")
    return [Replica(i, str(h), base + i, str(run_dir / f"replica-{i}")) for i, h in enumerate(hosts)]


def user_overrides(run_dir: Path) -> List[str]:
    """This run's command-line overrides (Hydra keeps them) that every replica inherits."""
    saved = Path(run_dir) / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(saved)] if saved.is_file() else []
    return [o for o in overrides if not o.startswith(DROPPED)]


def kdtree_command(*args: str) -> List[str]:
    return [sys.executable, "-m", "kdtree.run", *args]


def serve_replica(r: Replica, overrides: List[str], on_line: Callable[[Replica, str], None]) -> int:
    """The serve pipeline of replica r (detached engine); its output lines through on_line; its exit code."""
    argv = kdtree_command("pipeline=serve", *host_args(r.host), f"serve.port={r.port}", "serve.detach=true",
                          f"hydra.run.dir={r.run_dir}", *overrides)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        on_line(r, line.rstrip("\n"))
    return proc.wait()


def status_replica(r: Replica, url: str, overrides: List[str], run_dir: Path,
                   on_line: Callable[[Replica, str], None]) -> int:
    """One watch of replica r with its own evidence (its engine pid, status.json and log in its run dir, probes
    on its host): READY, or CRASHED / STALLED / UNREACHABLE with the reason; its lines through on_line."""
    pid_file = Path(r.run_dir) / "engine.pid"
    pid = pid_file.read_text().strip() if pid_file.is_file() else "0"
    # health.pid_ran: the replica's engine did run with this pid, so a pid that is gone is its crash (CRASHED with
    # the evidence), where a health.pid naming no process is otherwise a mistake in the command (an error at start)
    argv = kdtree_command("pipeline=watch", *host_args(r.host), f"health.url={url}", f"health.pid={pid}",
                          "health.pid_ran=true", f"health.status_path={r.run_dir}/status.json",
                          f"health.log={r.run_dir}/engine.log", f"hydra.run.dir={run_dir / f'replica-{r.index}'}",
                          *overrides)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        on_line(r, line.rstrip("\n"))
    return proc.wait()


def stop_replica(r: Replica, on_line: Callable[[Replica, str], None]) -> int:
    """pipeline=stop of the replica's run (SIGTERM: it drains its accepted requests, then exits)."""
    proc = subprocess.run(kdtree_command("pipeline=stop", f"stop.run_dir={r.run_dir}"), capture_output=True,
                          text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        on_line(r, line)
    return proc.returncode


class Board:
    """One line per replica sample, and the fleet summary after each: N ready / loading / stalled / crashed."""

    def __init__(self, replicas: List[Replica], out=None):
        self.replicas, self.out, self._lock = replicas, out or sys.stdout, threading.Lock()

    def line(self, r: Replica, text: str) -> None:
        m = VERDICT.match(text)
        with self._lock:
            if m or FINAL.match(text):
                r.evidence = text.strip()
            if m:
                r.verdict = m.group(1)
                eta = ETA.search(text)
                r.eta_s = float(eta.group(1)) if eta else r.eta_s
            r.last = text
            print(f"[replica {r.index} {r.host}:{r.port}] {text}", file=self.out, flush=True)
            if m:
                print(f"[fleet] {self.summary()}", file=self.out, flush=True)

    def summary(self) -> str:
        counts: Dict[str, int] = {}
        for r in self.replicas:
            kind = "loading" if r.verdict in ("PROGRESSING", "WAITING", "QUIET", "STARTING") else r.verdict.lower()
            counts[kind] = counts.get(kind, 0) + 1
        etas = [r.eta_s for r in self.replicas if r.eta_s is not None and r.verdict != "READY"]
        order = ("ready", "loading", "stalled", "crashed", "unreachable", "stopped")
        text = ", ".join(f"{counts.get(k, 0)} {k}" for k in order if counts.get(k) or k in order[:4])
        return f"{len(self.replicas)} replicas: {text}" + (f"; slowest ETA {max(etas):.0f} s" if etas else "")


# -- the router ----------------------------------------------------------------------------------------------
def router_url(cfg) -> str:
    return f"http://127.0.0.1:{int(cfg.fleet.router_port)}"


def _call(url: str, method: str = "GET", body: Optional[dict] = None, timeout: float = 5.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, method=method, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def start_router(cfg, run_dir: Path, workers: List[str]) -> int:
    """sglang-router on the controller (fleet.router_port), its log in the run dir; its pid once it answers."""
    import socket
    with socket.socket() as s:                        # its Prometheus exporter needs a port of its own
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(int(cfg.fleet.router_port)), "--policy", str(cfg.fleet.router_policy),
            "--health-check-interval-secs", str(int(cfg.fleet.health_interval_s)),
            "--prometheus-port", str(metrics_port), "--worker-urls", *workers]
    if str(cfg.engine.name) == "kdtree":              # kdtree's /health is 200 while loading too; /ready is not
        argv[-1 - len(workers):-1 - len(workers)] = ["--health-check-endpoint", "/ready"]
    log = open(run_dir / "router.log", "ab")
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        raise PipelineError(f"cannot start sglang-router ({e}); pip install sglang-router") from None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (run_dir / "router.log").read_text(errors="replace").strip().splitlines()[-1:]
            raise PipelineError(f"sglang-router exited with code {proc.returncode}: {tail}; see {run_dir / 'router.log'}")
        try:
            _call(router_url(cfg) + "/workers", timeout=1.0)
            return proc.pid
        except (OSError, ValueError):
            time.sleep(0.2)
    proc.kill()
    raise PipelineError(f"sglang-router did not answer on port {cfg.fleet.router_port} within 30 s; see {run_dir / 'router.log'}")


def workers(cfg) -> List[dict]:
    return list(_call(router_url(cfg) + "/workers").get("workers", []))


def set_worker(cfg, url: str, present: bool) -> None:
    """Add a worker to the router (POST /workers) or remove it (DELETE /workers/{id}): it then gets nothing new."""
    if present:
        _call(router_url(cfg) + "/workers", "POST", {"url": url}, timeout=30.0)
        return
    for w in workers(cfg):
        if w.get("url") == url:
            _call(router_url(cfg) + f"/workers/{w['id']}", "DELETE", timeout=30.0)


def wait_worker(cfg, url: str, present: bool, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        have = {w.get("url"): w.get("is_healthy", True) for w in workers(cfg)}
        if (have.get(url) is True) if present else url not in have:
            return
        time.sleep(0.2)
    raise PipelineError(f"the router at {router_url(cfg)} still {'lacks' if present else 'has'} worker {url} "
                        f"after {timeout_s:g} s")


def stop_router(pid: int, grace_s: float = 10.0) -> str:
    if pid <= 0:
        return "no router"
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return "not running"
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "terminated"
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "terminated"
    return "killed"
