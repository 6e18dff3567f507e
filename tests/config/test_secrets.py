"""API keys stay out of the run dir and off command lines: saved configs (config.yaml, Hydra's .hydra/*.yaml) are
redacted, serve.api_key / health.api_key as an override is refused with the way to give a key instead."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdtree.config.secrets import api_key
from kdtree.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def kdtree_run(tmp_path, *args, env=None):
    env = dict(os.environ, KDTREE_CACHE=str(tmp_path / "cache"), KDTREE_RUNS=str(tmp_path / "runs"), **(env or {}))
    return subprocess.run([sys.executable, "-m", "kdtree.run", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_saved_configs_hold_no_key(tmp_path):
    run_dir = tmp_path / "plan"
    (tmp_path / "watch.key").write_text("watch-key-123\n")
    r = kdtree_run(tmp_path, "pipeline=plan", f"health.api_key_file={tmp_path / 'watch.key'}",
                   f"hydra.run.dir={run_dir}", env={"KDTREE_API_KEY": "env-key-456"})
    assert r.returncode == 0, r.stderr
    saved = [p for p in run_dir.rglob("*.yaml")]
    assert {p.name for p in saved} >= {"config.yaml", "overrides.yaml", "hydra.yaml"}
    for p in saved:
        text = p.read_text()
        assert "watch-key-123" not in text and "env-key-456" not in text, p


@pytest.mark.parametrize("section", ["serve", "health"])
def test_an_api_key_override_is_refused_with_the_fix(tmp_path, section):
    r = kdtree_run(tmp_path, "pipeline=plan", f"{section}.api_key=abc", f"hydra.run.dir={tmp_path / 'x'}")
    assert r.returncode == 2 and "KDTREE_API_KEY" in r.stderr and f"{section}.api_key_file" in r.stderr, r.stderr
    assert f"{section}.api_key is not taken" in r.stderr and "abc" not in r.stderr


def test_key_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KDTREE_API_KEY", raising=False)
    f = tmp_path / "key"
    f.write_text("file-key\n")
    assert api_key({"api_key_file": str(f)}) == "file-key"
    monkeypatch.setenv("KDTREE_API_KEY", "env-key")
    assert api_key({"api_key_file": str(f)}) == "env-key"
    monkeypatch.delenv("KDTREE_API_KEY")
    with pytest.raises(ConfigError, match="serve.api_key_file=.*cannot read"):
        api_key({"api_key_file": str(tmp_path / "missing")})
    assert api_key({"api_key_file": ""}) == ""
    with pytest.raises(ConfigError, match="health.api_key_file=.*is empty"):
        (tmp_path / "empty").write_text("\n")
        api_key({"api_key_file": str(tmp_path / "empty")}, "health")
