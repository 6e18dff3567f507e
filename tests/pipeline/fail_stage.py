"""fail (tests only; registered by tests/conftest.py): raises PipelineError(message) after delay_s — to test failure
paths, timeouts and stop.

    - {stage: fail, on: host, params: {message: "boom", delay_s: 0}}
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kdtree.errors import PipelineError

SIDE = "any"


@dataclass
class FailConfig:
    message: str = "deliberate failure"
    delay_s: float = 0.0
    wrap_interrupts: bool = False  # as a library that catches whatever interrupts it and raises its own error


CONFIG = FailConfig


def KEEPS_RUNNING(cfg) -> bool:  # the detach tests use a long `fail` as a stand-in for serve
    return bool(cfg.serve.detach)


def run(ctx, conf: FailConfig):
    message, delay_s = conf.message, conf.delay_s
    deadline = time.monotonic() + float(delay_s)
    try:
        while time.monotonic() < deadline:  # short sleeps so a SIGTERM/alarm lands promptly
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    except BaseException as e:
        if not conf.wrap_interrupts:
            raise
        raise ValueError(f"interrupted by {type(e).__name__}") from None
    raise PipelineError(message)
