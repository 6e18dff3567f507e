"""The chain/DDTree loop: exact target-forward counts with a drafter that agrees with the target, stop rules
at round boundaries, counters, dispatch, and one-line config errors.

Run: .venv/bin/python -m pytest -q tests/decode/test_ddtree_loop.py
"""
from __future__ import annotations

import math

import pytest

from scripted_drafter import PROMPTS, scripted
from kdtree.model.names import drafter_tensor_shapes, init_weights
from kdtree.config.schema import TreeConfig
from kdtree.decode import generate
from tests.decode.loops import generate_ar
from tests.decode.loops import generate_ddtree
from kdtree.decode.result import STAGES
from kdtree.errors import ConfigError
from kdtree.model.drafter import DFlashDrafter

N_NEW = 33


@pytest.fixture(scope="module")
def ar_seq(tiny_model, tiny_cfg):
    """prompt + greedy continuation long enough for every draft of an N_NEW-token generation."""
    p = PROMPTS["text"]
    ar = generate_ar(tiny_model, p, N_NEW + tiny_cfg.drafter.block_size)
    return p, ar.tokens, p + ar.tokens


@pytest.mark.parametrize("kind,width,depth,budget", [
    ("chain", 1, 7, 7), ("chain", 1, 3, 3), ("ddtree", 4, 7, 32), ("ddtree", 2, 5, 64), ("ddtree", 3, 7, 4),
])
def test_agreeing_drafter_saves_depth_plus_one_forwards(tiny_model, tiny_cfg, ar_seq, kind, width, depth, budget):
    prompt, ar_tokens, seq = ar_seq
    drafter = scripted(seq, tiny_cfg)       # true continuation at rank 0 with an 8-logit margin
    res = generate_ddtree(tiny_model, drafter, TreeConfig(kind, width, depth, budget), prompt, N_NEW)
    assert res.tokens == ar_tokens[:N_NEW] and res.finish_reason == "length"
    # best-first pops the rank-0 chain before any sibling (-8 logits), so a round accepts min(depth, budget)
    per_round = min(depth, budget if kind == "ddtree" else depth) + 1
    rounds = math.ceil((N_NEW - 1) / per_round)        # the prefill already gives the first token
    assert res.target_forwards == 1 + rounds            # AR needs N_NEW
    assert res.draft_forwards == rounds == drafter.calls
    assert res.acceptance_lengths == [per_round] * rounds


def test_counters_and_stage_seconds(tiny_model, tiny_cfg, ar_seq):
    prompt, ar_tokens, seq = ar_seq
    res = generate_ddtree(tiny_model, scripted(seq, tiny_cfg), TreeConfig("ddtree", 4, 7, 32), prompt, 20)
    assert set(res.stage_seconds) == set(STAGES)
    assert all(res.stage_seconds[s] > 0 for s in STAGES)
    assert res.seconds >= sum(res.stage_seconds.values()) * 0.99
    assert res.to_dict()["mean_acceptance_length"] == pytest.approx(8.0)


@pytest.mark.parametrize("max_new", [1, 2, 8, 9, 10, 16, 17])
def test_max_new_tokens_cuts_inside_a_round(tiny_model, tiny_cfg, ar_seq, max_new):
    prompt, ar_tokens, seq = ar_seq
    res = generate_ddtree(tiny_model, scripted(seq, tiny_cfg), TreeConfig("chain", 1, 7, 7), prompt, max_new)
    assert res.tokens == ar_tokens[:max_new] and res.finish_reason == "length"
    assert res.target_forwards == 1 + math.ceil((max_new - 1) / 8)


