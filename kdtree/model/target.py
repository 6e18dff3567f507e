"""What the decoder and the engine use of a target and of a drafter, and the one factory that picks them.

    target = build_target(cfg.model, weights, ops)     # NativeTarget (backend=cpu|cuda) or K2Model (numpy, per-op)
    drafter = build_drafter(cfg.model, dweights, target)   # NativeDrafter or DFlashDrafter, over target's embed/lm_head

Peers of the Target protocol: K2Model (kdtree/model/k2.py, the numpy specification; over NativeOps it is the
per-op path), NativeTarget (kdtree/backends/native_forward.py, the whole forward in one library call, built from
the same weights mapping) and TPModel (kdtree/parallel/model.py, rank 0's proxy; its shards are built here too, by
kdtree/parallel/launch.py and worker.py). Which one runs is decided here and only here: the ops' `native_forward`
(the library runs whole forwards: backend=cpu, backend=cuda on a device) and `native_drafter_forward` (also off
for backend.drafter_forward=per_op).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

from kdtree.backends.native_drafter import NativeDrafter
from kdtree.backends.native_forward import NativeTarget
from kdtree.model.drafter import DFlashDrafter
from kdtree.model.k2 import K2Model

# (tokens i32[T], positions i32[T], cache, visibility u64[T, ceil(T/64)] | None = causal)
Seq = Tuple[np.ndarray, np.ndarray, Any, Optional[np.ndarray]]


@runtime_checkable
class Target(Protocol):
    """A K2 target as kdtree/decode and the Engine use it."""

    cfg: Any                      # the ModelConfig
    ops: Any                      # the Ops: decode calls ops.draft_topk / tree_build / tree_accept
    embed_tokens: np.ndarray      # f32[V, D], shared with the drafter
    lm_head_w: Any                # f32[V, D] or Int4Weight, shared with the drafter

    pages: Any                    # its PagePool (kdtree/model/pages.py): the ids of its ONE paged latent arena

    def new_cache(self, max_len: int, prefix: Sequence[int] = ()) -> Any:
        """A latent cache of max_len rows (a PagedCache: length, max_len, pages, truncate(n), keep(start, rows)),
        the pages `prefix` mapped first (a prefix cache hit, zero-copy), fresh pages of `pages` for the rest."""

    def forward(self, tokens: np.ndarray, positions: np.ndarray, cache: Any, visibility: Optional[np.ndarray] = None,
                hidden_layers: Iterable[int] = ()) -> Tuple[np.ndarray, Dict[int, np.ndarray]]:
        """T rows after the cache's -> logits f32[T, V], {layer: f32[T, D]}; appends their latent rows."""

    def forward_batch(self, seqs: Sequence[Seq], hidden_layers: Iterable[int] = ()
                      ) -> Tuple[np.ndarray, np.ndarray, Dict[int, np.ndarray]]:
        """Rows of several sequences in one forward -> logits f32[N, V], argmax i32[N], {layer: f32[N, D]}."""

    def reserve_cache_pool(self, rows: int, page_rows: int = 16) -> bool:
        """A fixed arena of rows // page_rows pages for every later cache (PagePool.reserve); True."""

    def attach_device_collective(self) -> bool:
        """tp with backend=cuda: the all-reduce onto the forward's stream (a collective); False elsewhere."""

    def graph_rows(self, rows: Iterable[int]) -> bool:
        """backend=cuda: capture forwards of these row counts as CUDA graphs; False where nothing is captured."""

    def graph_stats(self) -> Dict[str, float]:
        """{graphs, replays, eager, buckets, capture_s} (zeros where nothing is captured)."""

    def moe_stats(self, reset: bool = False) -> Dict[int, Dict[str, int]]:
        """{MoE layer: {forwards, experts, rows}} since the last reset: the distinct routed experts each forward
        used, summed (the expert bytes it streamed); {} where not counted (CUDA, tp)."""

    def close(self) -> None:
        """Release what outlives the object (tp: the worker processes). Idempotent."""


@runtime_checkable
class Drafter(Protocol):
    """The DFlash block drafter as kdtree/decode uses it."""

    block_size: int
    target_layer_ids: List[int]

    def new_cache(self, max_len: int, share: Any = None) -> Any:
        """A context cache of max_len rows (length, max_len, truncate(n)): fresh pages of its target's pool, or the
        pages of `share` (the request's target cache: context row j in the page of latent row j)."""

    def extend(self, cache: Any, hiddens: Mapping[int, np.ndarray]) -> None:
        """Append the context rows of {layer_id: f32[T, D]} (the target's hiddens of target_layer_ids)."""

    def draft(self, cache: Any, bonus: int) -> np.ndarray:
        """One block forward -> logits f32[B-1, V] of the B-1 tokens after `bonus`."""


def build_target(cfg, weights: Mapping[str, Any], ops: Any,
                 all_reduce: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> Target:
    """The target over `weights` (tensor name -> f32 ndarray | Int4Weight; a tp rank's slices with its ordered
    all_reduce): NativeTarget where the library runs whole forwards (ops.native_forward), else K2Model over `ops`."""
    if getattr(ops, "native_forward", False):
        return NativeTarget(cfg, weights, ops, all_reduce=all_reduce)
    return K2Model(cfg, weights, ops, all_reduce=all_reduce)


def build_drafter(cfg, dweights: Mapping[str, Any], target: Target) -> Drafter:
    """The DFlash drafter over `target`'s embeddings, lm_head and ops: NativeDrafter where the library runs its
    forwards (ops.native_drafter_forward), reading the native target's device copies of embed / lm_head when
    there is one (a NativeTarget, or the one of TPModel's rank 0); else DFlashDrafter over the ops."""
    ops = target.ops
    if getattr(ops, "native_drafter_forward", False):
        home = next((t for t in (target, getattr(target, "local", None)) if isinstance(t, NativeTarget)), None)
        return NativeDrafter(cfg, dweights, ops, target.embed_tokens, target.lm_head_w, target=home, pages=target.pages)
    return DFlashDrafter(cfg, dweights, ops, target.embed_tokens, target.lm_head_w, target.pages)


__all__ = ["Drafter", "Target", "build_drafter", "build_target"]
