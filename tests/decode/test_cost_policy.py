"""tree.policy=cost (kdtree/decode/cost.py): each round verifies the best-first prefix of its tree with the most
expected tokens per second. Lossless (the tokens equal AR's, alone and batched, greedy and seeded), and the choice
follows the cost curve: a compute-bound curve (cost grows with rows) picks a short prefix, a memory-bound one (a verify
costs about a step) the whole tree.

Run: .venv/bin/python -m pytest -q tests/decode/test_cost_policy.py
"""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.decode.cost import ForwardCosts, best_prefix, node_scores, policy_of, prefix_tree
from kdtree.decode.request import Request
from kdtree.decode.sampling import SamplingParams
from kdtree.engine import AR_TREE, Engine
from kdtree.errors import ConfigError
from kdtree.tree import draft_topk, tree_build, unpack_visibility
from tests.native_lib import CPU_SKIPPED

COST = OmegaConf.create({"kind": "ddtree", "width": 4, "depth": 7, "budget": 32, "policy": "cost"})
TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "


def _tree():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((7, 50)).astype(np.float32) * 3
    logp, ids = draft_topk(logits, 4)
    return tree_build(logp, ids, 32), logp, ids


def _costs(curve):
    c = ForwardCosts(model=None)
    c.rows = {T: curve(T) for T in range(1, 34)}
    c.calibrated = True
    return c


def test_the_prefix_follows_the_cost_curve():
    tree, logp, ids = _tree()
    scores = node_scores(tree, logp, ids)
    assert np.all(np.diff(scores) <= 1e-12)                       # best-first: scores never rise
    flat, _ = best_prefix(tree, logp, ids, _costs(lambda T: 1.0 + 0.001 * T))       # memory-bound: rows nearly free
    steep, _ = best_prefix(tree, logp, ids, _costs(lambda T: 1.0 * T))              # compute-bound: each row a step
    assert flat == tree.size and steep < 4 and flat > steep
    small = prefix_tree(tree, steep)
    assert small.size == steep and list(small.parents) == list(tree.parents[:steep])
    vis, full = unpack_visibility(small.visibility, steep + 1), unpack_visibility(tree.visibility, tree.size + 1)
    assert np.array_equal(vis, full[:steep + 1, :steep + 1])


def test_an_unknown_policy_names_the_key():
    with pytest.raises(ConfigError, match="tree.policy=greedyish is unknown"):
        policy_of(OmegaConf.create({"kind": "ddtree", "policy": "greedyish"}))


@pytest.mark.parametrize("backend", ["numpy"] + ([] if CPU_SKIPPED else ["cpu"]))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_cost_policy_is_lossless_alone_and_batched(compose_cfg, backend, sampled):
    engine = Engine.from_config(compose_cfg(f"backend={backend}", "load.progress=false", "serve.prefix_cache=false"))
    ids = engine.tokenizer.encode(TEXT)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=11) if sampled else None
    want = engine.generate(ids, 48, tree=AR_TREE, sampling=sp).tokens
    alone = engine.generate(ids, 48, tree=COST, sampling=sp)
    assert alone.tokens == want
    assert engine.scheduler.costs is not None and engine.scheduler.costs.calibrated      # measured on this model
    assert alone.target_forwards < len(want)                     # still speculating
    reqs = [engine.submit(Request(ids, 48, sampling=sp, tree=COST)),
            engine.submit(Request(ids[3:], 24, sampling=sp, tree=COST))]
    for r in reqs:
        engine.drive(r)
    assert reqs[0].result.tokens == want
    assert reqs[1].result.tokens == engine.generate(ids[3:], 24, tree=AR_TREE, sampling=sp).tokens


def test_plain_steps_when_tree_rounds_are_slower():
    c = _costs(lambda T: 0.01 * T)                 # a plain step: 100 tokens/s
    assert not c.prefers_ar()                      # no tree round measured yet: try trees
    c.observe_round(3, 0.05)                       # a tree round: 60 tokens/s
    assert c.prefers_ar()
    for _ in range(20):
        c.observe_round(6, 0.04)                   # rounds now commit 150 tokens/s
    assert not c.prefers_ar()
