"""An exact prefix cache: a radix tree of committed token prefixes -> the pages of the paged latent-cache pool that
hold their rows (kdtree/model/pages.py). A hit maps those pages into the new request's page table: zero-copy.

    pc = PrefixCache(page_tokens=16, max_tokens=8192)
    pc.attach(model.pages)                  # the pool its pages are ids of (the scheduler does it)
    path = pc.lookup(prompt, limit=len(prompt) - 1, need_drafter=speculative)   # nodes of the longest cached prefix
    cache = model.new_cache(need, prefix=[node.page for node in path])   # mapped, one more hold each
    pc.count(len(prompt), len(path) * 16)   # the query and its hit (vLLM's prefix_cache_queries / _hits)
    pc.insert(tokens, cache.pages, drafter_rows)   # a finished request: its whole pages of prompt + generated tokens
    cache.release(); pc.evict()             # its other pages free; the tree back under max_tokens

Nodes are pages of `page_tokens` tokens (a child is keyed by its page's token tuple), so a prefix matches page by
page. A node is one page of the pool: the target's latent rows of its tokens on every rank and, where `drafter` is
set, the drafter's context rows of the same positions (a speculative request's hit maps both; a page computed by an
AR request lacks them, so a speculative lookup stops before it).

Exactness: kdtree's kernels are batch-invariant, so a latent row of position i depends only on tokens [0, i], not on
the chunk it was computed in, the verify block it was accepted from, its batch or its page: a hit gives the same
rows, so the same logits and tokens, bit for bit (tests/decode/test_prefix_cache.py). Hits are whole pages of at
most prompt - 1 tokens: the request writes only rows after them, into pages of its own, so a cached page never
changes (no copy-on-write needed).

Holds: the tree holds one pool hold per node; a request that maps a node's page holds it too (its cache). A page is
"used" while a request holds it, "cached" while only the tree does (evictable: least recently used leaves first,
when the pool runs short of free pages or the tree holds more than max_tokens tokens), "free" when nobody does.
page_counts() -> used / cached / free / total of the POOL (/status, /metrics kdtree_prefix_cache_pages{state}).
"""
from __future__ import annotations

import heapq
import itertools
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from kdtree.errors import ConfigError


class _Page:
    __slots__ = ("key", "parent", "children", "page", "drafter", "used", "__weakref__")

    def __init__(self, key: Tuple[int, ...], parent: Optional["_Page"], page: int, drafter: bool):
        self.key = key
        self.parent = None if parent is None else weakref.ref(parent)   # no cycle: a dropped cache frees at once
        self.children: Dict[Tuple[int, ...], _Page] = {}
        self.page = page                  # the pool page holding its rows (-1: the root)
        self.drafter = drafter            # its page holds the drafter's context rows too
        self.used = 0                     # LRU clock


def _drop_held(pool_ref, held: Dict[int, int]) -> None:
    """A PrefixCache gone: its holds on the pool go with it."""
    pool = pool_ref() if pool_ref is not None else None
    if pool is not None and held:
        pool.drop(np.fromiter(held.keys(), np.int64), cached=True)
    held.clear()


