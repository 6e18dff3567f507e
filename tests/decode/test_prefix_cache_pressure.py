"""The prefix cache under memory pressure: a budget (serve.prefix_cache_tokens) far smaller than the working set of
many distinct long prompts, decoded batched (max_batch_tokens small, so prefills span steps and requests that mapped
cached pages run while others finish and insert). Checked after every scheduler step: eviction never drops a page a
running request mapped (its `used` pages), the page accounting adds up (used + cached + free == total; pages and
bytes equal a walk of the tree), and every request finishes with the tokens of a run without the cache.

Run: .venv/bin/python -m pytest -q tests/decode/test_prefix_cache_pressure.py
"""
from __future__ import annotations

import json
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


class CheckedCache(PrefixCache):
    """A PrefixCache that records every evicted page and fails on one in use."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.dropped = []

    def _drop(self, leaf):
        assert leaf.ref == 0, "evicted a page a running request mapped"
        self.dropped.append(leaf)
        super()._drop(leaf)


def check_accounting(pc: PrefixCache, states) -> None:
    pages = list(pc._walk())
    assert pc.pages == len(pages)
    assert pc.bytes == sum(pg.rows.nbytes + (sum(h.nbytes for h in pg.hidden.values()) if pg.hidden else 0)
                           for pg in pages)
    held = {id(pg) for st in states for pg in st.prefix_path}
    for st in states:                                  # a running request's mapped pages are all still in the tree
        for pg in st.prefix_path:
            assert pg.ref > 0 and pg not in pc.dropped
            node = pg
            while node.parent is not None:
                assert node.parent.children.get(node.key) is node
                node = node.parent
    c = pc.page_counts()
    assert c["used"] == sum(1 for pg in pages if pg.ref > 0) >= len(held)
    assert c["used"] + c["cached"] == pc.pages
    if pc.pages <= c["total"]:
        assert c["used"] + c["cached"] + c["free"] == c["total"]
    else:                                              # only pinned pages may hold the cache over its budget
        assert c["free"] == 0 and c["cached"] == 0        # (a pinned page's ancestors are pinned too)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_cache_many_long_prompts(compose_cfg, backend):
    engine = Engine.from_config(compose_cfg(f"backend={backend}", "tree=ddtree", "tree.width=4", "tree.depth=7",
                                            "tree.budget=8", "load.progress=false", "serve.prefix_cache=false"))
    enc = engine.tokenizer.encode
    stems = [enc(TEXT[600 * k:600 * k + 300])[:64] for k in range(3)]           # 3 shared 64-token stems
    prompts = [stems[i // 4] + enc(TEXT[5000 + 97 * i:5000 + 97 * i + 200])[:40 + 7 * i] for i in range(12)]
    trees = [None, AR_TREE]
    pc = CheckedCache(page_tokens=16, max_tokens=160)        # 10 pages << the working set (~110 pages of 12 prompts)
    cached = Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                       max_batch_tokens=24, pool_tokens=4096, prefix_cache=pc)
    plain = Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                      max_batch_tokens=24, pool_tokens=4096, prefix_cache=None)
    want = []
    for i, p in enumerate(prompts):
        r = plain.submit(Request(list(p), 10, tree=trees[i % 2]))
        plain.drive(r)
        want.append(r.result.tokens)
    queue, inflight, done, pinned_evictions = list(range(12)) * 2, [], [], 0       # 2 rounds, 3 in flight
    while queue or inflight:
        while queue and len(inflight) < 3:
            i = queue.pop(0)
            inflight.append((i, cached.submit(Request(list(prompts[i]), 10, tree=trees[i % 2]))))
        pinned, ev = any(st.prefix_path for st in cached._state.values()), pc.evictions
        cached.step()
        pinned_evictions += (pc.evictions - ev) if pinned else 0
        check_accounting(pc, list(cached._state.values()))
        done += [x for x in inflight if x[1].done.is_set()]
        inflight = [x for x in inflight if not x[1].done.is_set()]
    for i, r in done:
        assert r.error is None, r.error
        assert r.result.tokens == want[i], f"request {i} (cached {r.result.cached_tokens} tokens)"
    print(f"{backend}: {pc.hits} of {pc.queries} prompt tokens hit, {pc.evictions} pages evicted "
          f"({pinned_evictions} while a running request held pages), {sum(r.result.cached_tokens > 0 for _, r in done)}"
          f" of {len(done)} requests hit")
    assert pinned_evictions > 0                        # eviction ran while pages were in use, and never took one
    assert pc.hits > 0 and pc.evictions > 0 and len(pc.dropped) == pc.evictions
    assert pc.tokens <= pc.max_tokens and pc.page_counts()["used"] == 0
    # a page referenced outside any request (an admission's lookup) survives any churn of inserts under the budget
    last = done[-1][0]
    pin = pc.lookup(prompts[last], len(prompts[last]) - 1)
    assert pin
    rows = [pg.rows.copy() for pg in pin]
    for p in [q for q in prompts if q[:64] != prompts[last][:64]][:6]:        # other stems: evict all but the pin
        r = cached.submit(Request(list(p), 4, tree=AR_TREE))
        cached.drive(r)
        assert r.error is None
    assert all(pg.parent.children.get(pg.key) is pg for pg in pin)
    assert all(np.array_equal(a, pg.rows) for a, pg in zip(rows, pin))
    pc.release(pin)
    pc.evict(0)
    assert pc.pages == 0 and pc.bytes == 0 and pc.page_counts() == {"used": 0, "cached": 0, "free": 10, "total": 10}
