"""`served`: one real engine process (tiny model, ddtree) per test module, killed at the end."""
from __future__ import annotations

import signal

import pytest

from served_engine import alive, start_served, stop


@pytest.fixture(scope="module")
def served(tmp_path_factory, kdtree_cache):
    s = start_served(tmp_path_factory, kdtree_cache)
    yield s
    if alive(s.pid):
        stop(s.pid, signal.SIGKILL)
