"""Backends: the Ops interface, the numpy reference, and a small registry `get_ops(backend_cfg)`.

Native backends register themselves with `register_backend("cpu", factory)` in
kdtree/backends/native.py; `get_ops` imports that module the first time an unregistered name is asked for.
"""
from __future__ import annotations

import importlib
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


__all__ = ["Ops", "get_ops", "register_backend"]
