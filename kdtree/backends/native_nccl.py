"""backend=cuda at tp > 1: the CUDA forward's all-reduce on its own stream through NCCL (kd_model_set_nccl).

NativeTarget.attach_device_collective (kdtree/backends/native_forward.py) calls attach_nccl on every rank of the
torch.distributed group; nccl_library_path says which libnccl the C side dlopens.
"""
from __future__ import annotations

import os
from typing import Any, List

from kdtree.errors import NativeError


def nccl_library_path() -> str:
    """libnccl.so.2 for kd_model_set_nccl: $KDTREE_NCCL_LIB, else the nvidia-nccl wheel's copy (what torch loads),
    else "" (the C side then dlopens "libnccl.so.2", found if torch has loaded it or the loader's path has it)."""
    env = os.environ.get("KDTREE_NCCL_LIB", "")
    if env:
        return env
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("nccl/lib/libnccl.so.2", "nccl/lib/libnccl.so"):
            p = os.path.join(base, sub)
            if os.path.exists(p):
                return p
    return ""


def attach_nccl(lib, handle, world: int, rank: int, strict: bool) -> bool:
    """Every rank of the torch.distributed group: move the CUDA forward's all-reduce onto its stream
    (kd_nccl_unique_id on each rank to check that NCCL loads, rank 0's id to all, kd_model_set_nccl, and the group
    agrees at each step so that no rank waits in a collective the others skipped). True when set; on any failure
    every rank keeps the host all-reduce (said once on stderr), or with `strict` (tp.collective=nccl) raises."""
    import sys
    import torch.distributed as dist
    ffi = lib.ffi
    path = nccl_library_path()
    cpath = ffi.new("char[]", path.encode())
    buf = ffi.new("uint8_t[128]")
    ok = lib.c.kd_nccl_unique_id(cpath, buf) == 0
    got: List[Any] = [None] * world
    mine = bytes(ffi.buffer(buf)) if ok and rank == 0 else b""
    dist.all_gather_object(got, (ok, mine, "" if ok else lib.last_error()))
    bad = [(r, why) for r, (o, _, why) in enumerate(got) if not o]
    if not bad:
        uid = ffi.new("uint8_t[128]", list(got[0][1]))
        ok = lib.c.kd_model_set_nccl(handle, cpath, uid, world, rank) == 0
        dist.all_gather_object(got, (ok, b"", "" if ok else lib.last_error()))
        bad = [(r, why) for r, (o, _, why) in enumerate(got) if not o]
        if bad and ok:
            lib.c.kd_model_set_nccl(handle, cpath, ffi.NULL, 0, 0)   # back to the host all-reduce, as the others
    if not bad:
        return True
    r, why = bad[0]
    if strict:
        raise NativeError(f"tp.collective=nccl: rank {r} could not set up NCCL on the stream: {why}; use "
                          f"tp.collective=host")
    if rank == 0:
        print(f"kdtree: tp.collective=auto: NCCL on the forward's stream failed on rank {r} ({why}); every rank "
              f"all-reduces through the host instead (no CUDA graphs)", file=sys.stderr, flush=True)
    return False
