"""Cost of one sampled draw next to the greedy argmax it replaces (pytest-benchmark; nothing about speed asserted).

    .venv/bin/python -m pytest tests/bench/test_sampling_bench.py --benchmark-enable --benchmark-only
    .venv/bin/pytest-benchmark compare --group-by=group

Group draw(V=163840): one row of K2's vocabulary; argmax (greedy) is the baseline, then temperature only, top-k,
top-p and the penalties; extra_info has the kept tokens so a top-p cost reads next to the nucleus size.
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.decode.sampling import SamplingParams, distribution, sample_token, uniform

V = 163840  # K2's vocab_size
CASES = {"argmax": None, "temperature": {}, "top_k50": {"top_k": 50}, "top_p0.95": {"top_p": 0.95},
         "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2}}


@pytest.fixture(scope="module")
def row():
    # a peaked row like a trained LM's: a few likely tokens over a long flat tail, f32[V]
    rng = np.random.default_rng(0)
    z = rng.standard_normal(V).astype(np.float32)
    z[rng.choice(V, 20, replace=False)] += 12.0
    return z


@pytest.mark.parametrize("case", list(CASES))
def test_draw(benchmark, row, case):
    benchmark.group = f"draw(V={V})"
    kw = CASES[case]
    if kw is None:
        tok = benchmark(lambda: int(np.argmax(row)))
        assert tok == int(np.argmax(row))
        return
    p = SamplingParams(temperature=0.8, **kw)
    counts = {int(t): 2 for t in range(0, V, 997)} if "repetition_penalty" in kw else None
    tok = benchmark(sample_token, row, p, uniform(1, 0), counts, list(range(64)))
    ids, _ = distribution(row, p, counts, list(range(64)))
    assert tok in set(ids.tolist())
    benchmark.extra_info.update(kept_tokens=int(ids.size))
