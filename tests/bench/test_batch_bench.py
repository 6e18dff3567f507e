"""Continuous batching on the embedded tiny model (pytest-benchmark; nothing about speed asserted).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest tests/bench/test_batch_bench.py --benchmark-enable \
        --benchmark-only
    (one BLAS thread: a multithreaded GEMM on a shared 2-core VM is ~10x slower than the per-row path and would
    measure the contention, not the exactness)

Group batch(backend=B): the same 16 requests (64 tokens each, ddtree w4 d7 b8) decoded one after another
(`solo`, what a one-request-at-a-time server does) and together by the Scheduler (`batched`).
Group exactness_cost(numpy): the batched run with the batch-invariant linear (one GEMV per row, every answer
equals its solo run: asserted) against the same run with linear = one GEMM over the step's rows (linear_fast, not
batch-invariant): the ratio of the two is what exactness costs here; extra_info counts the requests whose tokens
then differ from their solo run.
"""
from __future__ import annotations

import copy

import pytest

from kdtree.backends.numpy_ops import NumpyOps
from kdtree.decode.request import Request
from kdtree.decode.scheduler import Scheduler
from kdtree.engine import Engine
from tests.native_lib import CPU_ERROR, CPU_SKIPPED

N_REQUESTS, N_TOKENS = 16, 64
_engines = {}


def _engine(compose_cfg, backend):
    if backend not in _engines:
        if backend == "cpu" and CPU_SKIPPED:
            pytest.skip(f"libkdtree_cpu.so not usable ({CPU_ERROR}); make native")
        _engines[backend] = Engine.from_config(compose_cfg(f"backend={backend}", "tree.budget=8",
                                                           "load.progress=false"))
    return _engines[backend]


def _prompts(engine):
    from kdtree.config.validate import read_prompts
    texts = read_prompts("")
    return [engine.tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(N_REQUESTS)]


def _batched(engine, model, prompts):
    s = Scheduler(model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context)
    reqs = [s.submit(Request(p, N_TOKENS)) for p in prompts]
    while s.step():
        pass
    return [r.result.tokens for r in reqs]


class _GemmOps(NumpyOps):
    """numpy ops with one GEMM over all rows for the target's linears: faster, NOT batch-invariant."""

    def linear(self, x, w):
        return self.linear_fast(x, w)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["solo", "batched"])
def test_batch(benchmark, compose_cfg, backend, mode):
    engine = _engine(compose_cfg, backend)
    prompts = _prompts(engine)
    benchmark.group = f"batch(backend={backend})"
    if mode == "solo":
        out = benchmark.pedantic(lambda: [engine.generate(p, N_TOKENS).tokens for p in prompts], rounds=3)
    else:
        out = benchmark.pedantic(_batched, args=(engine, engine.model, prompts), rounds=3)
    assert out == [engine.generate(p, N_TOKENS).tokens for p in prompts]
    benchmark.extra_info.update(requests=N_REQUESTS, tokens=sum(len(t) for t in out))


@pytest.mark.parametrize("linear", ["gemv_per_row_exact", "gemm_not_invariant"])
def test_exactness_cost(benchmark, compose_cfg, linear):
    engine = _engine(compose_cfg, "numpy")
    prompts = _prompts(engine)
    model = engine.model
    if linear == "gemm_not_invariant":
        model = copy.copy(engine.model)
        model.ops = _GemmOps()
    benchmark.group = "exactness_cost(numpy)"
    out = benchmark.pedantic(_batched, args=(engine, model, prompts), rounds=3)
    solo = [engine.generate(p, N_TOKENS).tokens for p in prompts]
    differ = sum(a != b for a, b in zip(out, solo))
    if linear == "gemv_per_row_exact":
        assert differ == 0
    benchmark.extra_info.update(requests=N_REQUESTS, tokens=sum(len(t) for t in out), differ_from_solo=differ)
