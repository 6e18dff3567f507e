"""The tensor-parallel process group and its one collective: a deterministic, batch-invariant all-reduce.

Why not dist.all_reduce: a ring (gloo) or tree/ring (NCCL) all-reduce adds an element's partials in an order
that depends on which chunk of the buffer the element falls in, i.e. on the buffer size T x D. The same token
would then get different bits in an AR step (T=1) and in a tree verify (T=1+budget), and greedy DDTree could
diverge from greedy AR. Instead every rank all-gathers the partials (tiny: T x D floats per rank) and adds
them in rank order, ((p0 + p1) + p2) + ..., elementwise in float32: each element's result depends only on its
own partials, never on T, and every rank computes the same bits (so the replicated residual stream, router
and latent cache stay identical on all ranks).
"""
from __future__ import annotations

import datetime
from typing import Callable

import numpy as np

from kdtree.errors import ConfigError


def resolve_dist_backend(tp_cfg, backend_name: str) -> str:
    """tp.dist_backend (auto = nccl for backend=cuda, gloo otherwise) -> the torch.distributed backend."""
    b = str(tp_cfg.dist_backend)
    if b == "auto":
        return "nccl" if backend_name == "cuda" else "gloo"
    if b not in ("gloo", "nccl"):
        raise ConfigError(f"tp.dist_backend={b} is unknown; use auto, gloo or nccl")
    return b


def init_group(store, rank: int, world: int, dist_backend: str, timeout_s: float) -> None:
    """Join the default process group of `world` ranks through `store` (a TCPStore); collectives time out."""
    import torch
    import torch.distributed as dist

    if dist_backend == "nccl":
        torch.cuda.set_device(0)  # each rank sees only its own GPU (launch sets CUDA_VISIBLE_DEVICES)
    dist.init_process_group(dist_backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def leave_group() -> None:
    """Destroy this process's default group (no-op when it has none), so a new engine can join another."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_collective(tp_cfg, backend_name: str) -> str:
    """tp.collective (auto = nccl for backend=cuda, host otherwise) -> how the native CUDA forward all-reduces."""
    c = str(getattr(tp_cfg, "collective", "auto") or "auto")
    return ("nccl" if backend_name == "cuda" else "host") if c == "auto" else c


def ordered_all_reduce(world: int, dist_backend: str, collective: str = "host",
                       strict: bool = False) -> Callable[[np.ndarray], np.ndarray]:
    """x f32[...] (this rank's partial) -> sum over ranks f32[...], added in rank order (bit-identical everywhere).

    The function carries `world`, `rank` and `collective`: with collective="nccl" the CUDA forward
    (kdtree/backends/native_forward.py) does the same gather and rank-ordered sum on its own stream through NCCL
    and this Python path is its fallback (`strict`: tp.collective=nccl was asked for explicitly, so a failure to
    set NCCL up is an error, not a fallback)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist_backend == "nccl" else "cpu"
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10+

    def all_reduce(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(x, np.float32).reshape(-1)).to(device)   # [T*D]
        parts = torch.empty(world * t.numel(), dtype=t.dtype, device=device)             # [tp*T*D]
        gather(parts, t)
        parts = parts.view(world, -1)                                                     # [tp, T*D]
        acc = parts[0].clone()
        for r in range(1, world):                                                         # rank order
            acc += parts[r]
        return acc.cpu().numpy().reshape(x.shape)

    all_reduce.world, all_reduce.rank = world, dist.get_rank() if dist.is_initialized() else 0
    all_reduce.collective, all_reduce.strict = collective, strict
    return all_reduce
