"""Decoding loops: AR (kdtree/decode/ar.py) and chain/DDTree speculative (kdtree/decode/ddtree.py).

`generate(...)` picks the loop from tree.kind; every kind returns the same tokens (the lossless invariant),
greedy or sampled with the same seed (kdtree/decode/sampling.py). `generate_n(...)` draws n samples of one
prompt sharing its prefill.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence

from kdtree.decode.ar import generate_ar
from kdtree.decode.ddtree import generate_ddtree
from kdtree.decode.prefill import SharedPrefill
from kdtree.decode.result import GenerationResult
from kdtree.decode.sampling import SamplingParams
from kdtree.errors import ConfigError


def generate(model, drafter, tree_cfg, prompt_ids: Sequence[int], max_new_tokens: int,
             eos_id: Optional[int] = None, stop_ids: Iterable[int] = (),
             on_tokens: Optional[Callable[[List[int]], None]] = None,
             sampling: Optional[SamplingParams] = None,
             prefill: Optional[SharedPrefill] = None) -> GenerationResult:
    """Generation with tree_cfg.kind = ar | chain | ddtree (drafter unused, may be None, for ar).
    on_tokens(new_ids): called after each commit with the tokens it added (live streaming); see the loops.
    sampling None or temperature 0: greedy (argmax); else sampled with sampling.seed (a random one if None,
    reported in result.seed). prefill: a SharedPrefill reused across calls with the same prompt and loop."""
    kind = str(tree_cfg.kind)
    if kind == "ar":
        return generate_ar(model, prompt_ids, max_new_tokens, eos_id=eos_id, stop_ids=stop_ids, on_tokens=on_tokens,
                           sampling=sampling, prefill=prefill)
    if kind in ("chain", "ddtree"):
        if drafter is None:
            raise ConfigError(f"tree.kind={kind} needs the DFlash drafter but none is loaded; "
                              f"add <checkpoint>/drafter/ or use tree=ar")
        return generate_ddtree(model, drafter, tree_cfg, prompt_ids, max_new_tokens, eos_id=eos_id, stop_ids=stop_ids,
                               on_tokens=on_tokens, sampling=sampling, prefill=prefill)
    raise ConfigError(f"tree.kind={kind} is unknown; use tree=ar, tree=chain or tree=ddtree")


def generate_n(model, drafter, tree_cfg, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos_id: Optional[int] = None, stop_ids: Iterable[int] = (),
               on_tokens: Optional[Callable[[int, List[int]], None]] = None) -> List[GenerationResult]:
    """sampling.n independent samples of one prompt: sample i uses sampling.for_sample(i) (i = 0: the request's
    seed), all share one prefill forward. on_tokens(i, new_ids) streams sample i's commits. Each result's
    target_forwards counts the prefill only in sample 0."""
    base = sampling.resolved()
    shared = SharedPrefill()
    out = []
    for i in range(base.n):
        cb = None if on_tokens is None else (lambda ids, i=i: on_tokens(i, ids))
        out.append(generate(model, drafter, tree_cfg, prompt_ids, max_new_tokens, eos_id=eos_id, stop_ids=stop_ids,
                            on_tokens=cb, sampling=base.for_sample(i), prefill=shared))
    return out


__all__ = ["GenerationResult", "SamplingParams", "SharedPrefill", "generate", "generate_n"]
