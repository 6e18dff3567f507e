"""Process helpers shared by the tests: is a process still there, and wait until processes are gone."""
from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """pid exists and is neither a zombie nor dead (state Z/X in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def wait_gone(pids, timeout_s: float = 15.0) -> list:
    """Wait up to timeout_s for every pid to exit; the ones still alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
