"""Lossless invariant: greedy chain/DDTree output == greedy AR output token for token, for many prompts and
tree shapes, at max_new_tokens cuts and with eos inside accepted paths, fp32 and INT4 experts, numpy and
the native cpu backend.

The drafter is scripted from the AR continuation with the true token at rank 0 / 1 / 2 / 3 / absent per
(position, depth), so rounds accept long paths, side branches (ranks > 0 need width > rank) and nothing.
Run: .venv/bin/python -m pytest -q tests/decode/test_lossless.py
"""
from __future__ import annotations

import zlib

import pytest

from kdtree.backends import get_ops
from kdtree.config.schema import TreeConfig
from kdtree.decode import generate
from tests.decode.loops import generate_ar
from kdtree.errors import KdtreeError
from kdtree.model.k2 import K2Model
from kdtree.model.target import build_target
from scripted_drafter import PROMPTS, int4_weights, noisy_rank, scripted

N_NEW = 31

SHAPES = {  # id: (kind, width, depth, budget)
    "chain-d7": ("chain", 1, 7, 7),
    "chain-d1": ("chain", 1, 1, 1),
    "chain-d4": ("chain", 1, 4, 4),
    "w1-d7-b7": ("ddtree", 1, 7, 7),
    "w2-d3-b5": ("ddtree", 2, 3, 5),
    "w3-d5-b1": ("ddtree", 3, 5, 1),
    "w4-d7-b32": ("ddtree", 4, 7, 32),
    "w4-d2-b64": ("ddtree", 4, 2, 64),
    "w8-d7-b72": ("ddtree", 8, 7, 72),
}


@pytest.fixture(scope="module")
def ar_runs(tiny_model, tiny_cfg):
    """prompt name -> greedy AR tokens, long enough to script every draft."""
    return {name: generate_ar(tiny_model, p, N_NEW + tiny_cfg.drafter.block_size).tokens
            for name, p in PROMPTS.items()}


def run_both(model, cfg, prompt, ar_long, shape, seed, max_new, **stop):
    ar = generate_ar(model, prompt, max_new, **stop)
    assert ar.tokens == ar_long[: len(ar.tokens)]
    drafter = scripted(prompt + ar_long, cfg, rank=noisy_rank(seed), seed=seed)
    res = generate(model, drafter, TreeConfig(*shape), prompt, max_new, **stop)
    return ar, res


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ddtree_equals_ar(tiny_model, tiny_cfg, ar_runs, prompt, shape):
    ar, res = run_both(tiny_model, tiny_cfg, PROMPTS[prompt], ar_runs[prompt], SHAPES[shape],
                       seed=zlib.crc32(f"{prompt}/{shape}".encode()) % 1000, max_new=N_NEW)
    assert res.tokens == ar.tokens and res.finish_reason == ar.finish_reason == "length"
    assert res.target_forwards == 1 + len(res.acceptance_lengths) <= ar.target_forwards


def test_side_branches_are_accepted(tiny_model, tiny_cfg, ar_runs):
    """Same scripted drafter: a wide tree accepts true tokens drafted at rank 1-3 that a chain misses."""
    prompt = "text"
    forwards = {}
    for shape in ("chain-d7", "w4-d7-b32"):
        _, res = run_both(tiny_model, tiny_cfg, PROMPTS[prompt], ar_runs[prompt], SHAPES[shape], seed=3,
                          max_new=N_NEW)
        forwards[shape] = res.target_forwards
        assert res.mean_acceptance_length > 1.5
    assert forwards["w4-d7-b32"] < forwards["chain-d7"]


@pytest.mark.parametrize("max_new", [1, 2, 5, 13, 24])
@pytest.mark.parametrize("shape", ["chain-d7", "w2-d3-b5", "w4-d7-b32"])
def test_max_new_tokens_boundaries(tiny_model, tiny_cfg, ar_runs, shape, max_new):
    ar, res = run_both(tiny_model, tiny_cfg, PROMPTS["text"], ar_runs["text"], SHAPES[shape], seed=max_new,
                       max_new=max_new)
    assert res.tokens == ar.tokens and len(res.tokens) == max_new and res.finish_reason == "length"


