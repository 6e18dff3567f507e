"""Backends: the Ops interface, the numpy reference, the native cpu/cuda library, and a small registry
`get_ops(backend_cfg)` (`register_backend(name, factory)` adds one).
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from kdtree.backends import native
from kdtree.backends.base import Ops
from kdtree.backends.numpy_ops import NumpyOps
from kdtree.errors import ConfigError

_REGISTRY: Dict[str, Callable[[Any], Ops]] = {}


def register_backend(name: str, factory: Callable[[Any], Ops]) -> None:
    """Make `backend=<name>` resolve to `factory(backend_cfg) -> Ops`."""
    _REGISTRY[name] = factory


register_backend("numpy", lambda backend_cfg: NumpyOps())
register_backend("cpu", lambda backend_cfg: native.make_ops("cpu", backend_cfg))
register_backend("cuda", lambda backend_cfg: native.make_ops("cuda", backend_cfg))


def get_ops(backend_cfg: Any) -> Ops:
    """backend_cfg: a BackendConfig (or anything with .name), or the name itself -> its Ops."""
    name = backend_cfg if isinstance(backend_cfg, str) else str(backend_cfg.name)
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"backend={name} is not available (registered: {known}); use backend=numpy")
    return _REGISTRY[name](backend_cfg)


def cuda_device_problem() -> str:
    """'' when a CUDA device is usable, else the reason (never raises)."""
    n = native.cuda_device_count()  # the native library's own answer (library, driver, device)
    return "" if n > 0 else (native.CUDA_REASON or "no CUDA device")


def check_device(cfg: Any) -> None:
    """ConfigError (one line) when cfg.backend needs a device this machine lacks; run before loading a model."""
    if str(cfg.backend.name) == "cuda":
        problem = cuda_device_problem()
        if problem:
            raise ConfigError(f"backend=cuda needs a CUDA device: {problem}; use backend=cpu or backend=numpy here")


__all__ = ["Ops", "check_device", "cuda_device_problem", "get_ops", "register_backend"]
