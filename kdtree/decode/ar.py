"""Greedy autoregressive decoding: the baseline every speculative loop must reproduce token for token.

One prefill forward over the prompt (counted as one target forward), then one forward per new token.
Greedy = np.argmax (ties -> lowest id). Stops at eos_id (finish "eos") or a token in stop_ids (finish
"stop"); the eos/stop token is not included in `tokens`. Otherwise stops after max_new_tokens ("length").
`on_tokens(new_ids)`, when given, is called with each token as it is committed (live streaming); the
concatenation of its calls equals `tokens`. An exception it raises ends the generation (cancellation).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from kdtree.decode.result import GenerationResult
from kdtree.errors import ConfigError


def generate_ar(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_id: Optional[int] = None,
                stop_ids: Iterable[int] = (),
                on_tokens: Optional[Callable[[List[int]], None]] = None) -> GenerationResult:
    t_start = time.perf_counter()
    prompt = np.asarray(list(prompt_ids), np.int32)
    if prompt.size == 0:
        raise ConfigError("prompt is empty (0 tokens); give at least one token")
    stops = set(int(s) for s in stop_ids)
    res = GenerationResult(tokens=[])
    if max_new_tokens <= 0:
        res.seconds = time.perf_counter() - t_start
        return res
    cache = model.new_cache(len(prompt) + max_new_tokens)

    t0 = time.perf_counter()
    logits, _ = model.forward(prompt, np.arange(len(prompt), dtype=np.int32), cache)
    res.stage_seconds["prefill"] += time.perf_counter() - t0
    res.target_forwards = 1
    pos = len(prompt)
    while True:
        nxt = int(np.argmax(logits[-1]))
        if eos_id is not None and nxt == eos_id:
            res.finish_reason = "eos"
            break
        if nxt in stops:
            res.finish_reason = "stop"
            break
        res.tokens.append(nxt)
        if on_tokens is not None:
            on_tokens([nxt])
        if len(res.tokens) >= max_new_tokens:
            res.finish_reason = "length"
            break
        t0 = time.perf_counter()
        logits, _ = model.forward(np.array([nxt], np.int32), np.array([pos], np.int32), cache)
        res.stage_seconds["verify"] += time.perf_counter() - t0
        res.target_forwards += 1
        res.acceptance_lengths.append(1)
        pos += 1
    res.seconds = time.perf_counter() - t_start
    return res
