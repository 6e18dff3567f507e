"""Decoding: one request's round (kdtree/decode/state.py, DecodeState) stepped by the scheduler
(kdtree/decode/scheduler.py), alone or batched. AR, chain and DDTree, greedy and sampled, are configurations of the
same state; every kind returns the same tokens (the lossless invariant).

`generate(...)` is a one-request loop over a scheduler of its own (the engine's `Engine.generate` uses the engine's
scheduler, the one the server runs); `generate_n(...)` draws n samples of one prompt sharing its prefill.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence

from kdtree.decode.prefill import SharedPrefill
from kdtree.decode.request import Request
from kdtree.decode.result import GenerationResult
from kdtree.decode.sampling import SamplingParams
from kdtree.decode.scheduler import Scheduler
from kdtree.errors import ConfigError


def run_request(scheduler: Scheduler, req: Request) -> GenerationResult:
    """Submit `req`, step (or wait) until it is done; its result, or its error raised."""
    scheduler.drive(scheduler.submit(req))
    if req.error is not None:
        raise req.error
    return req.result


def solo_scheduler(model, drafter, tree_cfg, eos_id: Optional[int], prompt_len: int) -> Scheduler:
    """A scheduler for one caller's requests on `model`: it takes pages of the model's pool without reserving it (a
    pool nobody reserved grows on demand; an engine's reserved one is left as it is)."""
    ctx = int(model.cfg.max_position_embeddings)
    return Scheduler(model, drafter, tree_cfg, eos_id, ctx, max_batch_tokens=max(512, int(prompt_len)),
                     pool_tokens=ctx, reserve_pool=False)


def generate(model, drafter, tree_cfg, prompt_ids: Sequence[int], max_new_tokens: int,
             eos_id: Optional[int] = None, stop_ids: Iterable[int] = (),
             on_tokens: Optional[Callable[[List[int]], None]] = None,
             sampling: Optional[SamplingParams] = None,
             prefill: Optional[SharedPrefill] = None) -> GenerationResult:
    """One completion with tree_cfg.kind = ar | chain | ddtree (drafter unused, may be None, for ar).
    on_tokens(new_ids): called after each commit with the tokens it added (live streaming; the concatenation of
    its calls equals `tokens`; an exception it raises ends the generation and is raised here).
    sampling None or temperature 0: greedy (argmax, penalised when penalties are set); else sampled with
    sampling.seed (a random one if None, reported in result.seed). prefill: shared by generate_n's samples."""
    if str(tree_cfg.kind) not in ("ar", "chain", "ddtree"):
        raise ConfigError(f"tree.kind={tree_cfg.kind} is unknown; use tree=ar, tree=chain or tree=ddtree")
    prompt = list(prompt_ids)
    req = Request(prompt, int(max_new_tokens), sampling=sampling, tree=tree_cfg, stop_ids=tuple(stop_ids),
                  on_tokens=on_tokens, prefill=prefill)
    return run_request(solo_scheduler(model, drafter, tree_cfg, eos_id, len(prompt)), req)


def generate_n(model, drafter, tree_cfg, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos_id: Optional[int] = None, stop_ids: Iterable[int] = (),
               on_tokens: Optional[Callable[[int, List[int]], None]] = None,
               scheduler: Optional[Scheduler] = None) -> List[GenerationResult]:
    """sampling.n independent samples of one prompt: sample i uses sampling.for_sample(i) (i = 0: the request's
    seed), all share one prefill forward. on_tokens(i, new_ids) streams sample i's commits. Each result's
    target_forwards counts the prefill only in sample 0."""
    base = sampling.resolved()
    sched = scheduler or solo_scheduler(model, drafter, tree_cfg, eos_id, len(prompt_ids))
    shared = SharedPrefill()
    out = []
    try:
        for i in range(base.n):
            cb = None if on_tokens is None else (lambda ids, i=i: on_tokens(i, ids))
            req = Request(list(prompt_ids), int(max_new_tokens), sampling=base.for_sample(i), tree=tree_cfg,
                          stop_ids=tuple(stop_ids), on_tokens=cb, prefill=shared)
            out.append(run_request(sched, req))
    finally:
        shared.close()
    return out


__all__ = ["GenerationResult", "Request", "SamplingParams", "Scheduler", "SharedPrefill", "generate", "generate_n",
           "run_request"]
