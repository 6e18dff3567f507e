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

from kdtree.engine import AR_TREE, Engine
from tests.native_lib import CPU_ERROR, CPU_SKIPPED

PROMPT = "def __init__(self, "
TREES = {
    "ar": {"kind": "ar", "width": 1, "depth": 0, "budget": 0},
    "chain_d7": {"kind": "chain", "width": 1, "depth": 7, "budget": 7},
    "ddtree_w4_d7_b32": {"kind": "ddtree", "width": 4, "depth": 7, "budget": 32},
}
_engines = {}


def _engine(compose_cfg, backend):
    if backend not in _engines:
        if backend == "cpu" and CPU_SKIPPED:
            pytest.skip(f"libkdtree_cpu.so not usable ({CPU_ERROR}); make native")
        _engines[backend] = Engine.from_config(compose_cfg(f"backend={backend}", "load.progress=false"))
    return _engines[backend]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("tree", list(TREES))
def test_generate(benchmark, compose_cfg, backend, tree):
    engine = _engine(compose_cfg, backend)
    benchmark.group = f"generate(backend={backend})"
    ids = engine.tokenizer.encode(PROMPT)
    tree_cfg = OmegaConf.create(TREES[tree])
    result = benchmark.pedantic(engine.generate, args=(ids, 32), kwargs={"tree": tree_cfg}, rounds=3, iterations=1)
    ar = engine.generate(ids, 32, tree=AR_TREE)
    assert result.tokens == ar.tokens
    benchmark.extra_info.update(tokens=len(result.tokens), target_forwards=result.target_forwards,
                                target_forwards_per_token=result.target_forwards / max(len(result.tokens), 1),
                                mean_acceptance_length=result.mean_acceptance_length)
