"""Fixtures shared by every test package: a free TCP port, a run dir, a composed config, and a REAL sshd.

The sshd fixture starts /usr/sbin/sshd (openssh-server; .ci/run installs it) on 127.0.0.1 on a free port
with its own host key, authorized key and sshd_config in a tmp dir, and yields a host config
(kind: ssh) with a known_hosts file that pins that host key. Tests that need it are skipped when sshd is
not installed.
"""
from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def fail_stage():
    """The test-only stage `fail` (tests/pipeline/fail_stage.py), known to this process and to the engine and
    kdtree.run processes it starts (the registration travels in KDTREE_STAGES)."""
    from kdtree.pipeline.registry import register_stage, unregister_stage

    register_stage("fail", "tests.pipeline.fail_stage")
    yield "fail"
    unregister_stage("fail")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def kdtree_cache(tmp_path_factory) -> Path:
    """One cache dir per test session (embedded tiny checkpoint, engine registry)."""
    return tmp_path_factory.mktemp("kdtree-cache")


@pytest.fixture
def compose_cfg(kdtree_cache):
    """compose_cfg("pipeline=generate", ...) -> the composed RootConfig, cache_dir = the session cache."""
    from hydra import compose, initialize_config_dir

    from kdtree.pipeline.registry import register_schema as register

    register()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", *overrides])

    return _compose


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1:<free port>; yields the host config dict (kind ssh) pointing at it."""
    if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        pytest.skip("openssh-server not installed (apt-get install -y openssh-server openssh-client)")
    d = tmp_path_factory.mktemp("sshd")
    _keygen(d / "host_key")
    _keygen(d / "client_key")
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    p = free_port()
    user = getpass.getuser()
    (d / "sshd_config").write_text("\n".join([
        f"Port {p}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host_key'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "PubkeyAuthentication yes", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PermitRootLogin yes",
        f"AllowUsers {user}", "Subsystem sftp internal-sftp", "LogLevel VERBOSE", "MaxStartups 30", ""]))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation dir sshd insists on when root
    host_pub = (d / "host_key.pub").read_text().split()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{p} {host_pub[0]} {host_pub[1]}\n")
    log = open(d / "sshd.log", "wb")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # ready = it answers with an SSH banner
        if proc.poll() is not None:
            pytest.fail(f"sshd exited {proc.returncode}: {(d / 'sshd.log').read_text()[-500:]}")
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", p), timeout=1) as s:
                if s.recv(8).startswith(b"SSH-"):
                    break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail(f"sshd did not answer on 127.0.0.1:{p} within 10 s: {(d / 'sshd.log').read_text()[-500:]}")
    yield {
        "name": "fixture-sshd", "kind": "ssh", "address": "127.0.0.1", "user": user, "port": p,
        "key_file": str(d / "client_key"), "known_hosts": str(d / "known_hosts"),
        "workdir": str(REPO), "python": sys.executable, "supervisor": "nohup",
        "connect_timeout_s": 5.0, "command_timeout_s": 30.0, "dir": str(d),
    }
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def ssh_host_yaml(sshd, tmp_path) -> Path:
    """The sshd fixture as a host config file (conf/host/*.yaml layout) for `host=` overrides via a search path."""
    import yaml

    cfg = {k: v for k, v in sshd.items() if k != "dir"}
    path = tmp_path / "host" / "fixture_sshd.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="session")
def tiny_cfg():
    """conf/model/tiny.yaml on the ModelConfig schema (no Hydra composition); the one tiny model config of the
    tests (a test that changes it works on a copy.deepcopy)."""
    from kdtree.config.schema import group_config

    return group_config("model", "tiny")


@pytest.fixture(scope="session")
def tiny_weights(tiny_cfg):
    """Seeded random weights of the tiny target, with non-unit norms so a norm applied to the wrong rows shows."""
    import numpy as np

    from kdtree.model.names import init_weights, target_tensor_shapes

    w = init_weights(target_tensor_shapes(tiny_cfg), seed=0)
    rng = np.random.default_rng(7)
    for k in w:
        if k.endswith("norm.weight"):
            w[k] = (1.0 + 0.3 * rng.standard_normal(w[k].shape)).astype(np.float32)
    return w


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg, tiny_weights):
    from kdtree.backends import get_ops
    from kdtree.model.k2 import K2Model

    return K2Model(tiny_cfg, tiny_weights, get_ops("numpy"))
