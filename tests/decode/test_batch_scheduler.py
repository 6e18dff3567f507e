"""Continuous batching is exact under load: with random arrival steps, mixed prompt and output lengths, mixed trees
(ddtree, chain, ar), chunked prefill, a small cache pool (requests wait), multi-token stop strings and
cancellations mid-generation, every request's tokens, finish reason and acceptance lengths equal its solo run
(Engine.generate), on numpy and the native cpu backend, fp32 and INT4, on the trained tiny model.
Also: admission (context_length_exceeded, waiting for the pool), the wall-clock limit, cancellation within one step.

Run: .venv/bin/python -m pytest -q tests/decode/test_batch_scheduler.py
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.backends import native
from kdtree.decode.request import ContextLengthExceeded, Request, RequestCancelled, RequestTimeout
from kdtree.decode.scheduler import Scheduler
from kdtree.engine import AR_TREE, Engine
from tests.native_lib import CPU_SKIPPED

TEXT = (Path(json.__file__).parent / "decoder.py").read_text()   # source text like the tiny model's corpus
TREES = {"ddtree": None,                                           # None = the engine's tree (ddtree w4 d7 b8)
         "chain": OmegaConf.create({"kind": "chain", "width": 1, "depth": 5, "budget": 5}),
         "ar": AR_TREE}
CONFIGS = [("numpy", "fp32"), ("numpy", "int4_w4a16")] + (
    [] if CPU_SKIPPED else [("cpu", "fp32"), ("cpu", "int4_w4a16")])

_engines = {}


def engine_for(compose_cfg, backend, quant) -> Engine:
    key = (backend, quant)
    if key not in _engines:
        _engines[key] = Engine.from_config(compose_cfg(f"backend={backend}", f"quant={quant}", "tree=ddtree",
                                                       "tree.width=4", "tree.depth=7", "tree.budget=8",
                                                       "load.progress=false"))
    return _engines[key]


def scheduler(engine, **kw) -> Scheduler:
    kw.setdefault("max_batch_tokens", 48)      # small: long prompts are prefilled in chunks beside decoding rows
    return Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context, **kw)


def stop_check_for(tokenizer, stop: str):
    """Committed tokens -> the shortest prefix whose text contains `stop` (None = not yet): a multi-token stop."""
    def check(tokens):
        if stop not in tokenizer.decode(tokens):
            return None
        return next(k for k in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:k]))
    return check


def solo_with_stop(engine, req_spec):
    """The solo run of a request spec, its tokens cut the way a stop string cuts them."""
    ids, max_new, tree, stop = req_spec["ids"], req_spec["max_new"], req_spec["tree"], req_spec["stop"]
    res = engine.generate(ids, max_new, tree=tree)
    if stop is not None:
        keep = stop_check_for(engine.tokenizer, stop)(res.tokens)
        if keep is not None:
            del res.tokens[keep:]
            res.finish_reason = "stop"
    return res


def random_specs(engine, rng, n):
    specs = []
    for i in range(n):
        a = int(rng.integers(0, len(TEXT) - 400))
        ids = engine.tokenizer.encode(TEXT[a:a + int(rng.choice([1, 3, 17, 60, 130, 250]))])
        kind = ["ddtree", "chain", "ar"][i % 3]
        specs.append({"ids": ids, "max_new": int(rng.choice([1, 2, 9, 24, 40])), "tree": TREES[kind],
                      "arrive": int(rng.integers(0, 25)), "stop": None, "cancel": None})
    return specs


@pytest.mark.parametrize("backend,quant", CONFIGS)
def test_every_request_equals_its_solo_run_under_load(compose_cfg, backend, quant):
    run_under_load(engine_for(compose_cfg, backend, quant), n=14)


@pytest.mark.parametrize("backend", ["numpy"] + ([] if CPU_SKIPPED else ["cpu"]))
def test_under_tensor_parallelism_too(compose_cfg, backend):
    """tp=2 (a real gloo rank): every step is ONE forward_batch on both ranks."""
    engine = Engine.from_config(compose_cfg(f"backend={backend}", "tp='2'", "tree=ddtree", "tree.width=4",
                                            "tree.depth=7", "tree.budget=8", "load.progress=false"))
    try:
        run_under_load(engine, n=8, pool_tokens=500)
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["numpy"] + ([] if CPU_SKIPPED else ["cpu"]))
def test_speculation_off_under_load_changes_no_token(compose_cfg, backend):
    """serve.speculate_max_batch=2: with more than two requests decoding, speculative ones step as AR and their
    drafters catch up when the batch thins out; every request still gets its solo tokens (stops, cancels, a
    full pool), and the acceptance counts show both modes really ran."""
    run_under_load(engine_for(compose_cfg, backend, "fp32"), n=14, speculate_max_batch=2)


@pytest.mark.parametrize("backend", ["numpy"] + ([] if CPU_SKIPPED else ["cpu"]))
def test_a_request_speculates_again_with_its_drafter_caught_up(compose_cfg, backend):
    """speculate_max_batch=1: a DDTree request steps as AR beside an AR request, then drafts again once that one
    has finished. Its drafter, caught up with every AR-stepped row in one extend, must draft exactly the trees of
    a solo run whose prompt already holds those tokens: the same acceptance lengths from there on."""
    engine = engine_for(compose_cfg, backend, "fp32")
    ids = engine.tokenizer.encode(TEXT[:40])
    sched = scheduler(engine, speculate_max_batch=1)
    a = sched.submit(Request(ids, 40, tree=TREES["ddtree"]))
    b = sched.submit(Request(engine.tokenizer.encode(TEXT[100:120]), 6, tree=TREES["ar"]))
    while sched.step():
        pass
    got = a.result.acceptance_lengths
    k = next(i for i, n in enumerate(got) if n > 1)      # tokens committed before the first tree step
    assert b.error is None and k >= 6, got             # a stepped as AR while b decoded
    solo = engine.generate(list(ids) + a.result.tokens[:k - 1], 40 - (k - 1), tree=TREES["ddtree"])
    assert a.result.tokens[k - 1:] == solo.tokens
    assert got[k:] == solo.acceptance_lengths[1:] and max(got[k:]) > 1


def run_under_load(engine, n, pool_tokens=900, speculate_max_batch=0):
    rng = np.random.default_rng(18)
    specs = random_specs(engine, rng, n)
    solos = [solo_with_stop(engine, s) for s in specs]
    for s, solo in zip(specs[:4], solos[:4]):      # multi-token stop strings inside four solo outputs
        text = engine.tokenizer.decode(solo.tokens)
        if len(text) >= 8:
            s["stop"] = text[len(text) // 2:len(text) // 2 + 3]
    solos = [solo_with_stop(engine, s) for s in specs]
    for s in specs[4:7]:                           # three cancelled mid-generation
        s["max_new"], s["cancel"] = 40, s["arrive"] + int(rng.integers(2, 6))
    solos = [solo_with_stop(engine, s) for s in specs]
    sched = scheduler(engine, pool_tokens=pool_tokens, speculate_max_batch=speculate_max_batch)  # the rest wait
    reqs = [None] * len(specs)
    step, max_running, max_waiting, modes = 0, 0, 0, set()
    while step < 30 or any(r is not None and not r.done.is_set() for r in reqs):
        for i, s in enumerate(specs):
            if s["arrive"] == step:
                reqs[i] = sched.submit(Request(
                    s["ids"], s["max_new"], tree=s["tree"],
                    stop_check=stop_check_for(engine.tokenizer, s["stop"]) if s["stop"] else None))
            if s["cancel"] == step:
                reqs[i].cancel()
        sched.step()
        modes.add(sched.speculating)
        snap = sched.snapshot()
        max_running, max_waiting = max(max_running, snap["running"]), max(max_waiting, snap["waiting"])
        step += 1
        assert step < 2000
    assert max_running >= 3 and max_waiting >= 1   # batching really happened, and the pool made requests wait
    for s, r, solo in zip(specs, reqs, solos):
        if s["cancel"] is not None:
            assert isinstance(r.error, RequestCancelled)
            assert r.result.tokens == solo.tokens[:len(r.result.tokens)]
            continue
        assert r.error is None
        assert (r.result.tokens, r.result.finish_reason) == (solo.tokens, solo.finish_reason), s
        if s["stop"] is None and not speculate_max_batch:   # same drafts and trees as solo: same acceptance
            assert r.result.acceptance_lengths == solo.acceptance_lengths
    assert any(s["stop"] and r.result.finish_reason == "stop" for s, r in zip(specs, reqs))
    if speculate_max_batch:                        # steps in both modes; speculative requests AR-stepped, then
        assert modes == {True, False}              # speculated again (a tree step accepting > 1 after a 1-step)
        spec = [(r.result.acceptance_lengths, solo.acceptance_lengths) for s, r, solo in zip(specs, reqs, solos)
                if s["tree"] is not TREES["ar"] and s["cancel"] is None]
        assert any(got != want for got, want in spec)
        assert any(1 in got[1:] and max(got[got.index(1, 1):]) > 1 for got, _ in spec if 1 in got[1:])
    assert sched.pool_used == 0 and sched.running == sched.waiting == 0


@pytest.mark.parametrize("backend", ["numpy"] + ([] if CPU_SKIPPED else ["cpu"]))
def test_all_at_once_in_one_step(compose_cfg, backend):
    """Every request arrives at once and prefills in one forward; then every tree of a step is verified together
    (backend=cpu reuses its tree buffer per shape: each request's tree must survive the others' builds)."""
    engine = engine_for(compose_cfg, backend, "fp32")
    specs = random_specs(engine, np.random.default_rng(18), 14)
    sched = scheduler(engine, max_batch_tokens=100000)
    reqs = [sched.submit(Request(s["ids"], s["max_new"], tree=s["tree"])) for s in specs]
    while sched.step():
        pass
    for s, r in zip(specs, reqs):
        solo = engine.generate(s["ids"], s["max_new"], tree=s["tree"])
        assert (r.result.tokens, r.result.acceptance_lengths) == (solo.tokens, solo.acceptance_lengths)


def test_threaded_clients_at_random_times_get_their_solo_tokens(compose_cfg):
    """The engine thread runs steps while client threads submit at random wall-clock times and stream."""
    engine = engine_for(compose_cfg, "numpy", "fp32")
    specs = random_specs(engine, np.random.default_rng(7), 10)
    solos = [engine.generate(s["ids"], s["max_new"], tree=s["tree"]) for s in specs]
    sched = scheduler(engine)
    stop = threading.Event()
    worker = threading.Thread(target=sched.run, args=(stop,))
    worker.start()
    streamed = [[] for _ in specs]
    reqs = [None] * len(specs)

    def client(i):
        time.sleep(specs[i]["arrive"] * 0.01)
        reqs[i] = sched.submit(Request(specs[i]["ids"], specs[i]["max_new"], tree=specs[i]["tree"],
                                            on_tokens=streamed[i].extend))
        reqs[i].wait(60)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(len(specs))]
    try:
        [c.start() for c in clients]
        [c.join(90) for c in clients]
    finally:
        stop.set()
        worker.join(10)
    for i, solo in enumerate(solos):
        assert reqs[i].done.is_set() and reqs[i].error is None
        assert reqs[i].result.tokens == streamed[i] == solo.tokens


def test_a_request_that_can_never_fit_is_refused(compose_cfg):
    engine = engine_for(compose_cfg, "numpy", "fp32")
    with pytest.raises(ContextLengthExceeded, match="exceeds the context of 2048 tokens; shorten the prompt") as e:
        scheduler(engine, pool_tokens=100000).submit(Request([65] * 10, engine.max_context))
    assert e.value.code == "context_length_exceeded"
    sched = scheduler(engine, pool_tokens=300)                    # whole pages of 16: 288 tokens
    with pytest.raises(ContextLengthExceeded, match=r"cache pool of 288 tokens \(serve.kv_pool_tokens\)"):
        sched.submit(Request([65] * 250, 60))
    with pytest.raises(ContextLengthExceeded, match=r"\+ tree budget 9 = 299"):    # 250 + 40 + 9 > 298 -> 288
        scheduler(engine, pool_tokens=298).submit(Request([65] * 250, 40))
    scheduler(engine, pool_tokens=304).submit(Request([65] * 250, 40)).cancel()   # 299 <= 19 pages: admissible


def test_a_request_waits_for_the_pool_then_runs(compose_cfg):
    engine = engine_for(compose_cfg, "numpy", "fp32")
    sched = scheduler(engine, pool_tokens=100)
    ids = engine.tokenizer.encode("def __init__(self, ")
    first, second = (sched.submit(Request(ids, 40)) for _ in range(2))   # 19 + 40 + 9 rows each
    sched.step()
    assert sched.snapshot()["running"] == 1 and sched.snapshot()["waiting"] == 1
    while not second.done.is_set():
        sched.step()
    assert first.result.tokens == second.result.tokens == engine.generate(ids, 40).tokens


def test_cancel_and_timeout_end_a_request_at_the_next_step(compose_cfg):
    engine = engine_for(compose_cfg, "numpy", "fp32")
    sched = scheduler(engine, request_timeout_s=30)
    ids = engine.tokenizer.encode("import os\n")
    keep, gone = sched.submit(Request(ids, 30)), sched.submit(Request(ids, 300))
    for _ in range(3):
        sched.step()
    gone.cancel()
    sched.step()                                   # one step: the cancelled request has left
    assert gone.done.is_set() and isinstance(gone.error, RequestCancelled)
    assert sched.snapshot()["running"] == 1
    late = sched.submit(Request(ids, 300, timeout_s=0.2))
    sched.step()
    time.sleep(0.25)
    sched.step()
    assert isinstance(late.error, RequestTimeout) and "serve.request_timeout_s" in str(late.error)
    while not keep.done.is_set():
        sched.step()
    assert keep.error is None and keep.result.tokens == engine.generate(ids, 30).tokens
    assert sched.pool_used == 0


@pytest.mark.parametrize("backend", ["numpy"] + ([] if CPU_SKIPPED else ["cpu"]))
def test_sampled_requests_batched_equal_their_solo_runs(compose_cfg, backend):
    """Per-request SamplingParams (temperature, top_p/top_k, penalties, seed, logprobs, echo): the same tokens and
    logprobs batched as alone for a seed (uniform(seed, output position) does not depend on the batch)."""
    engine = engine_for(compose_cfg, backend, "fp32")
    run_sampled(engine, speculate_max_batch=0)


def test_sampled_requests_equal_their_solo_runs_with_speculation_off_under_load(compose_cfg):
    """The same with serve.speculate_max_batch=2: a token drawn at a position does not depend on whether a tree or
    an AR step reached it."""
    run_sampled(engine_for(compose_cfg, "cpu" if not CPU_SKIPPED else "numpy", "fp32"), speculate_max_batch=2)


def run_sampled(engine, speculate_max_batch):
    from kdtree.decode.sampling import SamplingParams

    specs = random_specs(engine, np.random.default_rng(20), 9)
    params = [SamplingParams(temperature=[0.0, 0.7, 1.2][i % 3], top_p=[1.0, 0.9][i % 2], top_k=[0, 20][i % 2],
                             seed=100 + i, frequency_penalty=0.5 if i % 4 == 1 else 0.0,
                             logprobs=2 if i % 3 == 1 else None, echo=i == 4) for i in range(len(specs))]
    specs[4]["max_new"] = 0                        # echo with max_tokens 0 scores the prompt only
    solos = [engine.generate(s["ids"], s["max_new"], tree=s["tree"], sampling=p) for s, p in zip(specs, params)]
    sched = scheduler(engine, speculate_max_batch=speculate_max_batch)
    reqs = {}
    for step in range(400):
        reqs.update({i: sched.submit(Request(s["ids"], s["max_new"], tree=s["tree"], sampling=p))
                     for i, (s, p) in enumerate(zip(specs, params)) if s["arrive"] == step})
        if not sched.step() and len(reqs) == len(specs):
            break
    assert any(p.temperature > 0 for p in params) and len(reqs) == len(specs)
    for i, solo in enumerate(solos):
        r = reqs[i]
        assert r.error is None
        assert (r.result.tokens, r.result.seed, r.result.logprobs) == (solo.tokens, solo.seed, solo.logprobs)
        assert r.result.prompt_logprobs == solo.prompt_logprobs



@pytest.mark.parametrize("backend", [
    "numpy",
    pytest.param("cpu", marks=pytest.mark.skipif(CPU_SKIPPED, reason="the native latent-cache arena needs the CPU "
                                                                      "library")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        native.cuda_device_count() == 0, reason=f"no CUDA device: {native.CUDA_REASON}")])])
def test_a_fragmented_pool_admits_without_moving_a_row(compose_cfg, backend):
    """Long and short requests interleaved fragment the pool: every request's rows are pages of ONE arena of 11
    pages of 16 rows. A (40 rows: 3 pages), B (a chain, 72: 5) and C (40: 3) fill it; A and C finish first, leaving
    6 free pages in two runs of 3: D (50 rows: 4 pages) fits no contiguous range but is admitted at once into
    pages of both holes -- no compaction, not a row of the decoding B moved (its page table is unchanged) -- and
    every request still gets its solo tokens."""
    engine = Engine.from_config(compose_cfg(f"backend={backend}", "load.progress=false"))   # its own pool
    sched = scheduler(engine, pool_tokens=176)
    pool = engine.model.pages
    assert sched.pooled and pool.reserved and pool.total == 11 and pool.page_rows == 16
    enc = engine.tokenizer.encode
    ar, chain = TREES["ar"], OmegaConf.create({"kind": "chain", "width": 1, "depth": 3, "budget": 3})
    a = sched.submit(Request(enc(TEXT[:30]), 10, tree=ar))
    b = sched.submit(Request(enc(TEXT[40:44]), 64, tree=chain))
    c = sched.submit(Request(enc(TEXT[50:80]), 10, tree=ar))
    sched.step()
    tables = [list(sched._state[id(r)].cache.pages) for r in (a, b, c)]
    assert tables == [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10]] and pool.free == 0
    b_cache = sched._state[id(b)].cache
    while not (a.done.is_set() and c.done.is_set()):
        sched.step()
    assert not b.done.is_set() and sched.pool_used == 80 and b.generated < 50
    assert sorted(pool._free) == [0, 1, 2, 8, 9, 10]                # two holes of 3 pages, no range of 4
    d = sched.submit(Request(enc(TEXT[90:100]), 40, tree=ar))
    sched.step()
    assert sched.snapshot()["waiting"] == 0 and d.admitted_at and not b.done.is_set()   # admitted at once
    assert list(sched._state[id(d)].cache.pages) == [0, 1, 2, 8]    # pages of both holes
    assert sched._state[id(b)].cache is b_cache and list(b_cache.pages) == tables[1]   # nothing moved
    while sched.step():
        pass
    assert d.error is None and b.error is None
    assert d.result.tokens == engine.generate(enc(TEXT[90:100]), 40, tree=ar).tokens
    assert b.result.tokens == engine.generate(enc(TEXT[40:44]), 64, tree=ar).tokens
    assert [r.result.tokens for r in (a, c)] == [engine.generate(enc(t), n, tree=ar).tokens
                                                 for t, n in ((TEXT[:30], 10), (TEXT[50:80], 10))]
