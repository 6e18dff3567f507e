"""DecodeState: one request's decode round -- the one place where kdtree decides tokens.

Every path that produces tokens (Engine.generate, the demo, warm-up, bench, training's evaluation, every request
the server answers) runs this round through the Scheduler (kdtree/decode/scheduler.py), alone or batched:

    block = state.plan(rows, speculate)        # the rows this request feeds the next forward
    ...one Target.forward_batch over every request's block...
    over = state.advance(block, logits, argmax, hiddens, seconds)

  prefill  plan: the next chunk of the prompt (causal). advance: keep the chunk's hidden rows for the drafter;
           after the last chunk draw the first token from the last row and commit it
  ar       plan: one row, the last committed token at its position. advance: draw, commit
  tree     plan: drafter block forward after the committed context -> top-`width` per depth -> best-first tree
           of `budget` nodes -> the block [bonus, nodes] at positions start + depth, ancestor-only visibility.
           advance: the accept walk (greedy: ops.tree_accept over the target's argmax; sampled or penalised:
           sampled_walk, drawing at each visited row in output order) -> keep the accepted rows in the latent
           cache -> commit -> the drafter's context grows by the accepted rows' hidden states
  commit   result.commit_tokens, the one stop rule (eos, stop ids, max_new_tokens), then the stop strings

AR, chain (width 1) and DDTree, greedy and sampled, are configurations of this one state. Every committed token
is the target's own choice at its position (the argmax, the penalised argmax, or the draw with
uniform(seed, position)), given the committed prefix, so with batch-invariant ops the tokens are the same for
every tree, alone or batched; the drafter only changes how many forwards they take.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from kdtree.decode.cost import (EXPLORE, best_prefix, node_scores, policy_of, prefix_tree, subtree_values,
                                tree_option)
from kdtree.decode.grammar import choose_rows, constrain_tree
from kdtree.decode.request import ContextLengthExceeded, Request
from kdtree.decode.result import commit_tokens
from kdtree.decode.sampling import Sampler, prompt_logprobs, sampled_walk, token_logprob
from kdtree.errors import ConfigError
from kdtree.tree import Tree


# tree.prune_experts: a verify's bytes in AR steps where pruning matters (tiny_wide: 1.7-2.0 for 8-33 draft rows)
PRUNE_VERIFY_STEPS = 2.0


def tree_shape(tree_cfg, block_size: int) -> Tuple[int, int, int]:
    """(width, depth, budget) of a chain/ddtree config, validated against the drafter's block size."""
    kind = str(tree_cfg.kind)
    depth = int(tree_cfg.depth)
    if kind not in ("chain", "ddtree"):
        raise ConfigError(f"tree.kind={kind} is unknown; use tree=ar, tree=chain or tree=ddtree")
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


def request_shape(tree_cfg, drafter, prompt_len: int, max_new_tokens: int, max_context: int,
                  pool_tokens: int) -> Tuple[int, int, int, int]:
    """(width, depth, budget, latent rows to reserve) of a request; raises the one-line error a client sees.
    Rows: the prompt, max_new_tokens and one verify block (root + budget nodes) past them."""
    P, n = int(prompt_len), int(max_new_tokens)
    if P == 0:
        raise ConfigError("prompt is empty (0 tokens); give at least one token")
    if n < 0:
        raise ConfigError(f"max_tokens={n} must be >= 0")
    if str(tree_cfg.kind) == "ar":
        width = depth = budget = 0
    else:
        if drafter is None:
            raise ConfigError(f"tree.kind={tree_cfg.kind} needs the DFlash drafter but none is loaded; "
                              f"add <checkpoint>/drafter/ or use tree=ar")
        width, depth, budget = tree_shape(tree_cfg, int(drafter.block_size))
    need = P + n + (budget + 1 if budget else 0)
    limit = min(int(max_context), int(pool_tokens))
    if need > limit:
        what = (f"the context of {max_context} tokens" if limit == int(max_context)
                else f"the latent cache pool of {pool_tokens} tokens (serve.kv_pool_tokens)")
        raise ContextLengthExceeded(
            f"prompt of {P} tokens + max_tokens={n}" + (f" + tree budget {budget + 1}" if budget else "")
            + f" = {need} tokens exceeds {what}; shorten the prompt or lower max_tokens")
    return width, depth, budget, need


