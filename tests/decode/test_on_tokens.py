"""on_tokens: the live-streaming callback of the decode loops. Its calls, concatenated, are exactly
result.tokens (max_new_tokens, eos and stop-id cuts included), one call per commit: AR one token per step,
chain/DDTree the prefill token then each round's accepted path + bonus. An exception it raises ends the
generation (how the server cancels a disconnected stream).

Run: .venv/bin/python -m pytest -q tests/decode/test_on_tokens.py
"""
from __future__ import annotations

import pytest

from scripted_drafter import PROMPTS, noisy_rank, scripted
from kdtree.model.names import drafter_tensor_shapes, init_weights
from kdtree.config.schema import TreeConfig
from kdtree.decode import generate
from tests.decode.loops import generate_ar
from tests.decode.loops import generate_ddtree
from kdtree.model.drafter import DFlashDrafter

N_NEW = 33
CHAIN7 = TreeConfig("chain", 1, 7, 7)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, ids):
        assert isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)
        self.calls.append(list(ids))

    @property
    def tokens(self):
        return [t for c in self.calls for t in c]


@pytest.fixture(scope="module")
def ar_seq(tiny_model, tiny_cfg):
    p = PROMPTS["text"]
    ar = generate_ar(tiny_model, p, N_NEW + tiny_cfg.drafter.block_size)
    return p, ar.tokens, p + ar.tokens


@pytest.mark.parametrize("max_new", [1, 2, 9, N_NEW])
def test_ar_calls_once_per_token(tiny_model, ar_seq, max_new):
    prompt, ar_tokens, _ = ar_seq
    rec = Recorder()
    res = generate_ar(tiny_model, prompt, max_new, on_tokens=rec)
    assert rec.tokens == res.tokens == ar_tokens[:max_new]
    assert rec.calls == [[t] for t in res.tokens]


@pytest.mark.parametrize("max_new", [1, 2, 8, 9, 10, 16, 17, N_NEW])
def test_chain_calls_once_per_commit_and_cuts_at_max_new_tokens(tiny_model, tiny_cfg, ar_seq, max_new):
    prompt, ar_tokens, seq = ar_seq
    rec = Recorder()
    res = generate_ddtree(tiny_model, scripted(seq, tiny_cfg), CHAIN7, prompt, max_new, on_tokens=rec)
    assert rec.tokens == res.tokens == ar_tokens[:max_new]
    # prefill's token, then 8 per round (7 accepted + bonus), the last round cut at max_new
    sizes = [1] + [8] * ((max_new - 1) // 8) + ([(max_new - 1) % 8] if (max_new - 1) % 8 else [])
    assert [len(c) for c in rec.calls] == sizes


@pytest.mark.parametrize("rule", ["eos", "stop"])
def test_eos_and_stop_ids_cut_the_stream_like_the_result(tiny_model, tiny_cfg, ar_seq, rule):
    prompt, ar_tokens, seq = ar_seq
    # every first occurrence: at the prefill (index 0), inside a round's path, or as a round's bonus (8, 16, ...)
    first = {}
    for i, t in enumerate(ar_tokens[:N_NEW]):
        first.setdefault(t, i)
    # chain depth 7 commits index 0 at the prefill, then 1..8 per round (8, 16, ... = a bonus); one of each
    kinds = [lambda i: i == 0, lambda i: i > 0 and i % 8 == 0, lambda i: i > 0 and i % 8, lambda i: i > 16]
    picked = {}
    for want in kinds:
        tok = next((t for t, i in first.items() if want(i) and t not in picked), None)
        if tok is not None:
            picked[tok] = first[tok]
    assert len(picked) >= 3, picked
    for tok, idx in sorted(picked.items(), key=lambda x: x[1]):
        kw = {"eos_id": tok} if rule == "eos" else {"stop_ids": (tok,)}
        for gen in ("ar", "chain", "ddtree"):
            rec = Recorder()
            if gen == "ar":
                res = generate_ar(tiny_model, prompt, N_NEW, on_tokens=rec, **kw)
            else:
                tree = CHAIN7 if gen == "chain" else TreeConfig("ddtree", 3, 5, 12)
                res = generate_ddtree(tiny_model, scripted(seq, tiny_cfg, noisy_rank(5) if gen == "ddtree"
                                                           else (lambda n, d: 0)), tree, prompt, N_NEW,
                                      on_tokens=rec, **kw)
            assert res.finish_reason == rule and res.tokens == ar_tokens[:idx], (gen, idx)
            assert rec.tokens == res.tokens, (gen, idx)
            assert all(rec.calls), "no empty calls"


def test_noisy_trees_and_a_real_drafter_stream_the_result(tiny_model, tiny_cfg, ar_seq):
    prompt, ar_tokens, seq = ar_seq
    for seed in range(3):
        for tree in (TreeConfig("ddtree", 4, 7, 32), TreeConfig("ddtree", 2, 3, 5), TreeConfig("chain", 1, 4, 4)):
            rec = Recorder()
            res = generate(tiny_model, scripted(seq, tiny_cfg, noisy_rank(seed)), tree, prompt, 21, on_tokens=rec)
            assert rec.tokens == res.tokens == ar_tokens[:21]
            # one call per commit: the prefill, then one per verify round
            assert len(rec.calls) == 1 + len(res.acceptance_lengths)
            assert [len(c) for c in rec.calls[1:-1]] == res.acceptance_lengths[:-1]
    drafter = DFlashDrafter.from_target(tiny_model, init_weights(drafter_tensor_shapes(tiny_cfg), seed=1))
    rec = Recorder()
    res = generate(tiny_model, drafter, TreeConfig("ddtree", 4, 3, 16), PROMPTS["bytes"], 12, on_tokens=rec)
    assert rec.tokens == res.tokens == generate_ar(tiny_model, PROMPTS["bytes"], 12).tokens
    rec = Recorder()
    assert generate(tiny_model, None, TreeConfig("ar", 1, 0, 0), prompt, 5, on_tokens=rec).tokens == rec.tokens


def test_an_exception_from_the_callback_ends_the_generation(tiny_model, tiny_cfg, ar_seq):
    prompt, _, seq = ar_seq

    class Stop(Exception):
        pass

    seen = []

    def cb(ids):
        seen.extend(ids)
        if len(seen) >= 3:
            raise Stop()

    with pytest.raises(Stop):
        generate_ar(tiny_model, prompt, N_NEW, on_tokens=cb)
    assert len(seen) == 3
    seen.clear()
    drafter = scripted(seq, tiny_cfg)
    with pytest.raises(Stop):
        generate_ddtree(tiny_model, drafter, CHAIN7, prompt, N_NEW, on_tokens=cb)
    assert len(seen) == 9 and drafter.calls == 1          # prefill token, one round of 8, then no more drafting


def test_no_callback_and_zero_tokens(tiny_model, tiny_cfg, ar_seq):
    prompt, _, seq = ar_seq
    rec = Recorder()
    assert generate_ar(tiny_model, prompt, 0, on_tokens=rec).tokens == [] and rec.calls == []
    assert generate_ddtree(tiny_model, scripted(seq, tiny_cfg), CHAIN7, prompt, 0, on_tokens=rec).tokens == []
    assert rec.calls == []
