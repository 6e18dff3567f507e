"""An exact prefix cache: a radix tree of committed token prefixes -> their cached latent rows (first version, over
the contiguous latent-cache arena; no paged pool yet: a hit COPIES the rows into the request's own cache).

    pc = PrefixCache(page_tokens=16, max_tokens=8192)
    hit = pc.lookup(prompt, limit=len(prompt) - 1, need_hidden=speculative)   # pages of the longest cached prefix
    rows, hidden = pc.gather(hit)           # f32[n_layers, m, W] and {layer: f32[m, D]} (or None)
    pc.release(hit)                         # the request finished: its pages may be evicted again
    pc.insert(tokens, read_rows, hidden)    # a finished request: prompt + generated tokens, the rows it computed

Nodes are pages of `page_tokens` tokens (a child is keyed by its page's token tuple), so a prefix matches page by
page; a page holds the target's latent rows of its tokens for every layer and, when the request that computed it
was speculative, the target's hidden rows of the drafter's layers (the DFlash drafter's input: a hit rebuilds the
drafter's context from them with the same extend call as a miss, so not even the drafter's cache differs).

Exactness: kdtree's kernels are batch-invariant, so a latent row of position i depends only on tokens [0, i], not on
the chunk it was computed in, the verify block it was accepted from, or its batch: a hit gives the same rows, so the
same logits and tokens, bit for bit (tests/decode/test_prefix_cache.py).

Pages are reference-counted by the requests that mapped them (lookup at admission .. release at finish: "used") and
evicted least recently used (leaves first, never a referenced one) when the cache holds more than `max_tokens`
tokens; page_counts() -> used / cached / free / total (/status, /metrics kdtree_prefix_cache_pages{state}).
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np


class _Page:
    __slots__ = ("key", "parent", "children", "rows", "hidden", "ref", "used")

    def __init__(self, key: Tuple[int, ...], parent: Optional["_Page"], rows: Optional[np.ndarray],
                 hidden: Optional[Dict[int, np.ndarray]]):
        self.key, self.parent = key, parent
        self.children: Dict[Tuple[int, ...], _Page] = {}
        self.rows = rows                  # f32[n_layers, page, W] (None: the root)
        self.hidden = hidden              # {layer: f32[page, D]} or None (computed by an AR request)
        self.ref = 0                      # requests copying from it now
        self.used = 0                     # LRU clock


class PrefixCache:
    def __init__(self, page_tokens: int = 16, max_tokens: int = 8192):
        if int(page_tokens) < 1:
            raise ValueError(f"page_tokens={page_tokens} must be >= 1")
        self.page = int(page_tokens)
        self.max_tokens = int(max_tokens)
        self.root = _Page((), None, None, None)
        self.pages = 0                    # pages held (tokens = pages * page)
        self.bytes = 0
        self.queries = 0                  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0                     # of them served from the cache (prefix_cache_hits)
        self.evictions = 0                # pages evicted
        self._clock = itertools.count(1)

    @property
    def tokens(self) -> int:
        return self.pages * self.page

    def _keys(self, tokens: Sequence[int], n: int):
        p = self.page
        return (tuple(int(t) for t in tokens[i * p:(i + 1) * p]) for i in range(n // p))

    # -- a request's admission -----------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], limit: int, need_hidden: bool = False) -> List[_Page]:
        """The pages of the longest cached prefix of tokens of at most `limit` tokens (whole pages), referenced
        until release(); need_hidden: only pages that hold the drafter's hidden rows. Counts the query."""
        self.queries += len(tokens)
        node, path, now = self.root, [], next(self._clock)
        for key in self._keys(tokens, max(0, min(int(limit), len(tokens)))):
            child = node.children.get(key)
            if child is None or (need_hidden and child.hidden is None):
                break
            child.ref += 1
            child.used = now
            path.append(child)
            node = child
        self.hits += len(path) * self.page
        return path

    def gather(self, path: List[_Page]) -> Tuple[np.ndarray, Optional[Dict[int, np.ndarray]]]:
        """The pages' rows joined: latent f32[n_layers, m, W] and hidden {layer: f32[m, D]} (None if a page lacks
        them)."""
        rows = np.concatenate([pg.rows for pg in path], axis=1)
        hidden = None
        if all(pg.hidden is not None for pg in path):
            hidden = {i: np.concatenate([pg.hidden[i] for pg in path]) for i in path[0].hidden}
        return rows, hidden

    def release(self, path: List[_Page]) -> None:
        for pg in path:
            pg.ref -= 1

    # -- a request's finish ----------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], read_rows: Callable[[int, int], np.ndarray],
               hidden: Optional[Dict[int, np.ndarray]] = None) -> int:
        """Cache the whole pages of tokens (row i of the request's cache = token i): read_rows(start, n) ->
        f32[n_layers, n, W] is called once for the pages not cached yet; hidden {layer: f32[>= len, D]} fills
        pages that lack them. Returns the pages added; then evicts down to max_tokens."""
        n_pages = len(tokens) // self.page
        if n_pages == 0 or self.max_tokens < self.page:
            return 0
        node, now, p = self.root, next(self._clock), self.page
        keys = list(self._keys(tokens, n_pages * p))
        i = 0
        while i < n_pages and keys[i] in node.children:          # already cached: refresh, fill hidden rows
            node = node.children[keys[i]]
            node.used = now
            if node.hidden is None and hidden is not None:
                node.hidden = {l: np.array(h[i * p:(i + 1) * p]) for l, h in hidden.items()}
                self.bytes += sum(h.nbytes for h in node.hidden.values())
            i += 1
        added = 0
        if i < n_pages:
            rows = read_rows(i * p, (n_pages - i) * p)           # f32[n_layers, (n_pages - i) * p, W]
            node.ref += 1                                        # the path being extended is not evicted under it
            base = node
            for j in range(i, n_pages):
                r = np.ascontiguousarray(rows[:, (j - i) * p:(j - i + 1) * p])
                hid = None if hidden is None else {l: np.array(h[j * p:(j + 1) * p]) for l, h in hidden.items()}
                child = _Page(keys[j], node, r, hid)
                child.used = now
                node.children[keys[j]] = child
                self.pages += 1
                self.bytes += r.nbytes + (sum(h.nbytes for h in hid.values()) if hid else 0)
                node, added = child, added + 1
            base.ref -= 1
        self.evict()
        return added

    def evict(self, max_tokens: Optional[int] = None) -> int:
        """Drop least recently used unreferenced leaves until at most max_tokens (default: the budget) are held."""
        limit = self.max_tokens if max_tokens is None else int(max_tokens)
        dropped = 0
        while self.tokens > limit:
            leaf = min((pg for pg in self._walk() if not pg.children and pg.ref == 0), key=lambda pg: pg.used,
                       default=None)
            if leaf is None:                 # every leaf is in use: over budget until they are released
                break
            self._drop(leaf)
            dropped += 1
        self.evictions += dropped
        return dropped

    def _drop(self, leaf: _Page) -> None:
        """Unlink one unreferenced leaf page and free its rows."""
        assert leaf.ref == 0 and not leaf.children, "evicting a page in use"
        del leaf.parent.children[leaf.key]
        self.pages -= 1
        self.bytes -= leaf.rows.nbytes + (sum(h.nbytes for h in leaf.hidden.values()) if leaf.hidden else 0)

    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            pg = stack.pop()
            yield pg
            stack.extend(pg.children.values())

    def page_counts(self) -> Dict[str, int]:
        """Pages by state: used (referenced by a running request: mapped at its admission, held until it finishes;
        never evicted), cached (held, unreferenced: evictable LRU), free (the budget's pages not held), total (the
        budget, max_tokens // page). used + cached + free == total, except while used pages alone pin the cache over
        its budget (then free is 0 and used + cached == pages > total)."""
        used = sum(1 for pg in self._walk() if pg.ref > 0)
        total = max(0, self.max_tokens // self.page)
        return {"used": used, "cached": self.pages - used, "free": max(0, total - self.pages), "total": total}

    def stats(self) -> Dict[str, int]:
        pages = self.page_counts()
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_tokens": self.tokens, "prefix_cache_max_tokens": self.max_tokens,
                "prefix_cache_bytes": self.bytes, "prefix_cache_evictions": self.evictions,
                "prefix_cache_page_tokens": self.page,
                **{f"prefix_cache_pages_{k}": v for k, v in pages.items()}}


__all__ = ["PrefixCache"]
