"""systemd's sd_notify protocol without libsystemd: one datagram per message to $NOTIFY_SOCKET.

Under `Type=notify` systemd waits for READY=1; while the load makes progress we send
EXTEND_TIMEOUT_USEC so a ten-minute cold start does not trip TimeoutStartSec, and STATUS= so that
`systemctl status` shows "loading 31/62 shards, 274.0/548.0 GB, 812.5 MB/s, ETA 337 s".
Outside systemd (no NOTIFY_SOCKET) every call is a no-op returning False.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Dict, Optional

from kdtree.serve.status import describe


def notify(message: str, socket_path: Optional[str] = None) -> bool:
    """Send `message` (newline-separated KEY=VALUE lines) to systemd; False when not under systemd."""
    addr = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):                      # abstract namespace socket
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


class SdNotifier:
    """Status listener that mirrors engine status to systemd (at most one message per `min_interval_s`).

    extend_s: how much more start time to ask for on each progressing update (EXTEND_TIMEOUT_USEC).
    """

    def __init__(self, extend_s: float = 60.0, min_interval_s: float = 1.0, socket_path: Optional[str] = None):
        self.socket_path = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.extend_s = extend_s
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.socket_path)

    def send(self, message: str) -> bool:
        if not self.enabled:
            return False
        try:
            return notify(message, self.socket_path)
        except OSError:                            # systemd went away: never take the engine down for it
            return False

    def on_status(self, snap: Dict[str, Any]) -> None:
        """StatusFile listener: STATUS= always for phase changes, throttled for progress updates."""
        if not self.enabled:
            return
        phase = snap.get("phase")
        now = time.monotonic()
        with self._lock:
            changed = phase != getattr(self, "_phase", None)
            if not changed and now - self._last < self.min_interval_s:
                return
            self._last, self._phase = now, phase
        lines = [f"STATUS={describe(snap)}"]
        if phase in ("loading", "warmup"):
            lines.append(f"EXTEND_TIMEOUT_USEC={int(self.extend_s * 1e6)}")
        elif phase == "ready":
            lines.append("READY=1")
        elif phase in ("draining", "stopped"):
            lines.append("STOPPING=1")
        self.send("\n".join(lines))
