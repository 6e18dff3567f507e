"""Penalties at temperature 0 (vLLM applies them before its greedy argmax): the penalised greedy text differs from
plain greedy where it must, equals AR under chain and DDTree, alone and batched, and matches an independent step by
step computation of the penalised argmax (written here from vLLM's documented rule, not with kdtree's sampler).

Run: .venv/bin/python -m pytest -q tests/decode/test_penalized_greedy.py
"""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.decode import generate
from kdtree.decode.request import Request
from kdtree.decode.sampling import SamplingParams

AR = OmegaConf.create({"kind": "ar", "width": 1, "depth": 0, "budget": 0})
TREES = {"chain": OmegaConf.create({"kind": "chain", "width": 1, "depth": 5, "budget": 5}),
         "ddtree": OmegaConf.create({"kind": "ddtree", "width": 4, "depth": 7, "budget": 16})}
PENALTIES = {"frequency": dict(frequency_penalty=1.5), "presence": dict(presence_penalty=1.2),
             "repetition": dict(repetition_penalty=1.8),
             "all": dict(frequency_penalty=0.7, presence_penalty=0.5, repetition_penalty=1.3)}
N = 40


@pytest.fixture(scope="module")
def engine(kdtree_cache):
    """The trained tiny model (the embedded checkpoint) with its DFlash drafter, numpy backend."""
    from hydra import compose, initialize_config_dir

    from kdtree.pipeline.registry import register_schema as register
    from kdtree.engine import Engine
    from tests.conftest import REPO
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", "pipeline=generate"])
    eng = Engine.from_config(cfg)
    yield eng
    eng.close()


def reference_penalised_greedy(model, prompt, n, frequency_penalty=0.0, presence_penalty=0.0,
                               repetition_penalty=1.0):
    """AR by hand: one forward per token over the model, the penalties applied to the raw float64 logits
    (repetition over prompt + output: positive / r, negative * r; then - f * count - p * [count > 0]), argmax."""
    cache = model.new_cache(len(prompt) + n)
    logits, _ = model.forward(np.asarray(prompt, np.int32), np.arange(len(prompt), dtype=np.int32), cache)
    row, out, counts = logits[-1], [], {}
    for pos in range(len(prompt), len(prompt) + n):
        z = np.asarray(row, np.float64).copy()
        for t in set(prompt) | set(out):
            z[t] = z[t] / repetition_penalty if z[t] > 0 else z[t] * repetition_penalty
        for t, c in counts.items():
            z[t] -= frequency_penalty * c + presence_penalty
        tok = int(np.argmax(z))
        out.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        if len(out) == n:
            break
        logits, _ = model.forward(np.array([tok], np.int32), np.array([pos], np.int32), cache)
        row = logits[-1]
    return out


@pytest.mark.parametrize("which", sorted(PENALTIES))
def test_penalised_greedy_is_the_penalised_argmax_and_lossless(engine, which):
    ids = engine.tokenizer.encode("    def __init__(self, ")
    sp = SamplingParams(temperature=0.0, **PENALTIES[which])
    plain = generate(engine.model, None, AR, ids, N).tokens
    ar = generate(engine.model, None, AR, ids, N, sampling=sp)
    assert ar.tokens != plain                                     # the penalties change a repetitive code text
    assert ar.tokens == reference_penalised_greedy(engine.model, ids, N, **PENALTIES[which])
    assert ar.seed is None                                        # greedy: nothing drawn, nothing to replay
    for name, tree in TREES.items():
        res = generate(engine.model, engine.drafter, tree, ids, N, sampling=sp)
        assert res.tokens == ar.tokens, name
        assert len(res.acceptance_lengths) < N                    # the drafter still saves forwards


def test_penalised_greedy_batched_equals_alone(engine):
    sp = SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)
    prompts = [engine.tokenizer.encode(t) for t in ("import os\n", "class A:\n    def ", "for i in range(")]
    alone = [engine.generate(p, N, sampling=sp).tokens for p in prompts]
    reqs = [engine.submit(Request(p, N, sampling=sp)) for p in prompts]
    for r in reqs:
        engine.drive(r)
    assert [r.result.tokens for r in reqs] == alone
