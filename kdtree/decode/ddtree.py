"""Speculative decoding (greedy or sampled) with a DFlash block drafter: DDTree (a best-first tree) and chain
(width 1).

Per round (docs/engine-contracts.md):
  draft      drafter block forward after the committed context -> logits of the next depth tokens
  tree_build per-depth top-`width` log-probs -> best-first tree of `budget` nodes (ops.tree_build)
  verify     ONE target forward over [bonus, nodes] at positions start + depth, ancestor-only visibility
  accept     greedy walk: follow the child equal to the target's argmax (ops.tree_accept) -> path, bonus
  commit     keep the latent-cache rows of bonus + path; their hidden states extend the drafter context
Every committed token is the target's own argmax given the committed prefix, so with batch-invariant ops
the output equals generate_ar's token for token (stop rules identical to AR).
Sampling (temperature > 0): accept is sampling.sampled_walk: each visited row's token is drawn from the
target's distribution with uniform(seed, output position), exactly as generate_ar draws it at that position,
so the output equals AR sampling with the same seed token for token; the drafter only changes the forward count.

Run: .venv/bin/python -m pytest -q tests/decode/test_ddtree_loop.py tests/decode/test_lossless.py
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from kdtree.decode.prefill import SharedPrefill, prefill_forward
from kdtree.decode.result import GenerationResult
from kdtree.decode.sampling import Sampler, SamplingParams, sampled_walk, token_logprob
from kdtree.errors import ConfigError


def tree_shape(tree_cfg, block_size: int) -> Tuple[int, int, int]:
    """(width, depth, budget) of a chain/ddtree config, validated against the drafter's block size."""
    kind = str(tree_cfg.kind)
    depth = int(tree_cfg.depth)
    if kind not in ("chain", "ddtree"):
        raise ConfigError(f"tree.kind={kind} is not a speculative kind; use tree=chain or tree=ddtree (or generate_ar)")
    if not 1 <= depth <= block_size - 1:
        raise ConfigError(f"tree.depth={depth} outside 1..{block_size - 1} (drafter block_size={block_size}); "
                          f"set tree.depth<={block_size - 1}")
    if kind == "chain":
        return 1, depth, depth
    width, budget = int(tree_cfg.width), int(tree_cfg.budget)
    if width < 1:
        raise ConfigError(f"tree.width={width} must be >= 1; set tree.width=1..8")
    if budget < 1:
        raise ConfigError(f"tree.budget={budget} must be >= 1 node; set tree.budget>=tree.depth, e.g. 32")
    return width, depth, budget


