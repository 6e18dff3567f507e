"""The prefix cache under memory pressure: a paged latent-cache pool (serve.kv_pool_tokens: 40 pages of 16) far
smaller than the working set of many distinct long prompts sharing three stems, decoded batched (max_batch_tokens
small, so prefills span steps and requests that mapped cached pages run while others finish and hand theirs to the
cache). Checked after every scheduler step: eviction never frees a page a request holds (the pages it mapped and
its own), no page is free while a request's table lists it, a request's own pages are nobody else's, the pool's
pages add up (used + cached + free == total); arrivals wait only for free pages; every request finishes with the
tokens of a run without the cache. Then a page held through heavy churn keeps its rows bit for bit.

Run: .venv/bin/python -m pytest -q tests/decode/test_prefix_cache_pressure.py
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kdtree.decode.prefix_cache import PrefixCache
from kdtree.decode.request import Request
from kdtree.decode.scheduler import Scheduler
from kdtree.engine import AR_TREE, Engine
from tests.native_lib import CPU_SKIPPED

TEXT = (Path(json.__file__).parent / "decoder.py").read_text()
BACKENDS = ["numpy"] + ([] if CPU_SKIPPED else ["cpu"])
POOL_PAGES = 40


class CheckedCache(PrefixCache):
    """A PrefixCache that records every evicted page and fails on one a request holds."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.dropped = []

    def _drop(self, leaf):
        assert not self.pool.in_use(leaf.page), "evicted a page a request holds"
        self.dropped.append(leaf.page)
        super()._drop(leaf)


def check_pool(sched: Scheduler, pc: PrefixCache) -> None:
    pool = sched.pages
    free = set(pool._free)
    states = list(sched._state.values())
    tables = [st.cache.pages for st in states if st.cache is not None]
    for st in states:
        if st.cache is None:
            continue
        assert not free & set(int(p) for p in st.cache.pages), "a page a request lists is free"
        mapped = st.cache.frozen // pool.page_rows
        for p in st.cache.pages[:mapped]:                  # mapped from the cache: held by it too, or by the tree
            assert pool.refs[p] >= 2
    owners = Counter(int(p) for t in tables for p in t)
    for st in states:                                      # its own pages (past the mapped ones) are its alone
        if st.cache is not None:
            own = st.cache.pages[st.cache.frozen // pool.page_rows:]
            assert all(owners[int(p)] == 1 for p in own)
            assert st.dcache is None or st.dcache.pages is st.cache.pages    # the drafter's rows: the same pages
    c = pc.page_counts()
    assert c == sched.page_counts() and c["total"] == POOL_PAGES
    assert c["used"] + c["cached"] + c["free"] == c["total"]
    assert c["cached"] <= pc.pages and pc.pages == len(list(pc._walk()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_smaller_than_the_working_set(compose_cfg, backend):
    engine = Engine.from_config(compose_cfg(f"backend={backend}", "tree=ddtree", "tree.width=4", "tree.depth=7",
                                            "tree.budget=8", "load.progress=false", "serve.prefix_cache=false"))
    enc = engine.tokenizer.encode
    stems = [enc(TEXT[600 * k:600 * k + 300])[:64] for k in range(3)]           # 3 shared 64-token stems
    prompts = [stems[i // 4] + enc(TEXT[5000 + 97 * i:5000 + 97 * i + 200])[:40 + 7 * i] for i in range(12)]
    trees = [None, AR_TREE]
    plain = Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                      max_batch_tokens=24, pool_tokens=4096, prefix_cache=None)
    want = []
    for i, p in enumerate(prompts):
        r = plain.submit(Request(list(p), 10, tree=trees[i % 2]))
        plain.drive(r)
        want.append(r.result.tokens)
    pc = CheckedCache(page_tokens=16, max_tokens=POOL_PAGES * 16)   # only the pool's size limits it
    cached = Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                       max_batch_tokens=24, pool_tokens=POOL_PAGES * 16, prefix_cache=pc)
    assert engine.model.pages.total == POOL_PAGES       # ~170 pages of distinct prompts + answers: 4x the pool
    queue, inflight, done = list(range(12)) * 2, [], []  # 2 rounds, 5 in flight (~50 pages: some must wait)
    waited = pinned_evictions = 0
    while queue or inflight:
        while queue and len(inflight) < 5:
            i = queue.pop(0)
            inflight.append((i, cached.submit(Request(list(prompts[i]), 10, tree=trees[i % 2]))))
        held, ev = cached.pool_used > 0, pc.evictions
        cached.step()
        pinned_evictions += (pc.evictions - ev) if held else 0
        waited += cached.waiting > 0
        check_pool(cached, pc)
        done += [x for x in inflight if x[1].done.is_set()]
        inflight = [x for x in inflight if not x[1].done.is_set()]
    for i, r in done:
        assert r.error is None, r.error
        assert r.result.tokens == want[i], f"request {i} (cached {r.result.cached_tokens} tokens)"
    print(f"{backend}: {pc.hits} of {pc.queries} prompt tokens hit, {pc.evictions} pages evicted "
          f"({pinned_evictions} while requests held pages), {waited} steps with a request waiting for pages, "
          f"{sum(r.result.cached_tokens > 0 for _, r in done)} of {len(done)} requests hit")
    assert waited > 0                                  # the pool, not a range, made arrivals wait
    assert pinned_evictions > 0 and pc.hits > 0       # eviction ran while pages were in use, and never took one
    assert len(pc.dropped) == pc.evictions and cached.page_counts()["used"] == 0
    # a page held through churn that evicts everything else keeps its rows, bit for bit
    last = done[-1][0]
    path = pc.lookup(prompts[last], len(prompts[last]) - 1, need_drafter=trees[last % 2] is None)
    pages = [pg.page for pg in path]
    assert pages
    pin = engine.model.new_cache(16 * len(pages), prefix=pages)   # a request mapping them: held
    rows = engine.model.gather_rows(pages, 0, 16 * len(pages))
    n0 = len(pc.dropped)
    for p in [q for q in prompts if q[:64] != prompts[last][:64]][:6]:
        r = cached.submit(Request(list(p), 4, tree=AR_TREE))
        cached.drive(r)
        assert r.error is None
    assert len(pc.dropped) > n0 and not set(pages) & set(pc.dropped[n0:])   # others evicted, never these
    assert all(pg.parent().children.get(pg.key) is pg for pg in path)
    assert np.array_equal(engine.model.gather_rows(pages, 0, 16 * len(pages)), rows)
    pin.release()
    pc.clear()
    assert pc.pages == 0 and pc.page_counts() == {"used": 0, "cached": 0, "free": POOL_PAGES, "total": POOL_PAGES}