@dataclass
class Block:
    """The rows one request feeds one forward."""
    kind: str                              # prefill | ar | tree
    tokens: np.ndarray                     # i32[T]
    positions: np.ndarray                  # i32[T]
    visibility: Optional[np.ndarray]       # u64[T, ceil(T/64)] ancestor-only (tree); None = causal
    start: int                             # cache rows before the block (prefill: prompt rows already in)
    tree: Optional[Tree] = None
    masks: Optional[np.ndarray] = None     # tree under a grammar: u32[T, ceil(V/32)] the tokens each row may choose
    values: Optional[np.ndarray] = None    # tree.prune_experts: f32[T] the tokens each row's subtree should commit
    pruned: Optional[np.ndarray] = None    # set by the scheduler after the forward: u8[T], 1 = the forward pruned it

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


def _joined(parts: List[Dict[int, np.ndarray]]) -> Dict[int, np.ndarray]:
    """Hidden rows kept step by step ({layer: f32[n, D]} each) as one {layer: f32[sum n, D]} for drafter.extend."""
    return {i: np.concatenate([p[i] for p in parts]) for i in parts[0]}


class DecodeState:
    """A running request's decode state (created by the scheduler at submit, alive until it finishes)."""

    def __init__(self, req: Request, model, drafter, tree_cfg, eos_id: Optional[int], max_context: int,
                 pool_tokens: int, prefix=None):
        self.req, self.model, self.ops = req, model, model.ops
        self.prompt = np.asarray(list(req.prompt_ids), np.int32)                      # i32[P]
        self.width, self.depth, self.budget, self.need = request_shape(
            tree_cfg, drafter, len(self.prompt), req.max_new_tokens, max_context, pool_tokens)
        self.drafter = drafter if self.budget else None
        self.layers = tuple(int(i) for i in drafter.target_layer_ids) if self.budget else ()
        self.eos_id = eos_id
        self.max_new = int(req.max_new_tokens)
        self.stops = frozenset(int(s) for s in req.stop_ids)
        self.cache: Any = None                 # the target's latent cache (need rows: a page table), from allocate()
        self.dcache: Any = None                # the drafter's context cache (speculative kinds; the same pages)
        self.owns_cache = True                 # False: a SharedPrefill's (generate_n) cache, kept after finish
        self.prefilled = 0                     # prompt rows already in the cache
        self.prompt_hid: List[Dict[int, np.ndarray]] = []    # prefill chunks' hidden states (the drafter's context)
        self.pending_hid: List[Dict[int, np.ndarray]] = []   # committed rows the drafter has not seen yet (rows
        # stepped as AR; with the prefix cache also the last round's, so that its pages carry drafter rows)
        self.bonus = -1                        # speculative: the root of the next tree
        sp = req.sampling
        # sampled, or greedy with penalties (the penalised argmax): drawn row by row; plain greedy: the argmax
        self.sampler = (Sampler(sp if sp.greedy else sp.resolved(), self.prompt)
                        if sp is not None and self.max_new > 0 and (not sp.greedy or sp.penalized) else None)
        if self.sampler is not None and not sp.greedy:
            req.result.seed = self.sampler.seed
        self.top = None if sp is None or sp.logprobs is None else int(sp.logprobs)
        self.echo = self.top is not None and bool(sp.echo)
        if self.top is not None:
            req.result.logprobs = []
            if self.echo:
                req.result.prompt_logprobs = [None]
        # the prefix cache (kdtree/decode/prefix_cache.py); not with echo (it needs every prompt row's logits)
        self.prefix = prefix if prefix is not None and not self.echo and self.max_new > 0 else None
        self.grammar = req.grammar             # a GrammarState: each row's choice is masked by the state it reached
        self.policy = policy_of(tree_cfg) if self.budget else "fixed"
        self.prune = bool(self.budget and tree_option(tree_cfg, "prune_experts", False)
                          and getattr(model, "expert_cost", None) is not None)
        self.costs = None                      # tree.policy=cost: the scheduler's ForwardCosts (kdtree/decode/cost.py)
        self.solo = False                      # set by the scheduler: this round's forward is this request's alone
        self.plain_steps = 0                   # tree.policy=cost: AR steps taken since plain steps were faster
        self.round_draft_s = 0.0
        self.round_expected = 0.0              # the drafted tokens the chosen prefix expects to accept

    # -- life cycle (the scheduler) ---------------------------------------------------------------------------
    @property
    def needs_forward(self) -> bool:
        """False when there is nothing to compute (max_tokens 0 without echo): done at submit."""
        return self.max_new > 0 or self.echo

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    def allocate(self) -> bool:
        """Take the request's caches (CachePoolBusy: wait, nothing taken). With the prefix cache, the pages of the
        longest cached prefix (whole pages, at most P - 1 tokens: the last prompt row is computed for its logits) are
        mapped first -- zero-copy, the drafter's context rows with them -- and the prefill starts after them. With a
        SharedPrefill already computed, reuse its caches rewound to the prompt and commit the first token from its
        last row; True when that finished it."""
        shared = self.req.prefill
        if shared is not None and shared.done:
            if shared.cache.max_len < self.need:
                raise ValueError(f"shared prefill cache of {shared.cache.max_len} rows < {self.need} needed")
            shared.rewind()
            self.cache, self.dcache, self.owns_cache = shared.cache, shared.dcache, False
            self.prefilled = len(self.prompt)
            if self.echo:
                self.req.result.prompt_logprobs = shared.prompt_logprobs
            return self._first_token(shared.last_logits[None, :], None, 0)
        path = []
        if self.prefix is not None:
            path = self.prefix.lookup(self.prompt, len(self.prompt) - 1, need_drafter=bool(self.budget))
        self.cache = self.model.new_cache(self.need, prefix=[pg.page for pg in path])
        m = self.cache.length                  # the mapped rows: len(path) whole pages
        if self.budget:                        # its context rows in the same pages, those of the hit included
            self.dcache = self.drafter.new_cache(self.need, share=self.cache)
            self.dcache.length = self.dcache.frozen = m
        if self.prefix is not None:
            self.prefix.count(len(self.prompt), m)
            self.req.result.prefix_queried_tokens = len(self.prompt)
            self.req.result.cached_tokens = m
        self.prefilled = m
        return False

    def insert_prefix(self) -> None:
        """A finished request's committed rows (prompt + generated tokens) into the prefix cache: the tree takes
        holds on its whole pages (zero-copy); they are never written again (frozen)."""
        if self.prefix is None or self.cache is None:
            return
        seq = [int(t) for t in self.prompt] + [int(t) for t in self.req.result.tokens]
        n = min(int(self.cache.length), len(seq))
        if not self.owns_cache:                # a shared prefill's rows past the prompt: rewritten by its next sample
            n = min(n, len(self.prompt))
        drafter_rows = 0
        if self.budget and self.dcache is not None:
            if self.pending_hid and self.owns_cache:   # the drafter catches up: the last pages carry its rows too
                self.drafter.extend(self.dcache, _joined(self.pending_hid))
                self.pending_hid = []
            drafter_rows = min(int(self.dcache.length), n)
        self.prefix.insert(seq[:n], self.cache.pages, drafter_rows)
        P = self.prefix.page
        self.cache.frozen = max(self.cache.frozen, n // P * P)

    def release(self) -> None:
        """Give the pages back now (the scheduler's finish): a page nobody else holds (the prefix cache) is free."""
        if self.owns_cache:
            for c in (self.cache, self.dcache):
                if c is not None and hasattr(c, "release"):
                    c.release()
        self.cache = self.dcache = None

    # -- plan: the rows of the next forward --------------------------------------------------------------------
    def plan(self, rows: int = 0, speculate: bool = True) -> Optional[Block]:
        """A prefilling request's next chunk (at most `rows` rows; None for 0), else its AR row or, when
        `speculate` and it is a speculative request, its tree block (drafted now)."""
        if self.prefilling:
            n = min(len(self.prompt) - self.prefilled, int(rows))
            if n <= 0:
                return None
            a = self.prefilled
            return Block("prefill", self.prompt[a:a + n], np.arange(a, a + n, dtype=np.int32), None, a)
        start = self.cache.length
        if not (self.budget and speculate) or self._plain_step():   # AR, or a speculative request stepping plain
            last = self.req.result.tokens[-1]
            return Block("ar", np.array([last], np.int32), np.array([start], np.int32), None, start)
        return self._plan_tree(start)

    def _plain_step(self) -> bool:
        """tree.policy=cost: True for an AR step while plain steps commit faster than tree rounds (one tree round
        every EXPLORE steps keeps the comparison current)."""
        if self.costs is None or not self.solo or not self.costs.prefers_ar():
            self.plain_steps = 0
            return False
        self.plain_steps += 1
        return self.plain_steps % EXPLORE != 0

    def _plan_tree(self, start: int) -> Block:
        res, t0 = self.req.result, time.perf_counter()
        if self.pending_hid:                   # rows stepped as AR while speculation was off
            self.drafter.extend(self.dcache, _joined(self.pending_hid))
            self.pending_hid = []
        dlogits = np.asarray(self.drafter.draft(self.dcache, self.bonus)[:self.depth])   # [depth, V]
        res.draft_forwards += 1
        t1 = time.perf_counter()
        if self.grammar is not None:           # depth 1 follows the committed state: draft only what it allows
            dlogits = np.array(dlogits, np.float32, order="C")
            self.ops.token_bitmask_apply(dlogits[:1], self.grammar.bits()[None])
        logp, ids = self.ops.draft_topk(dlogits, self.width)                              # [depth, width]
        t = self.ops.tree_build(logp, ids, self.budget)
        # copied: backend=cpu reuses one tree buffer per shape, and every request's tree lives until its verify
        tree = Tree(np.array(t.tokens), np.array(t.parents), np.array(t.depths), np.array(t.visibility))
        self.round_draft_s, self.round_expected = t1 - t0, 0.0
        cap = self.budget                      # nodes this round may verify (a grammar's forced tokens fill up to it)
        if self.costs is not None and self.solo:   # tree.policy=cost: the prefix with the most tokens per second
            self.costs.observe_draft(t1 - t0)
            if self.costs.calibrated or self.costs.calibrate(self.budget + 1):
                b, self.round_expected = best_prefix(tree, logp, ids, self.costs)
                tree, cap = prefix_tree(tree, b), b
        masks = None
        if self.grammar is not None:           # deeper nodes: pruned where their own path's state refuses them
            t2 = time.perf_counter()
            ends = [*self.stops] + ([self.eos_id] if self.eos_id is not None else [])
            tree, masks = constrain_tree(self.grammar, tree, ends, cap)
            self._grammar_time(t2)
        tokens = np.concatenate([[self.bonus], tree.tokens]).astype(np.int32)                # [N+1]
        positions = (start + np.concatenate([[0], tree.depths])).astype(np.int32)           # [N+1]
        values = None
        if self.prune and masks is None:       # (a grammar's forced nodes have no drafter probability: kept)
            conf = self.costs.confidence if self.costs is not None else 1.0
            p = conf * np.exp(node_scores(tree, logp, ids))
            # a draft row is worth its experts while it commits tokens per byte at the round's own rate at least: the
            # round expects 1 + sum(p) tokens for about PRUNE_VERIFY_STEPS AR steps' bytes, and expert_cost is in
            # tokens at one token per AR step, so the values are scaled down by that rate
            values = subtree_values(tree, p) / max(1.0, (1.0 + float(p.sum())) / PRUNE_VERIFY_STEPS)
        res.stage_seconds["draft"] += t1 - t0
        res.stage_seconds["tree_build"] += time.perf_counter() - t1
        return Block("tree", tokens, positions, tree.visibility, start, tree, masks, values)

    # -- advance: the forward's rows back -> committed tokens ------------------------------------------------
    def advance(self, block: Block, logits: np.ndarray, argmax: np.ndarray, hid: Dict[int, np.ndarray],
                seconds: float) -> bool:
        """This request's rows of the forward: logits f32[T, V], argmax i32[T], hiddens {layer: f32[T, D]}.
        Commits what they decide; True when the request is over."""
        res = self.req.result
        res.target_forwards += 1
        if block.kind == "prefill":
            res.stage_seconds["prefill"] += seconds
            return self._advance_prefill(block, logits, argmax, hid)
        res.stage_seconds["verify"] += seconds
        if block.kind == "ar":
            res.acceptance_lengths.append(1)
            token = self._draw(logits, argmax, 0)
            over = self._commit([token], logits)
            if self.budget and (not over or self.prefix is not None):   # the drafter gets this row when it drafts
                self.pending_hid.append({i: x.copy() for i, x in hid.items()})   # again (or at the prefix insert)
                self.bonus = token
            return over
        return self._advance_tree(block, logits, argmax, hid, seconds)

    def _advance_prefill(self, block: Block, logits, argmax, hid) -> bool:
        res, a, n, P = self.req.result, block.start, block.rows, len(self.prompt)
        if self.echo:                          # row j predicts prompt token a + j + 1
            res.prompt_logprobs += prompt_logprobs(self.prompt[a:min(a + n + 1, P)], logits, self.top)[1:]
        self.prefilled += n
        res.prefilled_tokens += n
        if self.budget:
            self.prompt_hid.append(hid)
        if self.prefilling:
            return False
        if not self.max_new:                   # echo with max_tokens 0: the prompt's logprobs only
            return True
        if self.budget:                        # the drafter sees the whole prompt at once
            t0 = time.perf_counter()
            self.drafter.extend(self.dcache, _joined(self.prompt_hid))
            self.prompt_hid = []
            res.stage_seconds["draft"] += time.perf_counter() - t0
        shared = self.req.prefill
        if shared is not None:                 # generate_n: the later samples start from here
            shared.keep(len(self.prompt), self.cache, self.dcache, logits[n - 1], res.prompt_logprobs)
            self.owns_cache = False
        return self._first_token(logits, argmax, n - 1)

    def _first_token(self, logits, argmax, row: int) -> bool:
        first = self._draw(logits, argmax, row)
        self.bonus = first
        return self._commit([first], logits[row:row + 1])

    def _advance_tree(self, block: Block, logits, argmax, hid, seconds: float = 0.0) -> bool:
        res, tree, t0 = self.req.result, block.tree, time.perf_counter()
        masks = block.masks                    # under a grammar: each row masked by its own path's state
        if block.pruned is not None and block.pruned[1:].any():    # drafts the forward pruned: never followed
            tree = Tree(np.where(block.pruned[1:] != 0, -1, tree.tokens).astype(np.int32), tree.parents, tree.depths,
                        tree.visibility)
            res.pruned_drafts += int(np.count_nonzero(block.pruned))
        if self.sampler is None:
            if masks is not None:
                argmax = choose_rows(self.ops, logits, masks, True)
                self._grammar_time(t0)
            path, new_bonus = self.ops.tree_accept(np.asarray(tree.parents, np.int32),
                                                   np.asarray(tree.tokens, np.int32), argmax)
        else:                                  # draw at each visited row, in output-position order; a masked
            def draw(r: int) -> int:           # copy of only the rows the walk visits (not all T x V)
                if masks is None:
                    return self.sampler.sample(logits[r])
                return self.sampler.sample(choose_rows(self.ops, logits[r:r + 1], masks[r:r + 1], False)[0])
            path, new_bonus = sampled_walk(tree.parents, tree.tokens, draw)
        path = np.asarray(path, np.int64)
        res.acceptance_lengths.append(int(path.size) + 1)
        rows = np.concatenate([[0], path + 1])                 # block rows of root + accepted path
        self.cache.keep(block.start, block.start + rows)
        committed = [int(t) for t in np.asarray(tree.tokens)[path]] + [int(new_bonus)]
        if self.costs is not None and self.solo:
            self.costs.observe_round(len(committed), seconds + self.round_draft_s, self.round_expected)
        t1 = time.perf_counter()
        res.stage_seconds["accept"] += t1 - t0
        over = self._commit(committed, logits[rows] if self.top is not None else None)
        t2 = time.perf_counter()
        res.stage_seconds["commit"] += t2 - t1
        if not over:                           # the drafter's next context: root + path hidden states
            self.bonus = int(new_bonus)
            self.drafter.extend(self.dcache, {i: x[rows] for i, x in hid.items()})
            res.stage_seconds["draft"] += time.perf_counter() - t2
        elif self.prefix is not None:          # extended at the prefix insert (its pages then carry drafter rows)
            self.pending_hid.append({i: x[rows] for i, x in hid.items()})
        return over

    def _grammar_time(self, t0: float) -> None:
        """Seconds spent on the grammar (masks, tree pruning, consuming): stage_seconds["grammar"]."""
        st = self.req.result.stage_seconds
        st["grammar"] = st.get("grammar", 0.0) + time.perf_counter() - t0

    def _draw(self, logits: np.ndarray, argmax: Optional[np.ndarray], row: int) -> int:
        if self.grammar is not None:           # the committed state's mask (AR row, the first token)
            t0 = time.perf_counter()
            z = choose_rows(self.ops, logits[row:row + 1], self.grammar.bits()[None], self.sampler is None)
            self._grammar_time(t0)
            return int(z[0]) if self.sampler is None else self.sampler.sample(z[0])
        if self.sampler is None:
            return int(argmax[row]) if argmax is not None else int(np.argmax(logits[row]))
        return self.sampler.sample(logits[row])

    def _commit(self, tokens: List[int], rows: Optional[np.ndarray]) -> bool:
        """Commit with the one stop rule, then the stop strings; report the new tokens; True when it is over.
        rows f32[len(tokens), V]: the logits row that predicted each token (logprobs; None when not asked)."""
        req, res = self.req, self.req.result
        n0 = len(res.tokens)
        over = commit_tokens(res, tokens, self.max_new, self.eos_id, self.stops)
        if req.stop_check is not None and len(res.tokens) > n0:
            keep = req.stop_check(res.tokens)
            if keep is not None:
                del res.tokens[max(int(keep), n0):]
                res.finish_reason, over = "stop", True
        if self.grammar is not None and len(res.tokens) > n0:
            t0 = time.perf_counter()
            self.grammar.consume(res.tokens[n0:])
            self._grammar_time(t0)
            if self.grammar.stopped:           # complete: only an end token could follow (committed or not)
                res.finish_reason, over = "stop", True
        if self.top is not None:
            res.logprobs += [token_logprob(rows[i], res.tokens[n0 + i], self.top) for i in range(len(res.tokens) - n0)]
        if len(res.tokens) > n0:
            if not req.first_token_at:
                req.first_token_at = time.monotonic()
            if req.on_tokens is not None:
                req.on_tokens(res.tokens[n0:])
        return over


__all__ = ["Block", "DecodeState", "request_shape", "tree_shape"]
