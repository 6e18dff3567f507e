"""tree.prune_experts (kd_forward_args.row_value): a verify forward drops the draft rows whose own MoE experts cost more
bytes than their subtree is expected to commit. Lossless by construction -- a pruned draft is a rejected one and the
other rows compute the same bits -- and tested so: the native forward's kept rows equal an unpruned forward bit for
bit, a pruned row takes its subtree with it, and decoding with pruning (greedy and seeded, alone and batched, with
and without a prefix-cache hit, pruning nothing or everything) gives AR's tokens.

Run: .venv/bin/python -m pytest -q tests/decode/test_expert_pruning.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.decode.cost import subtree_values
from kdtree.decode.request import Request
from kdtree.decode.sampling import SamplingParams
from kdtree.engine import AR_TREE, Engine
from kdtree.tree import draft_topk, tree_build, unpack_visibility
from tests.lossless import assert_batched_equals_ar
from tests.native_lib import needs_cpu_library

pytestmark = needs_cpu_library

PRUNE = OmegaConf.create({"kind": "ddtree", "width": 4, "depth": 7, "budget": 16, "policy": "fixed",
                          "prune_experts": True})
TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "


@pytest.fixture(scope="module")
def engine(kdtree_cache):
    from hydra import compose, initialize_config_dir

    from kdtree.pipeline.registry import register_schema
    register_schema()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", "backend=cpu",
                                                       "load.progress=false", "serve.prefix_cache=false"])
    return Engine.from_config(cfg)


def _tree(seed=3, budget=16):
    rng = np.random.default_rng(seed)
    logp, ids = draft_topk(rng.standard_normal((7, 60)).astype(np.float32) * 2, 4)
    return tree_build(logp, ids, budget)


def test_subtree_values_sum_each_subtree_and_keep_the_root():
    tree = _tree()
    p = np.linspace(0.9, 0.1, tree.size)
    v = subtree_values(tree, p)
    assert v.shape == (tree.size + 1,) and np.isinf(v[0])
    vis = unpack_visibility(tree.visibility, tree.size + 1)     # [row, key]: the key is the row or an ancestor
    for i in range(tree.size):
        subtree = [j for j in range(tree.size) if vis[j + 1, i + 1]]
        assert v[i + 1] == pytest.approx(p[subtree].sum(), rel=1e-6)
        if tree.parents[i] >= 0:
            assert v[tree.parents[i] + 1] >= v[i + 1]          # an ancestor is never worth less: it comes first


def _verify(engine, tree, values=None, cost=None):
    """one native verify forward of [root, tree] after a 24-token prefix -> (logits, pruned)"""
    model = engine.model
    prefix = np.arange(24, dtype=np.int32) % 200 + 40
    cache = model.new_cache(24 + tree.size + 1)
    model.forward(prefix, np.arange(24, dtype=np.int32), cache)
    tokens = np.concatenate([[65], tree.tokens]).astype(np.int32)
    positions = (24 + np.concatenate([[0], tree.depths])).astype(np.int32)
    if cost is not None:                                        # expert_cost is a cached_property: set for this call
        model.__dict__["expert_cost"] = cost
    try:
        logits, _, _ = model.forward_batch([(tokens, positions, cache, tree.visibility)], (),
                                           values=None if values is None else [values])
    finally:
        model.__dict__.pop("expert_cost", None)
    pruned = model.pruned
    cache.release()
    return logits, pruned


def test_kept_rows_are_the_unpruned_bits_and_a_pruned_row_takes_its_subtree(engine):
    tree = _tree()
    full, none = _verify(engine, tree)
    assert none is None                                        # no values: nothing pruned, no mask
    vis = unpack_visibility(tree.visibility, tree.size + 1)
    values = subtree_values(tree, np.linspace(0.5, 0.001, tree.size))
    saw = False
    for cost in (1e-4, 0.01, 0.1, 1e9):
        logits, pruned = _verify(engine, tree, values, cost)
        kept = pruned == 0
        assert kept[0]                                         # the root: inf, never pruned
        np.testing.assert_array_equal(logits[kept], full[kept])   # the rows that stay: the same bits
        for r in np.flatnonzero(~kept):                        # a pruned row's subtree is pruned too
            assert not kept[vis[:, r]].any(), (cost, r)
        saw |= bool((~kept).any()) and bool(kept[1:].any())
    assert saw                                                 # some cost pruned part of the tree, not all of it
    _, everything = _verify(engine, tree, values, 1e9)
    assert everything[1:].all()                                # an expert worth nothing: every draft goes


def test_values_of_the_wrong_length_are_refused(engine):
    tree = _tree()
    with pytest.raises(ValueError, match="values give 5 rows for 17"):
        _verify(engine, tree, np.ones(5, np.float32), 0.1)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_pruned_decoding_is_lossless_alone_and_batched(engine, sampled):
    ids = engine.tokenizer.encode(TEXT)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=11) if sampled else None
    want = engine.generate(ids, 48, tree=AR_TREE, sampling=sp).tokens
    got = engine.generate(ids, 48, tree=PRUNE, sampling=sp)
    assert got.tokens == want
    assert got.target_forwards < len(want)                      # still speculating
    assert got.pruned_drafts > 0                                # and pruning (tiny's experts are half an AR step)
    assert_batched_equals_ar(engine, ids, PRUNE, sp, want)


def test_pruned_decoding_with_and_without_a_prefix_cache_hit_is_lossless(engine):
    """The same prompt twice through a scheduler with a prefix cache: a miss, then a hit (the prompt's whole pages
    mapped, the drafter's context with them) -- AR's tokens both times, pruning both times."""
    from kdtree.decode.prefix_cache import PrefixCache
    from kdtree.decode.scheduler import Scheduler
    ids = engine.tokenizer.encode(TEXT)
    want = engine.generate(ids, 32, tree=AR_TREE).tokens
    sched = Scheduler(engine.model, engine.drafter, PRUNE, engine.eos_id, engine.max_context, max_batch_tokens=48,
                      pool_tokens=4096, prefix_cache=PrefixCache(page_tokens=16))
    for hit in (False, True):
        req = sched.submit(Request(list(ids), 32, tree=PRUNE))
        sched.drive(req)
        assert req.error is None, req.error
        assert req.result.tokens == want
        assert req.result.cached_tokens == ((len(ids) - 1) // 16 * 16 if hit else 0)
        assert req.result.pruned_drafts > 0


def test_pruning_every_draft_still_commits_ar_tokens(engine):
    """An expert no draft is worth (expert_cost huge): every draft row is pruned, each round commits its bonus token
    alone -- AR's tokens, one per verify."""
    ids = engine.tokenizer.encode(TEXT)
    want = engine.generate(ids, 24, tree=AR_TREE).tokens
    engine.model.__dict__["expert_cost"] = 1e9
    try:
        got = engine.generate(ids, 24, tree=PRUNE)
    finally:
        engine.model.__dict__.pop("expert_cost", None)
    assert got.tokens == want
    assert set(got.acceptance_lengths) == {1} and got.pruned_drafts > 0
