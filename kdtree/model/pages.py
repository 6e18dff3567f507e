"""The paged latent-cache pool: which pages of a target's ONE arena are free, who holds the others, and the cache
of one sequence as a page table into it.

    pool = target.pages                        # PagePool(page_rows=16), grows on demand ...
    target.reserve_cache_pool(16384, 16)       # ... or fixed: 1024 pages of 16 rows from now on (the server's)
    cache = target.new_cache(max_len, prefix=[7, 3])   # pages 7 and 3 mapped first (a prefix cache hit: rows 0..31,
                                                       # zero-copy), then fresh pages for the rest; one hold on each
    cache.pages                                # i32[ceil(max_len / 16)] its page table; row j = pages[j // 16], j % 16
    cache.release()                            # its holds dropped: a page nobody else holds is free again

Every target's arena (numpy K2Model, NativeTarget on cpu / cuda, each tensor-parallel rank) is layer-major f32
[n_layers][n_pages][page_rows][L+R] -- page p is the rows of its tokens in every layer's block, so a sequence whose
pages were taken together reads long runs of rows -- and the drafter's context K/V live in pages with the same ids (kdtree/model/drafter.py, native_drafter.py), so one page table serves a request's target and drafter rows.
The pool is plain Python on rank 0: page ids travel with each forward (kd_forward_args.pages), the library keeps no
per-sequence state.

A page is held by every cache whose table lists it and by the prefix cache (kdtree/decode/prefix_cache.py) when it
is one of its radix tree's pages; it is free when nobody holds it. No request waits for contiguous room: any free
pages will do. When free pages run out, take() asks the registered evictors (the prefix cache drops least recently
used pages that only it holds) before it gives up (CachePoolBusy: wait for running requests) or, while the pool is
not reserved, grows the arenas.

Pages are shared read-only: a cache writes only rows >= its `frozen` rows (the pages it mapped from the prefix cache,
and those it handed to it), so a page holds the same bits for as long as anybody holds it.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

from kdtree.errors import CachePoolBusy, ConfigError

DEFAULT_PAGE_ROWS = 16    # tokens per page (serve.prefix_cache_page)


class PagePool:
    """The page ids of one paged arena: a hold count per page and the free ones.

    take(n) -> i32[n] fresh pages (one hold each); hold(ids) / drop(ids): one more / one less holder (the last drop
    frees it). arenas: resize(n_pages, page_rows) callbacks of the arrays indexed by these ids (the target's arena on
    every rank, its drafter's), called whenever the page count or size changes; evictors: callables n -> pages they
    freed (a prefix cache), asked when take() falls short."""

    def __init__(self, page_rows: int = DEFAULT_PAGE_ROWS):
        if int(page_rows) < 1:
            raise ConfigError(f"serve.prefix_cache_page={page_rows}: a page must hold >= 1 token; e.g. 16")
        self.page_rows = int(page_rows)
        self.refs = np.zeros(0, np.int32)        # holders of each page
        self.cached = np.zeros(0, np.int32)      # of them, prefix caches (a page only they hold is evictable)
        self._free: List[int] = []               # free page ids, the lowest last (taken first)
        self.reserved = False                    # True: a fixed size (reserve); False: grows on demand
        self._arenas: List[weakref.WeakMethod] = []
        self._evictors: List[weakref.WeakMethod] = []
        # the engine thread takes and drops pages; a cache collected elsewhere drops its own (its finalizer)
        self._lock = threading.RLock()

    # -- sizes ---------------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return int(self.refs.size)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        return self.total - self.free

    def pages_for(self, rows: int) -> int:
        """Pages holding `rows` rows."""
        return -(-int(rows) // self.page_rows)

    def add_arena(self, resize: Callable[[int, int], None]) -> None:
        """An array indexed by these page ids (a bound method resize(n_pages, page_rows), held weakly): sized now
        and on every later change."""
        with self._lock:
            self._arenas.append(weakref.WeakMethod(resize))
            resize(self.total, self.page_rows)

    def add_evictor(self, evict: Callable[[int], int]) -> None:
        """evict(n) -> pages it freed (a bound method, held weakly): asked when take() falls short."""
        self._evictors.append(weakref.WeakMethod(evict))

    def _resize(self, n_pages: int, page_rows: int) -> None:
        """Every arena to n_pages pages of page_rows rows; the holds of the pages kept are kept."""
        live = []
        for ref in self._arenas:
            resize = ref()
            if resize is not None:
                resize(n_pages, page_rows)
                live.append(ref)
        self._arenas = live
        old = self.total
        if page_rows != self.page_rows:
            self.refs, self.cached, self._free = np.zeros(0, np.int32), np.zeros(0, np.int32), []
            old = 0
        k = min(old, n_pages)
        refs, cached = np.zeros(n_pages, np.int32), np.zeros(n_pages, np.int32)
        refs[:k], cached[:k] = self.refs[:k], self.cached[:k]
        self.refs, self.cached, self.page_rows = refs, cached, int(page_rows)
        self._free = [p for p in self._free if p < n_pages] + list(range(n_pages - 1, old - 1, -1))
        self._free.sort(reverse=True)

    def reserve(self, n_pages: int, page_rows: Optional[int] = None) -> None:
        """A fixed pool of n_pages pages of page_rows rows from now on (take() raises CachePoolBusy past it). To
        shrink or change the page size, cached pages nobody else holds are evicted first; a pool whose pages above
        n_pages are still held keeps its larger size; a new page size needs every page free."""
        n_pages, page_rows = int(n_pages), int(page_rows or self.page_rows)
        if n_pages < 1:
            raise ConfigError(f"serve.kv_pool_tokens gives {n_pages} pages of {page_rows} tokens; give at least one "
                              f"page (serve.kv_pool_tokens >= serve.prefix_cache_page)")
        with self._lock:
            self._reserve(n_pages, page_rows)

    def _reserve(self, n_pages: int, page_rows: int) -> None:
        if (page_rows != self.page_rows and self.held) or np.any(self.refs[n_pages:]):
            self._evict(self.total)                   # a prefix cache's pages go before the pool is resized
        if page_rows != self.page_rows and self.held:
            raise ConfigError(f"the latent-cache pool has {self.held} pages of {self.page_rows} tokens in use; a pool "
                              f"of {page_rows}-token pages (serve.prefix_cache_page) needs them released first")
        busy = np.flatnonzero(self.refs[n_pages:])
        if busy.size:                                 # held pages past the new end: keep the larger pool
            n_pages = max(n_pages, self.total)
        if n_pages != self.total or page_rows != self.page_rows:
            self._resize(n_pages, page_rows)
        self.reserved = True

    # -- holds ---------------------------------------------------------------------------------------------------
    def take(self, n: int) -> np.ndarray:
        """n free pages, one hold each, i32[n]. Short: the evictors free unused cached pages; then a pool that is
        not reserved grows (x2), a reserved one raises CachePoolBusy (the caller waits for running requests)."""
        with self._lock:
            return self._take(int(n))

    def _take(self, n: int) -> np.ndarray:
        if n > self.free:
            self._evict(n - self.free)
        if n > self.free:
            if self.reserved:
                raise CachePoolBusy(f"the latent-cache pool has {self.free} free pages of {self.page_rows} tokens, "
                                    f"{n} asked ({self.total} pages, serve.kv_pool_tokens); wait for running requests "
                                    f"to finish")
            self._resize(max(2 * self.total, self.total + n - self.free, 64), self.page_rows)
        ids = np.array([self._free.pop() for _ in range(n)], np.int32)
        self.refs[ids] += 1
        return ids

    def _evict(self, n: int) -> None:
        live = []
        for ref in self._evictors:
            evict = ref()
            if evict is not None:
                live.append(ref)
                if n > 0:
                    n -= evict(n)
        self._evictors = live

    def hold(self, ids: Iterable[int], cached: bool = False) -> None:
        """One more holder of each page (a cache mapping it; cached: a prefix cache's tree)."""
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, np.int64)
        with self._lock:
            if ids.size and (ids.min() < 0 or ids.max() >= self.total or np.any(self.refs[ids] <= 0)):
                raise ValueError(f"hold({ids.tolist()}): only pages already held may be shared (pool of {self.total})")
            np.add.at(self.refs, ids, 1)
            if cached:
                np.add.at(self.cached, ids, 1)

    def drop(self, ids: Iterable[int], cached: bool = False) -> None:
        """One holder less (the last one frees the page)."""
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, np.int64)
        with self._lock:
            ids = ids[ids < self.total]               # a pool whose page size changed since holds none of them
            np.add.at(self.refs, ids, -1)
            if cached:
                np.add.at(self.cached, ids, -1)
            if np.any(self.refs[ids] < self.cached[ids]) or np.any(self.cached[ids] < 0):
                raise AssertionError(f"drop({ids.tolist()}): a page dropped more often than held")
            freed = [int(p) for p in np.unique(ids) if self.refs[p] == 0]
            if freed:
                self._free.extend(freed)
                self._free.sort(reverse=True)

    def in_use(self, page: int) -> bool:
        """A cache (a request) holds the page, not only prefix caches."""
        return bool(self.refs[page] > self.cached[page])

    def counts(self) -> Dict[str, int]:
        """Pages by state: used (a cache holds it: a running request's own pages and the cached ones it mapped),
        cached (only prefix caches hold it: evictable), free, total. They add up."""
        with self._lock:
            used = int(np.count_nonzero(self.refs > self.cached))
            return {"used": used, "cached": self.held - used, "free": self.free, "total": self.total}


