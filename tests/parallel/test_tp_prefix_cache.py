"""The exact prefix cache under tensor parallelism: REAL torch.distributed gloo ranks (tp=2: one worker process +
this process as rank 0). The page pool is rank 0's; every rank's arena has its page count, and each forward carries
the page tables, so a hit maps the same pages on every rank (the latent rows are the same bits on every rank), and a
request's tokens with a full hit, a partial hit and no hit are identical (AR, chain, DDTree; greedy and seeded),
fp32 on numpy and INT4 (int4_w4a16) on the native cpu backend.

Run: .venv/bin/python -m pytest -q tests/parallel/test_tp_prefix_cache.py      (~1 min on 2 busy cores)
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kdtree.decode.prefix_cache import PrefixCache
from kdtree.decode.request import Request
from kdtree.decode.sampling import SamplingParams
from kdtree.decode.scheduler import Scheduler
from kdtree.engine import AR_TREE, Engine
from kdtree.pipeline.registry import register_schema as register
from tests.native_lib import CPU_ERROR, CPU_SKIPPED
from tests.procs import wait_gone

CONF = Path(__file__).resolve().parents[2] / "conf"
TEXT = (Path(json.__file__).parent / "decoder.py").read_text()
TREES = {"ddtree": None, "chain": OmegaConf.create({"kind": "chain", "width": 1, "depth": 5, "budget": 5}),
         "ar": AR_TREE}
register()


@pytest.fixture(scope="module", params=[("fp32", "numpy"), ("int4_w4a16", "cpu")], ids=lambda c: f"{c[0]}-{c[1]}")
def tp2(request, tmp_path_factory):
    quant, backend = request.param
    if backend == "cpu" and CPU_SKIPPED:
        pytest.skip(f"libkdtree_cpu.so not usable ({CPU_ERROR}); make native")
    cache = tmp_path_factory.mktemp("tp-prefix-cache")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"cache_dir={cache}", f"quant={quant}", "tp='2'", f"backend={backend}", "tree=ddtree", "tree.width=4",
            "tree.depth=7", "tree.budget=8", "load.progress=false", "serve.prefix_cache=false"])
    engine = Engine.from_config(cfg)
    pids = [w.proc.pid for w in engine.model.workers]
    assert len(pids) == 1
    yield engine
    engine.close()
    assert wait_gone(pids, 10.0) == []


def _sched(engine, pc):
    return Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                     max_batch_tokens=48, pool_tokens=4096, prefix_cache=pc)


def _run(sched, ids, max_new, tree, sampling=None):
    req = sched.submit(Request(list(ids), max_new, sampling=sampling, tree=tree))
    sched.drive(req)
    assert req.error is None, req.error
    return req.result


@pytest.mark.parametrize("kind,sampled", [("ddtree", False), ("chain", True), ("ar", False), ("ddtree", True)])
def test_tp2_hit_partial_miss_same_tokens(tp2, kind, sampled):
    engine, tree = tp2, TREES[kind]
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=99) if sampled else None
    ids = engine.tokenizer.encode(TEXT[1000:1400])[:70]
    pc = PrefixCache(page_tokens=16, max_tokens=4096)
    cached, plain = _sched(engine, pc), _sched(engine, None)
    miss = _run(cached, ids, 16, tree, sp)
    assert miss.cached_tokens == 0
    assert miss.tokens == _run(plain, ids, 16, tree, sp).tokens
    full = _run(cached, ids, 16, tree, sp)
    assert full.cached_tokens == 64 and full.tokens == miss.tokens
    other = list(ids[:40]) + engine.tokenizer.encode(TEXT[3000:3200])[:30]
    part = _run(cached, other, 16, tree, sp)
    assert part.cached_tokens == 32
    assert part.tokens == _run(plain, other, 16, tree, sp).tokens


def test_tp2_mapped_pages_are_the_same_rows_on_every_rank(tp2):
    """A hit maps rank 0's page ids, and every rank's arena holds those pages' rows: a forward after pages mapped
    from another cache gives the logits of a forward after the computed prefix (a worker attending over other rows
    would give rank 0 other partials). Tree compaction (keep) moves the rows on every rank too."""
    engine = tp2
    ids = np.asarray(engine.tokenizer.encode(TEXT[500:600])[:40], np.int32)
    pos = np.arange(40, dtype=np.int32)
    a = engine.model.new_cache(48)
    engine.model.forward(ids[:32], pos[:32], a)
    want, _ = engine.model.forward(ids[32:], pos[32:], a)
    b = engine.model.new_cache(48, prefix=a.pages[:2])         # rows 0..31: a's pages, zero-copy, on every rank
    assert list(b.pages[:2]) == list(a.pages[:2]) and b.length == 32
    got, _ = engine.model.forward(ids[32:], pos[32:], b)
    assert np.array_equal(got, want)
    c = engine.model.new_cache(48, prefix=a.pages[:2])
    engine.model.forward(np.concatenate([ids[32:33], ids[35:37]]), np.array([32, 33, 33]), c,
                         visibility=np.array([[1], [3], [5]], np.uint64))      # a tree: root + two children
    c.keep(32, [32, 34])                                          # keep root + the second child, on every rank
    after, _ = engine.model.forward(ids[37:38], np.array([34]), c)
    d = engine.model.new_cache(48, prefix=a.pages[:2])
    engine.model.forward(np.concatenate([ids[32:33], ids[36:37]]), np.array([32, 33]), d)
    assert np.array_equal(after, engine.model.forward(ids[37:38], np.array([34]), d)[0])
    for x in (a, b, c, d):
        x.release()
