"""Where kdtree keeps what it generates (tiny checkpoints, the engine registry, cold-start history): one rule
for every user, read from the composed config."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str = "") -> Path:
    """cache_dir, else $KDTREE_CACHE, else ~/.cache/kdtree."""
    return Path(cache_dir or os.environ.get("KDTREE_CACHE") or Path.home() / ".cache" / "kdtree").expanduser()


def cache_dir(cfg) -> Path:
    """The cache root of a composed config (its `cache_dir` key; empty = the default above)."""
    return cache_root((cfg.get("cache_dir") if hasattr(cfg, "get") else "") or "")
