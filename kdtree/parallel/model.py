"""Rank 0's view of a tensor-parallel K2 target: the Target protocol (kdtree/model/target.py), every target op
mirrored on all ranks; each rank's shard is build_target's choice (NativeTarget or K2Model).

    model = launch_tp(cfg, checkpoint, ops)          # kdtree/parallel/launch.py
    cache = model.new_cache(64)                      # pages of rank 0's pool: the same ids index every rank's arena
    logits, hid = model.forward(tokens, positions, cache, visibility, hidden_layers)   # all ranks run it
    logits, argmax, hid = model.forward_batch([(tokens, positions, cache, visibility), ...], hidden_layers)
    cache.keep(start, rows)                          # the row moves mirrored on every rank; truncate: rank 0 only
    model.pages                                      # rank 0's PagePool; its size is every rank's arena's
    model.embed_tokens / lm_head_w / ops / cfg       # rank 0 only (replicated; the drafter shares them)
    model.close()                                    # shutdown to every worker, reap them, leave the group

kdtree/decode (AR, DDTree) and the drafter run unchanged on rank 0. The page pool lives on rank 0 alone: every
forward carries each sequence's page table and length to the workers, whose arenas are rank 0's size (so a prefix
cache hit maps the same pages on every rank; the latent rows are the same bits on every rank). Each command is first
applied (or checked) on rank 0, so an invalid argument raises here before any worker sees it; a failure on a worker
or in a collective marks the model broken (TPError on every later call; restart the engine).
"""
from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional

import numpy as np

from kdtree.errors import ConfigError, KdtreeError
from kdtree.model.derived import check_context, check_seq
from kdtree.model.k2 import NO_GRAPHS
from kdtree.model.pages import DEFAULT_PAGE_ROWS, PagedCache
from kdtree.parallel.comm import leave_group


class TPError(KdtreeError):
    """A tensor-parallel rank failed: which rank, and its one-line reason."""


class TPCache(PagedCache):
    """A sequence's cache under tensor parallelism: pages of rank 0's pool (TPModel.pages); row moves (keep) are
    mirrored on every rank's arena by TPModel.move_rows, the length is rank 0's and travels with each forward."""


