"""Backends: the Ops interface, the numpy reference, and a small registry `get_ops(backend_cfg)`.

Native backends register themselves with `register_backend("cpu", factory)` in
kdtree/backends/native.py; `get_ops` imports that module the first time an unregistered name is asked for.
"""
from __future__ import annotations

import importlib
import shutil
import subprocess
from typing import Any, Callable, Dict

from kdtree.backends.base import Ops
from kdtree.errors import ConfigError

_REGISTRY: Dict[str, Callable[[Any], Ops]] = {}


def register_backend(name: str, factory: Callable[[Any], Ops]) -> None:
    """Make `backend=<name>` resolve to `factory(backend_cfg) -> Ops`."""
    _REGISTRY[name] = factory


def _numpy_factory(backend_cfg: Any) -> Ops:
    from kdtree.backends.numpy_ops import NumpyOps
    return NumpyOps()


register_backend("numpy", _numpy_factory)


def get_ops(backend_cfg: Any) -> Ops:
    """backend_cfg: a BackendConfig (or anything with .name), or the name itself -> its Ops."""
    name = backend_cfg if isinstance(backend_cfg, str) else str(backend_cfg.name)
    if name not in _REGISTRY:
        try:
            importlib.import_module("kdtree.backends.native")
        except ModuleNotFoundError as e:
            if e.name != "kdtree.backends.native":
                raise
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"backend={name} is not available (registered: {known}); use backend=numpy or build "
                          f"the native library (make native) for cpu/cuda")
    return _REGISTRY[name](backend_cfg)


def cuda_device_problem() -> str:
    """'' when a CUDA device is usable, else the reason (never raises)."""
    try:
        from kdtree.backends import native  # the native library's own answer (cffi: optional)
        n = native.cuda_device_count()
        return "" if n > 0 else (native.CUDA_REASON or "no CUDA device")
    except ImportError:
        pass
    except Exception as e:  # a broken library is a reason, not a crash
        return f"{type(e).__name__}: {e}"
    if shutil.which("nvidia-smi") is None:
        return "no CUDA device (nvidia-smi not found)"
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    return "" if r.returncode == 0 and "GPU" in r.stdout else "no CUDA device (nvidia-smi lists none)"


def check_device(cfg: Any) -> None:
    """ConfigError (one line) when cfg.backend needs a device this machine lacks; run before loading a model."""
    if str(cfg.backend.name) == "cuda":
        problem = cuda_device_problem()
        if problem:
            raise ConfigError(f"backend=cuda needs a CUDA device: {problem}; use backend=cpu or backend=numpy here")


__all__ = ["Ops", "check_device", "cuda_device_problem", "get_ops", "register_backend"]