@pytest.mark.parametrize("prompt", ["text", "bytes"])
@pytest.mark.parametrize("shape", ["chain-d7", "w4-d7-b32", "w2-d3-b5"])
def test_eos_inside_accepted_path(tiny_model, tiny_cfg, ar_runs, prompt, shape):
    toks = ar_runs[prompt][:N_NEW]
    # eos = a token AR emits mid-sequence (first occurrence at index >= 5): AR stops there
    idx = next(i for i in range(5, len(toks)) if toks[i] not in toks[:i])
    ar, res = run_both(tiny_model, tiny_cfg, PROMPTS[prompt], ar_runs[prompt], SHAPES[shape], seed=idx,
                       max_new=N_NEW, eos_id=toks[idx])
    assert ar.finish_reason == "eos" and len(ar.tokens) == idx
    assert res.tokens == ar.tokens and res.finish_reason == "eos"
    # and with an agreeing drafter the eos sits inside a long accepted path
    agree = generate(tiny_model, scripted(PROMPTS[prompt] + ar_runs[prompt], tiny_cfg), TreeConfig(*SHAPES[shape]),
                     PROMPTS[prompt], N_NEW, eos_id=toks[idx])
    assert agree.tokens == ar.tokens and agree.finish_reason == "eos"


@pytest.fixture(scope="module")
def int4_model(tiny_cfg, tiny_weights, tiny_model):
    return K2Model(tiny_cfg, int4_weights(tiny_cfg, tiny_weights), tiny_model.ops)


@pytest.mark.parametrize("prompt", ["text", "bytes"])
@pytest.mark.parametrize("shape", ["chain-d7", "w4-d7-b32", "w3-d5-b1"])
def test_int4_experts_ddtree_equals_ar(int4_model, tiny_cfg, prompt, shape):
    ar_long = generate_ar(int4_model, PROMPTS[prompt], 24 + tiny_cfg.drafter.block_size).tokens
    ar, res = run_both(int4_model, tiny_cfg, PROMPTS[prompt], ar_long, SHAPES[shape], seed=5, max_new=24)
    assert res.tokens == ar.tokens and res.finish_reason == "length"


@pytest.fixture(scope="module")
def native_model(tiny_cfg, tiny_weights):
    try:
        ops = get_ops("cpu")
    except KdtreeError as e:
        pytest.skip(f"backend=cpu unavailable ({e})")
    return build_target(tiny_cfg, tiny_weights, ops)


@pytest.mark.parametrize("shape", ["chain-d7", "w4-d7-b32", "w8-d7-b72"])
def test_native_cpu_backend_ddtree_equals_ar(native_model, tiny_cfg, shape):
    """backend=cpu: native tree build/accept and tree-verify attention in the loop."""
    prompt = PROMPTS["bytes"]
    ar_long = generate_ar(native_model, prompt, 24 + tiny_cfg.drafter.block_size).tokens
    ar, res = run_both(native_model, tiny_cfg, prompt, ar_long, SHAPES[shape], seed=7, max_new=24)
    assert res.tokens == ar.tokens and res.finish_reason == "length"


@pytest.fixture(scope="module")
def cuda_model(tiny_cfg, tiny_weights):
    from kdtree.backends import native
    if native.cuda_device_count() == 0:
        pytest.skip(f"no CUDA device: {native.CUDA_REASON}")
    return build_target(tiny_cfg, tiny_weights, get_ops("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["chain-d7", "w4-d7-b32", "w8-d7-b72"])
def test_cuda_backend_ddtree_equals_ar(cuda_model, tiny_cfg, shape):
    """backend=cuda: the CUDA whole forward (graphs for 1 and budget+1 rows) in the loop, token for token AR's."""
    assert cuda_model.graph_rows([1, SHAPES[shape][3] + 1])
    prompt = PROMPTS["bytes"]
    ar_long = generate_ar(cuda_model, prompt, 24 + tiny_cfg.drafter.block_size).tokens
    ar, res = run_both(cuda_model, tiny_cfg, prompt, ar_long, SHAPES[shape], seed=7, max_new=24)
    assert res.tokens == ar.tokens and res.finish_reason == "length"
    assert cuda_model.graph_stats()["replays"] > 0
