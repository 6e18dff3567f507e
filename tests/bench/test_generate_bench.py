"""End-to-end greedy generation on the embedded tiny model (pytest-benchmark; nothing about speed asserted).

    .venv/bin/python -m pytest tests/bench/test_generate_bench.py --benchmark-enable --benchmark-only \
        --benchmark-autosave
    .venv/bin/pytest-benchmark compare --group-by=group               # compare saved runs side by side

Group generate(backend=B): AR, chain and DDTree on the same prompt and weights; extra_info carries target
forwards per token and the mean acceptance length, so speed and forward counts read side by side. Every
tree's tokens are asserted equal to AR's (the lossless invariant), never its speed.
"""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from kdtree.decode import generate
from kdtree.engine import Engine

PROMPT = "def __init__(self, "
TREES = {
    "ar": {"kind": "ar", "width": 1, "depth": 0, "budget": 0},
    "chain_d7": {"kind": "chain", "width": 1, "depth": 7, "budget": 7},
    "ddtree_w4_d7_b32": {"kind": "ddtree", "width": 4, "depth": 7, "budget": 32},
}
_engines = {}


def _engine(compose_cfg, backend):
    if backend not in _engines:
        if backend != "numpy":
            from kdtree.backends import native
            if not native.library_path(backend).exists():
                pytest.skip(f"libkdtree_{backend}.so not built (make native)")
        _engines[backend] = Engine.from_config(compose_cfg(f"backend={backend}", "load.progress=false"))
    return _engines[backend]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("tree", list(TREES))
def test_generate(benchmark, compose_cfg, backend, tree):
    engine = _engine(compose_cfg, backend)
    benchmark.group = f"generate(backend={backend})"
    ids = engine.tokenizer.encode(PROMPT)
    tree_cfg = OmegaConf.create(TREES[tree])
    drafter = None if tree == "ar" else engine.drafter
    result = benchmark.pedantic(generate, args=(engine.model, drafter, tree_cfg, ids, 32),
                                kwargs={"eos_id": engine.eos_id}, rounds=3, iterations=1)
    ar = generate(engine.model, None, OmegaConf.create(TREES["ar"]), ids, 32, eos_id=engine.eos_id)
    assert result.tokens == ar.tokens
    benchmark.extra_info.update(tokens=len(result.tokens), target_forwards=result.target_forwards,
                                target_forwards_per_token=result.target_forwards / max(len(result.tokens), 1),
                                mean_acceptance_length=result.mean_acceptance_length)