class PrefixCache:
    def __init__(self, page_tokens: int = 16, max_tokens: int = 8192):
        if int(page_tokens) < 1:
            raise ValueError(f"page_tokens={page_tokens} must be >= 1")
        self.page = int(page_tokens)
        self.max_tokens = int(max_tokens)
        self.root = _Page((), None, -1, True)
        self.pool = None                  # the PagePool (attach)
        self._held: Dict[int, int] = {}   # page -> 1 for every node's page (what the finalizer drops)
        self._finalizer = None
        self.queries = 0                  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0                     # of them served from the cache (prefix_cache_hits)
        self.evictions = 0                # pages evicted
        self._clock = itertools.count(1)

    def attach(self, pool) -> "PrefixCache":
        """Bind to the pool whose page ids the nodes hold (once; the same pool again is a no-op): its pages must be
        page_tokens rows, and it asks this cache to evict when it runs short."""
        if self.pool is pool:
            return self
        if self.pool is not None:
            raise ConfigError("this prefix cache already holds pages of another model's pool; make one per engine")
        if pool.page_rows != self.page:
            raise ConfigError(f"serve.prefix_cache_page={self.page} but the latent-cache pool has pages of "
                              f"{pool.page_rows} tokens; the prefix cache's pages are the pool's: use the same size")
        self.pool = pool
        pool.add_evictor(self.evict_pages)
        self._finalizer = weakref.finalize(self, _drop_held, weakref.ref(pool), self._held)
        return self

    @property
    def pages(self) -> int:
        """Pages the tree holds."""
        return len(self._held)

    @property
    def tokens(self) -> int:
        return self.pages * self.page

    def _keys(self, tokens: Sequence[int], n: int):
        p = self.page
        return (tuple(int(t) for t in tokens[i * p:(i + 1) * p]) for i in range(n // p))

    # -- a request's admission -----------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], limit: int, need_drafter: bool = False) -> List[_Page]:
        """The nodes of the longest cached prefix of tokens of at most `limit` tokens (whole pages); need_drafter:
        only pages that hold the drafter's context rows too. Map them with new_cache(prefix=[n.page for n in
        path]) (which holds them); nothing is held or counted here (count() once the request is admitted)."""
        node, path, now = self.root, [], next(self._clock)
        for key in self._keys(tokens, max(0, min(int(limit), len(tokens)))):
            child = node.children.get(key)
            if child is None or (need_drafter and not child.drafter):
                break
            child.used = now
            path.append(child)
            node = child
        return path

    def count(self, queried: int, hit: int) -> None:
        """An admitted request's prompt tokens looked up and served from the cache."""
        self.queries += int(queried)
        self.hits += int(hit)

    # -- a request's finish ----------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], drafter_rows: int = 0) -> int:
        """Cache the whole pages of tokens (row i of the request's cache = token i, in pages[i // page_tokens]): the
        tree takes a hold on each page it did not have (zero-copy). drafter_rows: the request's drafter context
        rows (its pages before drafter_rows // page_tokens hold them too). A cached page lacking drafter rows is
        replaced by the request's page that has them (the same latent bits). Returns the pages added. The request
        still holds its pages here: evict() after it released them brings the tree back under max_tokens."""
        if self.pool is None:
            raise ConfigError("PrefixCache.insert before attach(pool): the scheduler attaches it to the model's pool")
        n_pages = min(len(tokens) // self.page, len(pages))
        if n_pages == 0 or self.max_tokens < self.page:
            return 0
        node, now, added = self.root, next(self._clock), 0
        for j, key in enumerate(self._keys(tokens, n_pages * self.page)):
            page, has_d = int(pages[j]), int(drafter_rows) >= (j + 1) * self.page
            child = node.children.get(key)
            if child is None:
                child = _Page(key, node, page, has_d)
                node.children[key] = child
                self._hold(page)
                added += 1
            elif has_d and not child.drafter and child.page != page:   # the same latent rows, plus the drafter's
                self._hold(page)
                self._release(child.page)
                child.page, child.drafter = page, True
            child.used = now
            node = child
        return added

    def _hold(self, page: int) -> None:
        self.pool.hold([page], cached=True)
        self._held[page] = 1

    def _release(self, page: int) -> None:
        del self._held[page]
        self.pool.drop([page], cached=True)

    # -- eviction --------------------------------------------------------------------------------------------
    def _in_use(self, pg: _Page) -> bool:
        """A request holds its page (mapped by a running request, or the cache it came from)."""
        return self.pool.in_use(pg.page)

    def _evict_lru(self, enough) -> int:
        """Drop least recently used leaves nobody else holds until enough() (a drop may make its parent a leaf)."""
        if enough():
            return 0
        heap = [(pg.used, id(pg), pg) for pg in self._walk() if not pg.children and not self._in_use(pg)]
        heapq.heapify(heap)
        dropped = 0
        while heap and not enough():
            _, _, leaf = heapq.heappop(heap)
            if leaf.children or self._in_use(leaf):
                continue
            parent = leaf.parent()
            self._drop(leaf)
            dropped += 1
            if parent is not None and parent is not self.root and not parent.children and not self._in_use(parent):
                heapq.heappush(heap, (parent.used, id(parent), parent))
        self.evictions += dropped
        return dropped

    def evict(self, max_tokens: Optional[int] = None) -> int:
        """Drop least recently used leaves that no request holds until at most max_tokens (default: the budget) are
        held."""
        limit = self.max_tokens if max_tokens is None else int(max_tokens)
        return self._evict_lru(lambda: self.tokens <= limit)

    def evict_pages(self, n: int) -> int:
        """The pool is short of n free pages: drop least recently used cached pages (leaves no request holds) until
        n are free or none is left. Returns the pages freed."""
        free0 = self.pool.free
        self._evict_lru(lambda: self.pool.free - free0 >= n)
        return self.pool.free - free0

    def _drop(self, leaf: _Page) -> None:
        """Unlink one leaf no request holds and give its page back."""
        assert not leaf.children and not self._in_use(leaf), "evicting a page in use"
        del leaf.parent().children[leaf.key]
        self._release(leaf.page)

    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            pg = stack.pop()
            yield pg
            stack.extend(pg.children.values())

    def clear(self) -> None:
        """Drop every page no request holds (the whole tree when nothing runs)."""
        self.evict(0)

    # -- what /status and /metrics show ------------------------------------------------------------------------
    def page_counts(self) -> Dict[str, int]:
        """The POOL's pages by state: used (held by a running request: its own pages and the cached ones it mapped),
        cached (held by prefix caches alone: evictable), free, total. used + cached + free == total."""
        return pool_page_counts(self.pool)

    def stats(self) -> Dict[str, int]:
        pages = self.page_counts()
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_tokens": self.tokens, "prefix_cache_max_tokens": self.max_tokens,
                "prefix_cache_evictions": self.evictions, "prefix_cache_page_tokens": self.page,
                **{f"prefix_cache_pages_{k}": v for k, v in pages.items()}}


def pool_page_counts(pool) -> Dict[str, int]:
    """A PagePool's pages (PagePool.counts), zeros before a pool is attached."""
    if pool is None:
        return {"used": 0, "cached": 0, "free": 0, "total": 0}
    return pool.counts()


__all__ = ["PrefixCache", "pool_page_counts"]
