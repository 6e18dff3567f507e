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
from kdtree.decode.sampling import SamplingParams
from kdtree.engine import AR_TREE, Engine
from kdtree.errors import ConfigError
from kdtree.tree import draft_topk, tree_build, unpack_visibility
from tests.lossless import assert_batched_equals_ar
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
    assert_batched_equals_ar(engine, ids, COST, sp, want)


def test_plain_steps_when_tree_rounds_are_slower():
    c = _costs(lambda T: 0.01 * T)                 # a plain step: 100 tokens/s
    assert not c.prefers_ar()                      # no tree round measured yet: try trees
    c.observe_round(3, 0.05)                       # a tree round: 60 tokens/s
    assert c.prefers_ar()
    for _ in range(20):
        c.observe_round(6, 0.04)                   # rounds now commit 150 tokens/s
    assert not c.prefers_ar()


def test_warmup_measures_the_cost_curve_and_builds_the_grammar_vocabulary(compose_cfg, tmp_path):
    """The serve pipeline's warmup stage: the first tree.policy=cost request finds the forward-cost curve measured
    (one forward per verify size) and the first structured request finds the grammar vocabulary built."""
    from kdtree.decode.grammar import Grammars
    from kdtree.pipeline.context import StageContext
    from kdtree.stages import load, warmup
    from kdtree.engine import EngineState
    cfg = compose_cfg("backend=numpy", "tree=ddtree", "tree.policy=cost", "tree.budget=8", "load.progress=false")
    events = []
    ctx = StageContext(cfg=cfg, run_dir=tmp_path, emit=lambda kind, **f: events.append((kind, f)))
    load.run(ctx)
    engine = EngineState.of(ctx).engine
    Grammars._cache.pop(id(engine.tokenizer), None)
    out = warmup.run(ctx)
    costs = engine.scheduler.costs
    assert costs is not None and costs.calibrated and set(range(1, 10)) <= set(costs.rows)
    assert {"cost_curve", "grammar_vocab"} <= set(out["shapes"])
    assert id(engine.tokenizer) in Grammars._cache
    assert {f["shape"] for kind, f in events if kind == "warmup_shape"} >= {"cost_curve", "grammar_vocab"}


def test_a_grammar_fills_only_the_prefix_the_cost_policy_chose(compose_cfg):
    """tree.policy=cost with a JSON schema: where each extra row costs a whole step (a compute-bound curve) the
    policy verifies a short prefix; the grammar's forced tokens fill up to that prefix, not back to tree.budget --
    and the answer is still the AR one."""
    from kdtree.decode.cost import ForwardCosts
    engine = Engine.from_config(compose_cfg("backend=numpy", "load.progress=false", "serve.prefix_cache=false"))
    spec = engine.grammars().json_schema({"type": "object", "properties": {"name": {"type": "string"},
                                                                           "count": {"type": "integer"}},
                                          "required": ["name", "count"], "additionalProperties": False})
    ids = engine.tokenizer.encode("Return the record as JSON: ")
    want = engine.generate(ids, 40, tree=AR_TREE, grammar=spec).tokens

    class Steep(ForwardCosts):                       # a fixed compute-bound curve: measured times do not move it
        def observe(self, rows, seconds):
            pass

    steep = Steep(engine.model)
    steep.rows, steep.calibrated = {T: 1.0 * T for T in range(1, 40)}, True
    engine.scheduler.costs = steep
    got = engine.generate(ids, 40, tree=COST, grammar=spec)
    assert got.tokens == want
    assert got.acceptance_lengths and max(got.acceptance_lengths) <= 4, got.acceptance_lengths   # b* < 4 (+ bonus)
    fixed = engine.generate(ids, 40, tree=OmegaConf.merge(COST, {"policy": "fixed"}), grammar=spec)
    assert fixed.tokens == want and max(fixed.acceptance_lengths) > 4        # forced runs fill the whole budget


def test_cost_policy_is_lossless_with_prefix_cache_hits(compose_cfg):
    """tree.policy=cost with the prefix cache on: a miss, a full-prompt hit and a partial hit give AR's tokens."""
    engine = Engine.from_config(compose_cfg("backend=numpy", "load.progress=false", "serve.prefix_cache=true"))
    ids = engine.tokenizer.encode(TEXT * 2)
    other = ids[:48] + engine.tokenizer.encode("import sys\n")
    want = {tuple(p): Engine.generate(engine, p, 32, tree=AR_TREE).tokens for p in (ids, other)}
    pc = engine.scheduler.prefix_cache
    assert pc is not None
    hits = []
    for prompt in (ids, ids, other):
        got = engine.generate(prompt, 32, tree=COST)
        assert got.tokens == want[tuple(prompt)]
        hits.append(got.cached_tokens)
    assert hits[1] >= (len(ids) - 1) // 16 * 16 - 16 and hits[1] > 0 and hits[2] >= 32, hits


def test_the_bench_stages_measure_the_cost_curve_before_any_timed_round(compose_cfg):
    """bench and bench_peer (calibrate_policies): the forward-cost curve of tree.policy=cost is measured by one
    untimed generation, up to the largest budget among the shapes, so no timed round pays for it; a fixed-policy
    list measures nothing."""
    from kdtree.stages.bench import calibrate_policies
    engine = Engine.from_config(compose_cfg("backend=numpy", "load.progress=false", "tree=ddtree"))
    try:
        ids = list(map(int, engine.tokenizer.encode("def f(x):")))
        fixed = OmegaConf.merge(COST, {"policy": "fixed", "budget": 12})
        calibrate_policies(engine, ids, [fixed])
        assert engine.scheduler.costs is None
        small = OmegaConf.merge(COST, {"budget": 6})
        calibrate_policies(engine, ids, [small, OmegaConf.merge(COST, {"budget": 10}), fixed])
        costs = engine.scheduler.costs
        assert costs is not None and costs.calibrated and set(range(1, 12)) <= set(costs.rows)
        # the timed run that follows finds the curve measured: its first request measures nothing more
        before = dict(costs.rows)
        r = engine.generate(ids, 8, tree=small)
        assert r.tokens == engine.generate(ids, 8, tree=AR_TREE).tokens
        assert set(costs.rows) == set(before)
    finally:
        engine.close()