@pytest.mark.parametrize("where", ["prefill", "path", "bonus"])
@pytest.mark.parametrize("rule", ["eos", "stop"])
def test_eos_and_stop_end_the_generation_where_ar_does(tiny_model, tiny_cfg, ar_seq, where, rule):
    prompt, ar_tokens, seq = ar_seq
    # chain depth 7 with an agreeing drafter commits output index 0 at prefill, then 1..8 (8 = bonus), 9..16, ...
    first = {}
    for i, t in enumerate(ar_tokens[:N_NEW]):
        first.setdefault(t, i)
    want = {"prefill": lambda i: i == 0, "path": lambda i: i > 8 and i % 8, "bonus": lambda i: i > 0 and i % 8 == 0}
    idx = [i for t, i in first.items() if want[where](i)]
    if not idx:
        pytest.skip(f"greedy continuation has no first occurrence at a {where} index")
    tok = ar_tokens[idx[0]]
    kw = {"eos_id": tok} if rule == "eos" else {"stop_ids": (tok,)}
    ar = generate_ar(tiny_model, prompt, N_NEW, **kw)
    res = generate_ddtree(tiny_model, scripted(seq, tiny_cfg), TreeConfig("chain", 1, 7, 7), prompt, N_NEW, **kw)
    assert ar.finish_reason == rule and ar.tokens == ar_tokens[:idx[0]]
    assert res.tokens == ar.tokens and res.finish_reason == ar.finish_reason
    assert res.target_forwards == 1 + math.ceil(idx[0] / 8)


def test_real_dflash_drafter_runs_the_loop(tiny_model, tiny_cfg):
    """A random DFlash drafter accepts little, but the loop must still reproduce AR and feed it the context."""
    drafter = DFlashDrafter.from_target(tiny_model, init_weights(drafter_tensor_shapes(tiny_cfg), seed=1))
    prompt = PROMPTS["bytes"]
    ar = generate_ar(tiny_model, prompt, 12)
    for tree in (TreeConfig("chain", 1, 7, 7), TreeConfig("ddtree", 4, 3, 16)):
        res = generate(tiny_model, drafter, tree, prompt, 12)
        assert res.tokens == ar.tokens
        assert res.draft_forwards == res.target_forwards - 1 == len(res.acceptance_lengths)
        assert sum(res.acceptance_lengths) >= len(res.tokens) - 1


def test_generate_dispatches_on_tree_kind(tiny_model, tiny_cfg, ar_seq):
    prompt, ar_tokens, seq = ar_seq
    ar = generate(tiny_model, None, TreeConfig("ar", 1, 0, 0), prompt, 10)
    assert ar.tokens == ar_tokens[:10] and ar.target_forwards == 10 and ar.draft_forwards == 0
    dd = generate(tiny_model, scripted(seq, tiny_cfg), TreeConfig("ddtree", 2, 4, 8), prompt, 10)
    assert dd.tokens == ar.tokens and dd.target_forwards == 1 + math.ceil(9 / 5)
    with pytest.raises(ConfigError, match="needs the DFlash drafter"):
        generate(tiny_model, None, TreeConfig("chain", 1, 7, 7), prompt, 10)
    with pytest.raises(ConfigError, match="tree.kind=beam is unknown"):
        generate(tiny_model, None, TreeConfig("beam", 1, 7, 7), prompt, 10)


@pytest.mark.parametrize("tree,match", [
    (TreeConfig("ddtree", 4, 8, 32), r"tree.depth=8 outside 1..7"),
    (TreeConfig("chain", 1, 0, 0), r"tree.depth=0 outside 1..7"),
    (TreeConfig("ddtree", 0, 7, 32), r"tree.width=0 must be >= 1"),
    (TreeConfig("ddtree", 4, 7, 0), r"tree.budget=0 must be >= 1"),
])
def test_bad_tree_config_is_one_line_error(tiny_model, tiny_cfg, ar_seq, tree, match):
    prompt, _, seq = ar_seq
    with pytest.raises(ConfigError, match=match) as e:
        generate_ddtree(tiny_model, scripted(seq, tiny_cfg), tree, prompt, 8)
    assert "\n" not in str(e.value)


def test_empty_prompt_and_zero_tokens(tiny_model, tiny_cfg, ar_seq):
    _, _, seq = ar_seq
    with pytest.raises(ConfigError, match="prompt is empty"):
        generate_ddtree(tiny_model, scripted(seq, tiny_cfg), TreeConfig("chain", 1, 7, 7), [], 8)
    res = generate_ddtree(tiny_model, scripted(seq, tiny_cfg), TreeConfig("chain", 1, 7, 7), [1, 2], 0)
    assert res.tokens == [] and res.target_forwards == 0