def _drop_pages(pool_ref: "weakref.ref[PagePool]", ids: np.ndarray) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.drop(ids)


class PagedCache:
    """One sequence's cache rows: a page table into the arena of `owner` (a target or a drafter: owner.pages is its
    PagePool; owner.move_rows(table, start, rows) and owner.gather_rows(table, start, n) work on its arena) and how
    many rows are filled (length).

    prefix: pages mapped first (a prefix cache hit: length starts after them); share: another cache of the same pool
    whose page table this one uses too (a request's drafter context lives in its target cache's pages). Rows
    [0, frozen) lie in pages others may hold: truncate / keep never go below them, so those pages never change."""

    def __init__(self, owner, max_len: int, prefix: Sequence[int] = (), share: Optional["PagedCache"] = None):
        pool = owner.pages
        self.owner, self.pool, self.max_len = owner, pool, int(max_len)
        if share is not None:                                 # the same table: one more hold on each of its pages
            if share.pool is not pool:
                raise ValueError("new_cache(share=...): that cache's pages are another pool's")
            self.max_len = min(self.max_len, share.max_len)
            self.pages = share.pages
            pool.hold(self.pages)
            self.length = self.frozen = 0
        else:
            prefix = np.asarray(list(prefix), np.int32)
            n = pool.pages_for(self.max_len)
            if prefix.size > n:
                raise ValueError(f"new_cache: {prefix.size} prefix pages exceed the {n} pages of max_len={max_len}")
            pool.hold(prefix)                                 # mapped before taking: never evicted to make room
            try:
                own = pool.take(n - prefix.size)
            except BaseException:
                pool.drop(prefix)
                raise
            self.pages = np.concatenate([prefix, own]).astype(np.int32)   # i32[n] the page table
            self.length = self.frozen = int(prefix.size) * pool.page_rows
        self._finalizer = weakref.finalize(self, _drop_pages, weakref.ref(pool), self.pages.copy())

    @property
    def page_rows(self) -> int:
        return self.pool.page_rows

    def release(self) -> None:
        """Drop this cache's holds now (a finished request), not when it is collected. Idempotent."""
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def truncate(self, n: int) -> None:
        """Drop rows [n, length) (a rejected verify block; a shared prefill's next sample)."""
        if not self.frozen <= n <= self.length:
            raise ValueError(f"truncate({n}) outside [{self.frozen}, {self.length}] (rows below {self.frozen} are "
                             f"shared pages)")
        self.length = int(n)

    def keep(self, start: int, rows: Iterable[int]) -> None:
        """Keep block rows `rows` (absolute, ascending, >= start) moved contiguously to start..; drop the rest (tree
        compaction: within this cache's own pages)."""
        rows = np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows, dtype=np.int64)
        if start < self.frozen or (rows.size and (rows[0] < start or rows[-1] >= self.length
                                                  or np.any(np.diff(rows) <= 0))):
            raise ValueError(f"keep(start={start}, rows={rows.tolist()}): rows must ascend within "
                             f"[{max(start, self.frozen)}, {self.length})")
        if rows.size and np.any(rows != start + np.arange(rows.size)):
            self.owner.move_rows(self.pages, int(start), rows)
        self.length = int(start) + int(rows.size)

    def read_rows(self, start: int, n: int) -> np.ndarray:
        """Rows [start, start + n) of every layer, a copy f32[n_layers, n, width]."""
        if not 0 <= start <= start + n <= self.length:
            raise ValueError(f"read_rows({start}, {n}) outside [0, {self.length})")
        return self.owner.gather_rows(self.pages, int(start), int(n))

    @property
    def kv(self) -> List[np.ndarray]:
        """Per layer f32[length, width]: the filled rows gathered through the page table (a copy)."""
        return list(self.read_rows(0, self.length))


class PageView:
    """A page table and a length without holds (a tensor-parallel worker's view of rank 0's cache: rank 0's pool
    owns the pages; the same ids index every rank's arena)."""

    def __init__(self, pages: np.ndarray, length: int, page_rows: int):
        self.pages = np.asarray(pages, np.int32)
        self.length, self.frozen = int(length), 0
        self.max_len = int(self.pages.size) * int(page_rows)


def page_rows_of(pages: np.ndarray, page_rows: int, start: int, n: int) -> tuple:
    """(page ids i64[n], rows within the page i64[n]) of a sequence's rows start..start + n through its table."""
    j = np.arange(start, start + n, dtype=np.int64)
    return np.asarray(pages, np.int64)[j // page_rows], j % page_rows


__all__ = ["DEFAULT_PAGE_ROWS", "PagePool", "PageView", "PagedCache", "page_rows_of"]
