"""fail: a stage that raises PipelineError(message) after delay_s — to test failure paths, timeouts and stop.

    - {stage: fail, on: host, params: {message: "boom", delay_s: 0}}
"""
from __future__ import annotations

import time

from kdtree.errors import PipelineError

SIDE = "any"
PARAMS = {"message": str, "delay_s": float}


def run(ctx, message: str = "deliberate failure", delay_s: float = 0.0):
    deadline = time.monotonic() + float(delay_s)
    while time.monotonic() < deadline:  # short sleeps so a SIGTERM/alarm lands promptly
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    raise PipelineError(message)
