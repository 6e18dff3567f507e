"""A fleet on real test hosts: 3 network namespaces (tests/netns_hosts.py), each with its own address on a veth pair
and its own sshd, so fabric connects to three machines. Every replica is the serve pipeline on its host, bound to
that host's address (fleet.hosts entries are addresses: host.* from the command line, kind ssh); the health poll
runs through its ssh session; sglang-router runs here, in the root namespace, and reaches them over the veths.
Under 16 clients through the router: a rolling restart loses no request and gets no 5xx (counted), and a replica
SIGKILLed is CRASHED in fleet_status (its pid gone, its worker unhealthy) while every request after the router's
health checks succeeds on the other two.

Run: .venv/bin/python -m pytest -q tests/engines/test_fleet_netns.py
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kdtree.hosts import connect
from tests.conftest import free_port
from tests.engines.test_fleet import CLIENTS, _complete
from tests.netns_hosts import netns_hosts  # noqa: F401  (the fixture)
from tests.serve.served_engine import kdtree_run


class Load:
    """CLIENTS threads sending completions through the router until the block ends; (time, status) of each."""

    def __init__(self, url: str):
        self.url, self.timed, self.stop = url, [], threading.Event()

    @property
    def codes(self):
        return [c for _, c in self.timed]

    def summary(self) -> str:
        c = self.codes
        return f"{len(c)} requests, {sum(x == 200 for x in c)} ok, {sum(x >= 500 for x in c)} 5xx, " \
               f"{sum(x == 0 for x in c)} lost"

    def _client(self):
        while not self.stop.is_set():
            t = time.monotonic()
            self.timed.append((t, _complete(self.url)))

    def __enter__(self):
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CLIENTS)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(90)


def test_each_namespace_is_a_host_of_its_own(netns_hosts):  # noqa: F811
    addresses = [h.address for h in netns_hosts.hosts]
    for h in netns_hosts.hosts:
        with connect({"kind": "ssh", "address": h.address, "user": "root", "port": 22,
                      "key_file": netns_hosts.key_file, "known_hosts": netns_hosts.known_hosts}) as host:
            r = host.run(["sh", "-c", 'echo "$SSH_CONNECTION"; ip -o -4 addr show'], check=True)
        first, addrs = r.stdout.splitlines()[0].split(), r.stdout
        assert first[2] == h.address and first[0] == h.peer      # from the root end of its veth, to its own address
        assert h.address in addrs and not any(a in addrs for a in addresses if a != h.address)


def test_fleet_of_three_namespace_hosts_behind_the_router(netns_hosts, kdtree_cache, tmp_path):  # noqa: F811
    pytest.importorskip("sglang_router", reason="sglang-router not installed (pip install sglang-router)")
    addresses = [h.address for h in netns_hosts.hosts]
    base, router = free_port(), free_port()
    while router in range(base, base + 3):
        router = free_port()
    fleet = [f"fleet.hosts=[{','.join(addresses)}]", f"serve.port={base}", f"fleet.router_port={router}",
             "serve.demo_tokens=0", "tree=ar", "health.interval_s=0.5", *netns_hosts.overrides]
    run_dir = tmp_path / "fleet"
    r = kdtree_run(["pipeline=fleet_serve", *fleet, f"hydra.run.dir={run_dir}"], kdtree_cache, tmp_path, timeout=400)
    out = r.stdout + r.stderr
    try:
        assert r.returncode == 0, out
        assert "[fleet] 3 replicas: 3 ready, 0 loading, 0 stalled, 0 crashed" in out, out
        for i, a in enumerate(addresses):
            assert f"[replica {i} {a}:{base + i}]" in out
            launch = [json.loads(x) for x in (run_dir / f"replica-{i}" / "events.jsonl").read_text().splitlines()]
            assert any(e.get("kind") == "engine_launch" and e.get("host") == f"root@{a}:22" for e in launch), launch
        url = f"http://127.0.0.1:{router}"
        with urllib.request.urlopen(url + "/workers", timeout=10) as w:
            workers = json.loads(w.read())["workers"]
        assert sorted(x["url"] for x in workers) == sorted(f"http://{a}:{base + i}" for i, a in enumerate(addresses))
        codes = [_complete(url) for _ in range(9)]
        assert codes == [200] * 9, codes
        st = kdtree_run(["pipeline=fleet_status", *fleet], kdtree_cache, tmp_path, timeout=120)
        assert st.returncode == 0 and "[fleet] 3 replicas: 3 ready" in st.stdout, st.stdout + st.stderr
        with Load(url) as load:                        # 16 clients through the router during the rolling restart
            roll = kdtree_run(["pipeline=fleet_restart", *fleet], kdtree_cache, tmp_path, timeout=600)
        assert roll.returncode == 0 and roll.stdout.count("restarted in") == 3, roll.stdout + roll.stderr
        print(f"namespace fleet, rolling restart: {load.summary()}")
        assert len(load.codes) >= CLIENTS and all(c == 200 for c in load.codes), sorted(set(load.codes))
        record = json.loads((kdtree_cache / "fleets" / f"{router}.json").read_text())
        victim = int((Path(record["replicas"][1]["run_dir"]) / "engine.pid").read_text())
        with Load(url) as load:                        # SIGKILL replica 1 under load
            time.sleep(1)
            os.kill(victim, signal.SIGKILL)
            time.sleep(6)
            st = kdtree_run(["pipeline=fleet_status", *fleet], kdtree_cache, tmp_path, timeout=120)
            t_settled = time.monotonic()
            time.sleep(3)
        print(f"namespace fleet, replica 1 killed: {load.summary()}")
        assert st.returncode != 0 and "[fleet] 3 replicas: 2 ready, 0 loading, 0 stalled, 1 crashed" in st.stdout
        line = next(x for x in st.stdout.splitlines() if x.startswith("[fleet] replica 1 "))
        assert f"CRASHED: engine pid {victim} is gone" in line and "unhealthy: gets no requests" in line, line
        after = [c for t, c in load.timed if t >= t_settled]
        assert len(after) >= CLIENTS and all(c == 200 for c in after), sorted(set(after))
    finally:
        s = kdtree_run(["pipeline=fleet_stop", f"fleet.router_port={router}"], kdtree_cache, tmp_path, timeout=120)
    assert s.returncode == 0 and "3 replica(s) stopped" in s.stdout, s.stdout + s.stderr
    assert _complete(f"http://127.0.0.1:{router}") == 0
    assert all(_complete(f"http://{a}:{base + i}") == 0 for i, a in enumerate(addresses))