def generate_ddtree(model, drafter, tree_cfg, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_id: Optional[int] = None, stop_ids: Iterable[int] = (),
                    on_tokens: Optional[Callable[[List[int]], None]] = None,
                    sampling: Optional[SamplingParams] = None,
                    prefill: Optional[SharedPrefill] = None) -> GenerationResult:
    """Chain/DDTree decoding (greedy, or sampled with `sampling`) of `model` (K2Model) drafted by `drafter`
    (DFlashDrafter interface: block_size, target_layer_ids, new_cache(max_len), extend(cache, hiddens),
    draft(cache, bonus)).

    acceptance_lengths holds len(path) + 1 per verify round (before any max_new_tokens / eos cut).
    on_tokens(new_ids), when given, is called once per commit (the prefill's token, then each round's accepted
    path + bonus) with the tokens that commit added to `tokens`, cut exactly as `tokens` is (max_new_tokens,
    eos, stop ids); the concatenation of its calls equals `tokens`. An exception it raises ends the generation.
    sampling / prefill: as generate_ar's (kdtree/decode/ar.py).
    """
    t_start = time.perf_counter()
    width, depth, budget = tree_shape(tree_cfg, int(drafter.block_size))
    prompt = np.asarray(list(prompt_ids), np.int32)
    if prompt.size == 0:
        raise ConfigError("prompt is empty (0 tokens); give at least one token")
    stops = set(int(s) for s in stop_ids)
    layers = tuple(int(i) for i in drafter.target_layer_ids)
    ops = model.ops
    res = GenerationResult(tokens=[])
    st = res.stage_seconds
    top = sampling.logprobs if sampling is not None else None
    if top is not None:
        res.logprobs = []
    if max_new_tokens <= 0:
        if top is not None and sampling.echo:      # scoring a prompt (echo, max_tokens 0): its logprobs only
            prefill_forward(model, prompt, len(prompt), None, res, sampling)
        res.seconds = time.perf_counter() - t_start
        return res

    def emit(tokens, rows) -> bool:
        """Append committed tokens with AR's stop rules (and report them); True when generation is over.
        rows f32[len(tokens), V]: the target's logits row that predicted each token (for logprobs)."""
        n0 = len(res.tokens)
        over = False
        for t, row in zip(tokens, rows):
            t = int(t)
            if eos_id is not None and t == eos_id:
                res.finish_reason = "eos"
                over = True
                break
            if t in stops:
                res.finish_reason = "stop"
                over = True
                break
            res.tokens.append(t)
            if top is not None:
                res.logprobs.append(token_logprob(row, t, top))
            if len(res.tokens) >= max_new_tokens:
                res.finish_reason = "length"
                over = True
                break
        if on_tokens is not None and len(res.tokens) > n0:
            on_tokens(res.tokens[n0:])
        return over

    P = len(prompt)
    # latent rows before a verify: P + len(tokens) - 1 <= P + max_new - 2; the block adds 1 + budget
    t0 = time.perf_counter()
    cache, last, hid = prefill_forward(model, prompt, P + max_new_tokens + budget, prefill, res, sampling, layers)
    sampler = None
    if sampling is not None and not sampling.greedy:
        sampler = Sampler(sampling.resolved(), prompt)
        res.seed = sampler.seed
    bonus = int(np.argmax(last)) if sampler is None else sampler.sample(last)
    st["prefill"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    if hid is None:                                # the shared prefill's drafter context, rewound to the prompt
        dcache = prefill.dcache
    else:
        dcache = drafter.new_cache(P + max_new_tokens)
        drafter.extend(dcache, hid)
        if prefill is not None:
            prefill.dcache = dcache
    st["draft"] += time.perf_counter() - t0
    done = emit([bonus], [last])

    while not done:
        start = cache.length                       # position of the bonus (root of this round's tree)
        t0 = time.perf_counter()
        dlogits = drafter.draft(dcache, bonus)     # [B-1, V]
        res.draft_forwards += 1
        t1 = time.perf_counter()
        st["draft"] += t1 - t0
        logp, ids = ops.draft_topk(np.asarray(dlogits[:depth]), width)                        # [depth, width]
        tree = ops.tree_build(logp, ids, budget)
        t2 = time.perf_counter()
        st["tree_build"] += t2 - t1

        block = np.concatenate([[bonus], np.asarray(tree.tokens)]).astype(np.int32)           # [N+1]
        positions = (start + np.concatenate([[0], np.asarray(tree.depths)])).astype(np.int32)   # [N+1]
        logits, hid = model.forward(block, positions, cache, visibility=tree.visibility, hidden_layers=layers)
        res.target_forwards += 1
        t3 = time.perf_counter()
        st["verify"] += t3 - t2

        if sampler is None:
            argmax = np.argmax(logits, axis=-1).astype(np.int32)                                # [N+1]
            path, new_bonus = ops.tree_accept(np.asarray(tree.parents, np.int32),
                                              np.asarray(tree.tokens, np.int32), argmax)
        else:                                      # draw at each visited row, in output-position order
            path, new_bonus = sampled_walk(tree.parents, tree.tokens, lambda r: sampler.sample(logits[r]))
        path = np.asarray(path, np.int64)
        res.acceptance_lengths.append(int(path.size) + 1)
        t4 = time.perf_counter()
        st["accept"] += t4 - t3

        rows = np.concatenate([[0], path + 1])     # block rows of root + accepted path
        cache.keep(start, start + rows)
        committed = [int(t) for t in np.asarray(tree.tokens)[path]] + [int(new_bonus)]
        done = emit(committed, logits[rows] if top is not None else [None] * len(committed))
        bonus = int(new_bonus)
        t5 = time.perf_counter()
        st["commit"] += t5 - t4
        if not done:                               # the drafter's next context: root + path hidden states
            drafter.extend(dcache, {i: h[rows] for i, h in hid.items()})
            st["draft"] += time.perf_counter() - t5

    res.seconds = time.perf_counter() - t_start
    return res