class TPModel:
    """The Target protocol over rank 0's shard (`local`: build_target's NativeTarget or K2Model, with the ordered
    all-reduce) and the workers."""

    def __init__(self, local, workers: List, tp: int, bytes_read_per_rank: List[int], store=None):
        self.local, self.workers, self.tp = local, workers, tp   # workers: launch._Worker of ranks 1..N-1
        self._store = store                    # the rendezvous TCPStore lives as long as the group
        self.bytes_read_per_rank = bytes_read_per_rank
        self._lock = threading.RLock()
        self._broken: Optional[str] = None
        self._closed = False
        self.pages.add_arena(self._resize_workers)   # every rank's arena has rank 0's page count

    # -- replicated pieces: rank 0 only -----------------------------------------------------------------
    cfg = property(lambda self: self.local.cfg)
    ops = property(lambda self: self.local.ops)
    embed_tokens = property(lambda self: self.local.embed_tokens)
    lm_head_w = property(lambda self: self.local.lm_head_w)
    pages = property(lambda self: self.local.pages)   # rank 0's pool: its ids index every rank's arena

    def new_cache(self, max_len: int, prefix=()) -> TPCache:
        """Pages of rank 0's pool (`prefix` mapped first); the workers learn its table with each forward."""
        check_context(self.cfg, max_len)
        return TPCache(self, max_len, prefix)

    def gather_rows(self, pages, start: int, n: int) -> np.ndarray:
        """Rank 0's rows f32[n_layers, n, width] (the latent rows are the same on every rank: q_a/kv_a and the
        norms are replicated, the residual stream is all-reduced in rank order)."""
        return self.local.gather_rows(pages, start, n)

    # -- mirrored on every rank ------------------------------------------------------------------------
    def move_rows(self, pages, start: int, rows) -> None:
        """Tree compaction on every rank's arena (rank 0 first: a bad argument raises before any worker sees it)."""
        rows = np.asarray(rows, np.int64)
        with self._lock:
            self.local.move_rows(pages, start, rows)
            self._send("keep", np.asarray(pages, np.int32), int(start), rows)

    def _resize_workers(self, n_pages: int, page_rows: int) -> None:
        if n_pages and self.workers:
            with self._lock:
                self._send("pages", int(n_pages), int(page_rows))

    def forward(self, tokens, positions, cache: TPCache, visibility=None, hidden_layers=()):
        """The shard's forward on every rank; rank 0's logits f32[T, V] and hiddens {layer: f32[T, D]}."""
        tokens = np.asarray(tokens, np.int32)
        positions = np.asarray(positions, np.int32)
        hidden_layers = tuple(int(i) for i in hidden_layers)
        T = tokens.shape[0]
        # the checks the shard's forward makes, made before any rank starts (a rank raising alone would hang the rest)
        if tokens.ndim != 1 or positions.shape != (T,):
            raise ValueError(f"positions shape {positions.shape} != tokens shape ({T},)")
        if cache.length + T > cache.max_len:
            raise ConfigError(f"latent cache of {cache.max_len} rows cannot hold {cache.length} + {T} tokens; "
                              f"create it with a larger max_len (prompt + max_new_tokens + tree budget)")
        if visibility is not None:
            visibility = np.asarray(visibility, np.uint64)
            if visibility.shape != (T, (T + 63) // 64):
                raise ValueError(f"visibility shape {visibility.shape} != ({T}, {(T + 63) // 64})")
        with self._lock:
            self._send("forward", cache.pages, int(cache.length), tokens, positions, visibility, hidden_layers)
            try:
                return self.local.forward(tokens, positions, cache, visibility=visibility, hidden_layers=hidden_layers)
            except Exception as e:
                raise self._fail(f"forward on rank 0: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def forward_batch(self, seqs, hidden_layers=()):
        """The shard's forward_batch on every rank: seqs = [(tokens, positions, TPCache, visibility)]; rank 0's
        logits f32[N, V], argmax i32[N] and hiddens {layer: f32[N, D]}."""
        hidden_layers = tuple(int(i) for i in hidden_layers)
        local, remote = [], []
        for s, (tokens, positions, cache, visibility) in enumerate(seqs):
            # every target's per-sequence checks, made before any rank starts (a rank raising alone would hang the rest)
            t, p, _, v = check_seq(s, tokens, positions, cache, visibility)
            v = None if v is None else np.asarray(v, np.uint64)
            local.append((t, p, cache, v))
            remote.append((cache.pages, int(cache.length), t.astype(np.int32), p.astype(np.int32), v))
        if not local or len({id(c) for _, _, c, _ in local}) != len(local):
            raise ValueError("forward_batch: pass at least one sequence, each with its own cache")
        with self._lock:
            self._send("forward_batch", remote, hidden_layers)
            try:
                return self.local.forward_batch(local, hidden_layers)
            except Exception as e:
                raise self._fail(f"forward_batch on rank 0: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}")

    def attach_device_collective(self) -> bool:
        """backend=cuda: every rank moves its all-reduce onto the forward's stream (NCCL; the shard's method). launch_tp
        calls it once every rank has loaded: its setup is a collective, which a rank done loading minutes before the
        slowest one would otherwise enter alone and leave at tp.timeout_s. True when NCCL is on the stream."""
        with self._lock:
            self._send("attach_device_collective")
            return self.local.attach_device_collective()

    def reserve_cache_pool(self, rows: int, page_rows: int = DEFAULT_PAGE_ROWS) -> bool:
        """Rank 0's pool reserved; every rank's arena follows its size (_resize_workers). True."""
        return self.local.reserve_cache_pool(rows, page_rows)

    def graph_rows(self, rows: Iterable[int]) -> bool:
        """False: the tensor-parallel forward is not captured as CUDA graphs from here."""
        return False

    def graph_stats(self) -> Dict[str, float]:
        return dict(NO_GRAPHS)

    def moe_stats(self, reset: bool = False) -> Dict[int, Dict[str, int]]:
        """{}: the ranks count their own forwards; not gathered here."""
        return {}

    # -- plumbing --------------------------------------------------------------------------------------
    def _send(self, op: str, *args) -> None:
        if self._closed:
            raise TPError(f"tensor-parallel model (tp={self.tp}) is closed; build a new engine")
        if self._broken:
            raise TPError(f"tensor-parallel model (tp={self.tp}) is broken ({self._broken}); restart the engine")
        for w in self.workers:
            try:
                w.conn.send((op, args))
            except OSError as e:
                raise self._fail(f"sending {op} to rank {w.rank}: {e}")

    def _fail(self, what: str) -> TPError:
        """Mark broken; the error names the first worker that reported or exited, else `what`."""
        reason = what
        for w in self.workers:
            msg = w.last_words()
            if msg:
                reason = f"rank {w.rank}: {msg}"
                break
        self._broken = reason
        return TPError(f"tensor-parallel model (tp={self.tp}) failed: {reason}; restart the engine")

    def close(self, timeout_s: float = 10.0) -> None:
        """Shut the workers down (shutdown, then SIGKILL after timeout_s) and leave the process group. Idempotent."""
        acquired = self._lock.acquire(timeout=timeout_s)  # a forward stuck in a collective must not block close
        try:
            if self._closed:
                return
            self._closed = True
            for w in self.workers:
                try:
                    w.conn.send(("shutdown", ()))
                except OSError:
                    pass
            for w in self.workers:
                w.stop(timeout_s)
            leave_group()
            self._store = None
        finally:
            if acquired:
                self._lock.release()

    @property
    def closed(self) -> bool:
        return self._closed
