"""The native CPU library in tests: `make test` builds it, so under CI (CI=true) a missing or stale library is a
failure (the tests run and fail with the loader's message naming `make native`), never a skip. Outside CI a test
that needs it is skipped with that message."""
from __future__ import annotations

import os

import pytest

from kdtree.backends import native

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _cpu_error() -> str:
    try:
        native.load_library("cpu")
        return ""
    except Exception as e:  # missing file, another ABI version, a broken build: all a reason here
        return f"{type(e).__name__}: {e}"


CPU_ERROR = _cpu_error()            # '' when libkdtree_cpu.so loads
CPU_SKIPPED = bool(CPU_ERROR) and not CI
needs_cpu_library = pytest.mark.skipif(CPU_SKIPPED, reason=f"libkdtree_cpu.so not usable ({CPU_ERROR}); make native")
