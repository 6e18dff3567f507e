"""The exact prefix cache (kdtree/decode/prefix_cache.py) over the paged latent-cache pool (kdtree/model/pages.py): a
request whose prompt extends a finished request's prompt + answer maps the cached pages (the target's latent rows and
the drafter's context rows) into its page table -- zero-copy: the pages are shared, not copied -- and prefills only
the rest, and its tokens are bit-identical to a run without the cache: AR, chain and DDTree, greedy and seeded
sampling, numpy and the native cpu backend, fp32 and INT4 (int4_w4a16), with a full-prompt hit, a partial hit and a
miss, alone and batched; a prefix's latent rows prefilled in chunks of 1, 7, 64 and 512 rows are bit-identical
(tp=2: tests/parallel/test_tp_prefix_cache.py). Also the radix tree itself: page-granular matching, the P - 1 limit,
LRU eviction under the budget that never drops a page a request holds.

Run: .venv/bin/python -m pytest -q tests/decode/test_prefix_cache.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.decode.prefix_cache import PrefixCache
from kdtree.decode.request import Request
from kdtree.decode.sampling import SamplingParams
from kdtree.decode.scheduler import Scheduler
from kdtree.engine import AR_TREE, Engine
from kdtree.model.pages import PagePool
from tests.native_lib import CPU_SKIPPED

TEXT = (Path(json.__file__).parent / "decoder.py").read_text()
TREES = {"ddtree": None, "chain": OmegaConf.create({"kind": "chain", "width": 1, "depth": 5, "budget": 5}),
         "ar": AR_TREE}
BACKENDS = ["numpy"] + ([] if CPU_SKIPPED else ["cpu"])
_engines = {}


def engine_for(compose_cfg, backend, quant="fp32") -> Engine:
    if (backend, quant) not in _engines:
        _engines[backend, quant] = Engine.from_config(compose_cfg(
            f"backend={backend}", f"quant={quant}", "tree=ddtree", "tree.width=4", "tree.depth=7", "tree.budget=8",
            "load.progress=false", "serve.prefix_cache=false"))
    return _engines[backend, quant]


def run(engine, sched, ids, max_new, tree, sampling=None):
    req = sched.submit(Request(list(ids), max_new, sampling=sampling, tree=tree))
    sched.drive(req)
    assert req.error is None, req.error
    return req.result


def sched_for(engine, pc):
    return Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                     max_batch_tokens=48, pool_tokens=4096, prefix_cache=pc)


QUANTS = ["fp32", "int4_w4a16"]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["ddtree", "chain", "ar"])
@pytest.mark.parametrize("sampled", [False, True])
def test_hit_same_tokens(compose_cfg, backend, kind, sampled, quant):
    engine = engine_for(compose_cfg, backend, quant)
    tree = TREES[kind]
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1234) if sampled else None
    ids = engine.tokenizer.encode(TEXT[1000:1400])[:70]
    plain = sched_for(engine, None)
    pc = PrefixCache(page_tokens=16, max_tokens=4096)
    cached = sched_for(engine, pc)
    first = run(engine, cached, ids, 20, tree, sp)             # a miss: fills the cache with prompt + answer
    assert first.cached_tokens == 0 and first.prefilled_tokens == len(ids)
    assert first.tokens == run(engine, plain, ids, 20, tree, sp).tokens
    # the same prompt again: a full-prompt hit (whole pages, the last prompt token is recomputed)
    again = run(engine, cached, ids, 20, tree, sp)
    assert again.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert again.prefilled_tokens == len(ids) - again.cached_tokens
    assert again.tokens == first.tokens
    # a second turn: prompt + answer + more text hits past the first prompt (the answer's rows are cached too)
    turn2 = list(ids) + list(first.tokens) + engine.tokenizer.encode(TEXT[2000:2100])[:13]
    hit = run(engine, cached, turn2, 16, tree, sp)
    assert hit.cached_tokens >= (len(ids) + len(first.tokens) - 1) // 16 * 16 - 16
    assert hit.cached_tokens > again.cached_tokens
    assert hit.tokens == run(engine, plain, turn2, 16, tree, sp).tokens
    # a partial hit: a prompt sharing only the first 40 tokens
    other = list(ids[:40]) + engine.tokenizer.encode(TEXT[3000:3200])[:30]
    part = run(engine, cached, other, 16, tree, sp)
    assert part.cached_tokens == 32
    assert part.tokens == run(engine, plain, other, 16, tree, sp).tokens
    assert pc.hits == again.cached_tokens + hit.cached_tokens + part.cached_tokens
    assert pc.queries == len(ids) * 2 + len(turn2) + len(other)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_bit_identical(compose_cfg, backend):
    """The cached pages a hit maps hold the rows a miss computes, bit for bit, every layer."""
    engine = engine_for(compose_cfg, backend)
    ids = engine.tokenizer.encode(TEXT[500:900])[:50]
    pc = PrefixCache(page_tokens=16)
    s = sched_for(engine, pc)
    run(engine, s, ids, 4, AR_TREE)
    path = pc.lookup(ids, len(ids) - 1)
    rows = engine.model.gather_rows([pg.page for pg in path], 0, 16 * len(path))   # the pages themselves
    cache = engine.model.new_cache(64)
    for a in range(0, len(ids), 7):                      # the miss, prefilled in chunks of 7 rows
        t = np.asarray(ids[a:a + 7], np.int32)
        engine.model.forward(t, np.arange(a, a + t.size, dtype=np.int32), cache)
    assert np.array_equal(cache.read_rows(0, rows.shape[1]), rows)
    if hasattr(cache, "release"):
        cache.release()


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_bit_identical_across_prefill_chunks(compose_cfg, backend, quant):
    """A prefix's latent rows prefilled in chunks of 1, 7, 64 and 512 rows are bit-identical (every layer), and
    equal to the rows the prefix cache holds for it: the premise of an exact cache (batch-invariant kernels)."""
    engine = engine_for(compose_cfg, backend, quant)
    ids = (engine.tokenizer.encode(TEXT) * 2)[:600]
    got = {}
    for chunk in (1, 7, 64, 512):
        cache = engine.model.new_cache(len(ids))
        for a in range(0, len(ids), chunk):
            t = np.asarray(ids[a:a + chunk], np.int32)
            engine.model.forward(t, np.arange(a, a + t.size, dtype=np.int32), cache)
        got[chunk] = cache.read_rows(0, len(ids))
        if hasattr(cache, "release"):
            cache.release()
    for chunk in (7, 64, 512):
        assert np.array_equal(got[chunk], got[1]), f"chunk {chunk} rows differ from chunk 1 ({backend}, {quant})"
    pc = PrefixCache(page_tokens=16)
    run(engine, sched_for(engine, pc), ids[:520], 1, AR_TREE)       # a max_batch_tokens=48 prefill (chunks of 48)
    path = pc.lookup(ids, 520)
    rows = engine.model.gather_rows([pg.page for pg in path], 0, 16 * len(path))
    assert rows.shape[1] == 512 and np.array_equal(rows, got[1][:, :512])


def test_radix_tree_pages_and_eviction():
    """The tree over a pool of 4-token pages: page-granular matching, the P - 1 limit, holds (a node holds its page;
    a request's cache holds the ones it mapped), LRU eviction under the budget that never drops a page a request
    holds, and the pool's pages by state adding up."""
    pool = PagePool(page_rows=4)
    pool.reserve(8)
    pc = PrefixCache(page_tokens=4, max_tokens=12).attach(pool)
    first = pool.take(3)                                    # a finished request's table: 10 tokens in 3 pages
    assert pc.insert(list(range(10)), first) == 2           # 2 whole pages: the tree holds pages 0 and 1
    pool.drop(first)                                        # the request released: page 2 is free again
    assert pc.tokens == 8 and pool.free == 6 and list(pool.refs[:3]) == [1, 1, 0]
    path = pc.lookup(list(range(10)), 9)
    assert [pg.page for pg in path] == [0, 1] and pc.page_counts() == {"used": 0, "cached": 2, "free": 6, "total": 8}
    assert len(pc.lookup(list(range(8)), 7)) == 1          # at most P - 1 tokens: 1 page of a 2-page prompt
    assert pc.lookup([0, 1, 2, 3], 3) == []                 # limit 3 < one page
    pool.hold([0, 1])                                       # a running request maps both (new_cache(prefix=...))
    assert pc.page_counts() == {"used": 2, "cached": 0, "free": 6, "total": 8}
    other = pool.take(2)                                    # another request: [9 9 9 9 8 8 8 8]
    assert pc.insert([9, 9, 9, 9, 8, 8, 8, 8], other) == 2
    pool.drop(other)
    assert pc.evict() == 1 and pc.tokens == 12              # 16 > 12: one leaf evicted, not one a request holds
    assert (0, 1, 2, 3) in pc.root.children and (4, 5, 6, 7) in pc.root.children[(0, 1, 2, 3)].children
    assert pc.evictions == 1 and pool.refs[0] == pool.refs[1] == 2
    assert pc.evict_pages(8) == 1                           # pool pressure: only the unheld [9 9 9 9] page goes
    pool.drop([0, 1])                                       # the request finished
    pc.clear()
    assert pc.tokens == 0 and pool.free == 8 and pc.page_counts() == {"used": 0, "cached": 0, "free": 8, "total": 8}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hit_maps_the_cached_pages_zero_copy(compose_cfg, backend):
    """A hit takes no copy: two requests running at once map the very pages the cache holds (their page tables start
    with the tree's pages, the speculative one's drafter context uses the same table), each of those pages held by
    the tree and both requests (and the drafter context), so the pool holds the prefix once and only their own rows take new pages; and both
    get the tokens of the uncached runs."""
    engine = engine_for(compose_cfg, backend)
    enc, pool = engine.tokenizer.encode, engine.model.pages
    base = enc(TEXT[4000:4300])[:48]                                  # 3 whole pages
    pc = PrefixCache(page_tokens=16)
    cached, plain = sched_for(engine, pc), sched_for(engine, None)
    run(engine, cached, base, 6, None)                                # a DDTree miss fills the cache
    prompts = [base + enc(TEXT[6000:6100])[:9], base + enc(TEXT[6200:6300])[:11]]
    trees = [TREES["ddtree"], TREES["ar"]]
    free0 = pool.free
    reqs = [cached.submit(Request(list(p), 8, tree=t)) for p, t in zip(prompts, trees)]
    cached.step()                                                     # both admitted (their prefills begin)
    states = [cached._state[id(r)] for r in reqs]
    shared = [pg.page for pg in pc.lookup(prompts[0], len(prompts[0]) - 1, need_drafter=True)]
    assert len(shared) == 3
    for st in states:
        assert list(st.cache.pages[:3]) == shared                     # the cached pages themselves, mapped
    assert states[0].dcache.pages is states[0].cache.pages            # the drafter's context rows: the same pages
    assert [int(pool.refs[p]) for p in shared] == [4, 4, 4]           # the tree + both caches + the drafter's context
    assert free0 - pool.free == sum(len(st.cache.pages) - 3 for st in states)   # only their own pages were taken
    while cached.step():
        pass
    for r, p, t in zip(reqs, prompts, trees):
        assert r.error is None and r.result.cached_tokens == 48
        assert r.result.tokens == run(engine, plain, p, 8, t).tokens
    assert [int(pool.refs[p]) for p in shared] == [1, 1, 1]           # the tree's again


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_and_n_samples_hit_same_tokens(compose_cfg, backend):
    """Requests sharing a cached prefix, decoded together, and n samples (one shared prefill that hit the cache)
    give the tokens of the uncached runs."""
    from kdtree.decode import generate_n
    engine = engine_for(compose_cfg, backend)
    base = engine.tokenizer.encode(TEXT[4000:4300])[:48]
    pc = PrefixCache(page_tokens=16)
    cached, plain = sched_for(engine, pc), sched_for(engine, None)
    run(engine, cached, base, 6, None)                         # warms the cache with base + answer
    prompts = [base + engine.tokenizer.encode(TEXT[5000 + 40 * i:5000 + 40 * i + 30])[:9 + i] for i in range(4)]
    trees = [TREES["ddtree"], TREES["chain"], TREES["ar"], TREES["ddtree"]]
    reqs = [cached.submit(Request(list(p), 12, tree=t)) for p, t in zip(prompts, trees)]
    for r in reqs:
        cached.drive(r)
    for r, p, t in zip(reqs, prompts, trees):
        assert r.error is None and r.result.cached_tokens == 48        # base: 3 whole pages
        assert r.result.tokens == run(engine, plain, p, 12, t).tokens
    sp = SamplingParams(temperature=0.9, seed=7, n=3)
    got = generate_n(engine.model, engine.drafter, engine.cfg.tree, prompts[0], 10, sp, eos_id=engine.eos_id,
                     scheduler=cached)
    want = generate_n(engine.model, engine.drafter, engine.cfg.tree, prompts[0], 10, sp, eos_id=engine.eos_id,
                      scheduler=plain)
    assert got[0].cached_tokens > 0
    assert [g.tokens for g in got] == [w.tokens for w in want]
