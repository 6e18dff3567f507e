"""Autoregressive decoding (greedy or sampled): the baseline every speculative loop must reproduce token for token.

One prefill forward over the prompt (counted as one target forward), then one forward per new token.
Greedy = np.argmax (ties -> lowest id). Stops at eos_id (finish "eos") or a token in stop_ids (finish
"stop"); the eos/stop token is not included in `tokens`. Otherwise stops after max_new_tokens ("length").
`on_tokens(new_ids)`, when given, is called with each token as it is committed (live streaming); the
concatenation of its calls equals `tokens`. An exception it raises ends the generation (cancellation).
`sampling` (SamplingParams with a seed, kdtree/decode/sampling.py) with temperature > 0 draws each token from
the target's processed distribution with uniform(seed, output position) instead of the argmax; logprobs/echo
record the raw distribution's log-probabilities. `prefill` (SharedPrefill) shares one prompt forward among
the n samples of a request.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from kdtree.decode.prefill import SharedPrefill, prefill_forward
from kdtree.decode.result import GenerationResult
from kdtree.decode.sampling import Sampler, SamplingParams, token_logprob
from kdtree.errors import ConfigError


def generate_ar(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_id: Optional[int] = None,
                stop_ids: Iterable[int] = (),
                on_tokens: Optional[Callable[[List[int]], None]] = None,
                sampling: Optional[SamplingParams] = None,
                prefill: Optional[SharedPrefill] = None) -> GenerationResult:
    t_start = time.perf_counter()
    prompt = np.asarray(list(prompt_ids), np.int32)
    if prompt.size == 0:
        raise ConfigError("prompt is empty (0 tokens); give at least one token")
    stops = set(int(s) for s in stop_ids)
    res = GenerationResult(tokens=[])
    top = sampling.logprobs if sampling is not None else None
    if top is not None:
        res.logprobs = []
    if max_new_tokens <= 0:
        if top is not None and sampling.echo:      # scoring a prompt (echo, max_tokens 0): its logprobs only
            prefill_forward(model, prompt, len(prompt), None, res, sampling)
        res.seconds = time.perf_counter() - t_start
        return res

    t0 = time.perf_counter()
    cache, row, _ = prefill_forward(model, prompt, len(prompt) + max_new_tokens, prefill, res, sampling)
    res.stage_seconds["prefill"] += time.perf_counter() - t0
    sampler = None
    if sampling is not None and not sampling.greedy:
        sampler = Sampler(sampling.resolved(), prompt)
        res.seed = sampler.seed
    pos = len(prompt)
    while True:
        nxt = int(np.argmax(row)) if sampler is None else sampler.sample(row)
        if eos_id is not None and nxt == eos_id:
            res.finish_reason = "eos"
            break
        if nxt in stops:
            res.finish_reason = "stop"
            break
        res.tokens.append(nxt)
        if top is not None:
            res.logprobs.append(token_logprob(row, nxt, top))
        if on_tokens is not None:
            on_tokens([nxt])
        if len(res.tokens) >= max_new_tokens:
            res.finish_reason = "length"
            break
        t0 = time.perf_counter()
        logits, _ = model.forward(np.array([nxt], np.int32), np.array([pos], np.int32), cache)
        row = logits[-1]
        res.stage_seconds["verify"] += time.perf_counter() - t0
        res.target_forwards += 1
        res.acceptance_lengths.append(1)
        pos += 1
    res.seconds = time.perf_counter() - t_start
    return res
