"""Continuous batching: every active request decoded together, each one's tokens identical to its solo run.

    sched = BatchScheduler(model, drafter, tree_cfg, eos_id, max_context, max_batch_tokens=512, pool_tokens=16384)
    req = sched.submit(BatchRequest(prompt_ids, max_new_tokens=64))   # from any thread
    sched.run(stop_event)            # the engine thread: step() until stop_event is set
    req.wait(); req.result.tokens    # == generate(model, drafter, tree_cfg, prompt_ids, 64).tokens

One step (`step()`):
  reap     cancelled and timed-out requests leave (their latent rows go back to the pool)
  admit    waiting requests join, oldest first, while the pool has room for their reservation
           (prompt + max_new_tokens + tree budget + 1 rows); the rest wait. backend=cpu|cuda: the rows are a
           range of ONE latent-cache arena reserved at start (pool_tokens rows); a request whose range is not
           free yet (the arena is fragmented) waits for running ones to finish
  draft    per decoding request: one drafter block forward, its top-k, one tree build (AR: the last token);
           above speculate_max_batch decoding requests, speculative requests step as AR (below)
  verify   ONE target forward_batch over every request's block -- its tree (ancestor-only visibility, its
           own positions, its own latent cache) or its next prefill chunk; prefill chunks fill the step up to
           max_batch_tokens rows
  accept   per request: greedy walk, cache compaction, commit (eos, stop ids, stop strings, max_new_tokens)
The target's ops are batch-invariant and forward_batch keeps each sequence's attention to its own cache, so a
request's verify rows are bit-identical to its solo run's (tests/decode/test_batch_scheduler.py); the drafter
runs per request on the same inputs as solo (the whole prompt's hidden states at once), so even the trees
and acceptance lengths match. Only target_forwards differs: it counts the batched forwards the request was in.

Speculation off under load (`speculate_max_batch`, vLLM's speculative_disable_by_batch_size): a verify block of
budget + 1 rows costs about budget + 1 rows of arithmetic, and a batch of many requests already fills the machine,
so past that many decoding requests a speculative request feeds one row (its bonus token, as AR does) and keeps
the hidden rows for its drafter; it speculates again, its drafter caught up in one extend, once the batch is back
under the limit. Greedy or sampled, the committed tokens do not depend on the tree (each one is the target's
argmax / draw at its position), so they stay identical to the solo run; only the acceptance counts differ.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from kdtree.decode.ddtree import tree_shape
from kdtree.decode.result import GenerationResult, commit_tokens
from kdtree.decode.sampling import Sampler, SamplingParams, sampled_walk, token_logprob
from kdtree.errors import CachePoolBusy, ConfigError, KdtreeError
from kdtree.tree import Tree


class ContextLengthExceeded(ConfigError):
    """A request that can never fit (its context or the whole cache pool is too small)."""
    code = "context_length_exceeded"


class RequestCancelled(KdtreeError):
    """The request was cancelled (its client went away) before it finished."""
    code = "cancelled"


class RequestTimeout(KdtreeError):
    """The request ran past its wall-clock limit (serve.request_timeout_s)."""
    code = "timeout"


@dataclass
class BatchRequest:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    tree: Any = None                       # a tree config (ar | chain | ddtree); None = the scheduler's
    stop_ids: Sequence[int] = ()           # single-token stops (AR's rule: the token is not kept)
    # committed tokens -> how many to keep when a stop string completed in them (None = not yet); ends the request
    stop_check: Optional[Callable[[List[int]], Optional[int]]] = None
    on_tokens: Optional[Callable[[List[int]], None]] = None   # each commit's new tokens (scheduler thread)
    notify: Optional[Callable[["BatchRequest"], None]] = None  # called once done is set (scheduler thread)
    timeout_s: float = 0.0                 # wall-clock limit from submit; 0 = the scheduler's request_timeout_s
    sampling: Optional[SamplingParams] = None   # None / temperature 0: greedy; else drawn as Engine.generate does
    result: GenerationResult = field(default_factory=lambda: GenerationResult(tokens=[]))
    error: Optional[BaseException] = None
    submitted_at: float = 0.0              # time.monotonic seconds
    admitted_at: float = 0.0               # joined the running batch (its latent rows reserved)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """End the request at the next step boundary (error RequestCancelled)."""
        self.cancelled.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.done.wait(timeout)


@dataclass
class _State:
    """A running request's decode state."""
    prompt: np.ndarray                     # i32[P]
    width: int
    depth: int
    budget: int                            # tree nodes per round (0 = AR)
    need: int                              # latent rows reserved in the pool
    deadline: float                        # time.monotonic seconds; inf = none
    cache: Any = None                      # the target's latent cache (max_len = need)
    dcache: Any = None                     # the drafter's cache (speculative kinds)
    prefilled: int = 0                     # prompt rows already in the cache
    prompt_hid: List[Dict[int, np.ndarray]] = field(default_factory=list)   # prefill chunks' hidden states
    bonus: int = -1                        # speculative: the root of the next tree
    sampler: Optional[Sampler] = None      # sampled requests: uniform(seed, output position) per drawn token
    top: Optional[int] = None              # logprobs per token (sampling.logprobs)
    echo: bool = False                     # prompt logprobs too (from the prefill chunks' rows)
    t0: float = 0.0
    pending_hid: List[Dict[int, np.ndarray]] = field(default_factory=list)  # AR-stepped rows the drafter lacks


def _joined(parts: List[Dict[int, np.ndarray]]) -> Dict[int, np.ndarray]:
    """Hidden rows kept step by step ({layer: f32[n, D]} each) as one {layer: f32[sum n, D]} for drafter.extend."""
    return {i: np.concatenate([p[i] for p in parts]) for i in parts[0]}


def forward_batch(model, seqs, hidden_layers=()):
    """model.forward_batch, or one forward per sequence where the model has none (same results, more calls)."""
    if hasattr(model, "forward_batch"):
        return model.forward_batch(seqs, hidden_layers)
    outs = [model.forward(t, p, c, visibility=v, hidden_layers=hidden_layers) for t, p, c, v in seqs]
    logits = np.concatenate([o[0] for o in outs])
    hid = {i: np.concatenate([o[1][i] for o in outs]) for i in hidden_layers}
    return logits, np.argmax(logits, axis=-1).astype(np.int32), hid


class BatchScheduler:
    def __init__(self, model, drafter, tree, eos_id: Optional[int], max_context: int,
                 max_batch_tokens: int = 512, pool_tokens: int = 16384, request_timeout_s: float = 0.0,
                 speculate_max_batch: int = 0):
        if int(max_batch_tokens) < 1:
            raise ConfigError(f"serve.max_batch_tokens={max_batch_tokens} must be >= 1 row; e.g. 512")
        if int(pool_tokens) < 1:
            raise ConfigError(f"serve.kv_pool_tokens={pool_tokens} must be >= 1 token; e.g. 16384")
        self.model, self.drafter, self.tree = model, drafter, tree
        self.eos_id = eos_id
        self.max_context = int(max_context)
        self.max_batch_tokens = int(max_batch_tokens)
        self.pool_tokens = int(pool_tokens)
        self.request_timeout_s = float(request_timeout_s)
        if int(speculate_max_batch) < 0:
            raise ConfigError(f"serve.speculate_max_batch={speculate_max_batch} must be >= 0 (0 = always speculate)")
        self.speculate_max_batch = int(speculate_max_batch)   # 0 = no limit
        self.speculating = True                         # the last step's mode (status)
        self._lock = threading.Condition()
        self._waiting: List[BatchRequest] = []
        self._running: List[BatchRequest] = []
        self._state: Dict[int, _State] = {}            # id(request) -> its state while running
        self.pool_used = 0                              # latent rows reserved by running requests
        self.steps = 0
        self.last_batch_size = 0                        # sequences in the last step's forward
        self.last_batch_rows = 0                        # rows in the last step's forward
        self.finished = 0
        reserve = getattr(model, "reserve_cache_pool", None)        # one arena for every request's latent rows
        self.pooled = bool(reserve(self.pool_tokens)) if reserve is not None else False

    # -- any thread -----------------------------------------------------------------------------------
    def shape_of(self, req: BatchRequest):
        """(width, depth, budget, rows to reserve) of a request; raises the one-line error a client sees."""
        tree = self.tree if req.tree is None else req.tree
        P, n = len(req.prompt_ids), int(req.max_new_tokens)
        if P == 0:
            raise ConfigError("prompt is empty (0 tokens); give at least one token")
        if n < 0:
            raise ConfigError(f"max_tokens={n} must be >= 0")
        if str(tree.kind) == "ar":
            width = depth = budget = 0
        else:
            if self.drafter is None:
                raise ConfigError(f"tree.kind={tree.kind} needs the DFlash drafter but none is loaded; use tree=ar")
            width, depth, budget = tree_shape(tree, int(self.drafter.block_size))
        need = P + n + (budget + 1 if budget else 0)
        limit = min(self.max_context, self.pool_tokens)
        if need > limit:
            what = (f"the context of {self.max_context} tokens" if limit == self.max_context
                    else f"the latent cache pool of {self.pool_tokens} tokens (serve.kv_pool_tokens)")
            raise ContextLengthExceeded(
                f"prompt of {P} tokens + max_tokens={n}" + (f" + tree budget {budget + 1}" if budget else "")
                + f" = {need} tokens exceeds {what}; shorten the prompt or lower max_tokens")
        return width, depth, budget, need

    def submit(self, req: BatchRequest) -> BatchRequest:
        width, depth, budget, need = self.shape_of(req)
        timeout = req.timeout_s or self.request_timeout_s
        req.submitted_at = time.monotonic()
        st = _State(np.asarray(list(req.prompt_ids), np.int32), width, depth, budget, need,
                    req.submitted_at + timeout if timeout > 0 else float("inf"))
        sp = req.sampling
        if sp is not None:
            if sp.n != 1:
                raise ConfigError(f"n={sp.n}: the batch scheduler decodes one completion per request; "
                                  f"submit n requests")
            if not sp.greedy and int(req.max_new_tokens) > 0:    # as solo: no draw, no seed
                st.sampler = Sampler(sp.resolved(), st.prompt)
                req.result.seed = st.sampler.seed
            if sp.logprobs is not None:
                st.top, st.echo = int(sp.logprobs), bool(sp.echo)
                req.result.logprobs = []
                if st.echo:
                    req.result.prompt_logprobs = [None]
        with self._lock:
            self._state[id(req)] = st
            self._waiting.append(req)
            if int(req.max_new_tokens) == 0 and not st.echo:   # nothing to generate: done without a forward
                self._finish(req, None, locked=True)
            self._lock.notify_all()
        return req

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def snapshot(self) -> Dict[str, int]:
        """What /status and /metrics show."""
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "batch_size": self.last_batch_size, "batch_rows": self.last_batch_rows,
                    "kv_pool_used": self.pool_used, "kv_pool_tokens": self.pool_tokens, "steps": self.steps,
                    "speculating": self.speculating}

    def run(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """The engine thread: step while there is work, sleep on the condition otherwise, until stop is set."""
        while not stop.is_set():
            try:
                worked = self.step()
            except Exception as e:                    # a bug or a failed draft: fail the batch, keep serving
                with self._lock:
                    for req in list(self._running):
                        self._finish(req, e, locked=True)
                continue
            if not worked:
                with self._lock:
                    if not self._waiting and not self._running and not stop.is_set():
                        self._lock.wait(idle_wait_s)

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # -- the engine thread ----------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step (see the module docstring). False when there was nothing to do."""
        now = time.monotonic()
        with self._lock:
            for req in list(self._waiting) + list(self._running):
                self._reap(req, now)
            while self._waiting and self.pool_used + self._state[id(self._waiting[0])].need <= self.pool_tokens:
                req, st = self._waiting[0], self._state[id(self._waiting[0])]
                try:
                    st.cache = self.model.new_cache(st.need)      # its rows of the arena (or its own array)
                    if st.budget:
                        st.dcache = self.drafter.new_cache(len(st.prompt) + int(req.max_new_tokens))
                except CachePoolBusy:                             # fragmented: wait for a range to free up
                    break
                except Exception as e:                            # this request fails alone; the rest go on
                    self._finish(req, e, locked=True)
                    continue
                self._waiting.pop(0)
                st.t0 = time.perf_counter()
                self.pool_used += st.need
                req.admitted_at = now
                self._running.append(req)
            active = list(self._running)
        if not active:
            return False
        seqs, plan = [], []                           # plan: (request, kind, rows, extra) in seqs order
        rows_left = self.max_batch_tokens
        decoding = sum(1 for req in active if self._state[id(req)].prefilled >= len(self._state[id(req)].prompt))
        self.speculating = speculate = not self.speculate_max_batch or decoding <= self.speculate_max_batch
        for req in active:                            # decoding requests: one block each
            st = self._state[id(req)]
            if st.prefilled < len(st.prompt):
                continue
            t0 = time.perf_counter()
            start = st.cache.length
            if st.budget and speculate:
                if st.pending_hid:                    # rows stepped as AR while speculation was off
                    self.drafter.extend(st.dcache, _joined(st.pending_hid))
                    st.pending_hid = []
                dlogits = self.drafter.draft(st.dcache, st.bonus)                    # [B-1, V]
                req.result.draft_forwards += 1
                t1 = time.perf_counter()
                logp, ids = self.model.ops.draft_topk(np.asarray(dlogits[:st.depth]), st.width)  # [depth, width]
                t = self.model.ops.tree_build(logp, ids, st.budget)
                # copied: backend=cpu reuses one tree buffer per shape, and every request's tree lives until the verify
                tree = Tree(np.array(t.tokens), np.array(t.parents), np.array(t.depths), np.array(t.visibility))
                block = np.concatenate([[st.bonus], np.asarray(tree.tokens)]).astype(np.int32)      # [N+1]
                positions = (start + np.concatenate([[0], np.asarray(tree.depths)])).astype(np.int32)
                seqs.append((block, positions, st.cache, tree.visibility))
                plan.append((req, "tree", len(block), (tree, start)))
                req.result.stage_seconds["draft"] += t1 - t0
                req.result.stage_seconds["tree_build"] += time.perf_counter() - t1
            else:                                     # AR, or a speculative request while speculation is off
                seqs.append((np.array([req.result.tokens[-1]], np.int32), np.array([start], np.int32), st.cache, None))
                plan.append((req, "ar", 1, None))
            rows_left -= plan[-1][2]
        first = True
        for req in active:                            # prefill chunks fill the rest of the step
            st = self._state[id(req)]
            left = len(st.prompt) - st.prefilled
            if left <= 0:
                continue
            # the oldest prefilling request always moves (arrivals never starve behind many decoders)
            n = min(left, rows_left if not first else max(rows_left, max(1, self.max_batch_tokens // 8)))
            if n <= 0:
                break
            first = False
            a = st.prefilled
            seqs.append((st.prompt[a:a + n], np.arange(a, a + n, dtype=np.int32), st.cache, None))
            plan.append((req, "prefill", n, None))
            rows_left -= n
        layers = (tuple(int(i) for i in self.drafter.target_layer_ids)
                  if any(self._state[id(p[0])].budget for p in plan) else ())
        t0 = time.perf_counter()
        try:
            logits, argmax, hid = forward_batch(self.model, seqs, layers)
        except Exception as e:                        # every request of the step ends with the error
            for req, *_ in plan:
                self._finish(req, e)
            return True
        dt = time.perf_counter() - t0
        self.steps += 1
        self.last_batch_size, self.last_batch_rows = len(seqs), sum(p[2] for p in plan)
        r0 = 0
        for req, kind, n, extra in plan:
            a, lg = argmax[r0:r0 + n], logits[r0:r0 + n]
            h = {i: x[r0:r0 + n] for i, x in hid.items()}
            r0 += n
            req.result.target_forwards += 1
            try:
                self._advance(req, kind, n, a, lg, h, extra, dt)
            except Exception as e:                    # on_tokens raised (client gone) or the drafter failed
                self._finish(req, e)
        return True

    def _advance(self, req: BatchRequest, kind: str, n: int, argmax: np.ndarray, logits: np.ndarray,
                 hid: Dict[int, np.ndarray], extra, dt: float) -> None:
        """One request's part of the step: argmax i32[n], logits f32[n, V] and hiddens of its n rows."""
        st, res = self._state[id(req)], req.result
        draw = (lambda r: int(argmax[r])) if st.sampler is None else (lambda r: st.sampler.sample(logits[r]))
        if kind == "prefill":
            res.stage_seconds["prefill"] += dt
            a, P = st.prefilled, len(st.prompt)
            if st.echo:                               # row j predicts prompt token a + j + 1
                res.prompt_logprobs += [token_logprob(logits[j], int(st.prompt[a + j + 1]), st.top)
                                        for j in range(n) if a + j + 1 < P]
            st.prefilled += n
            if st.budget:
                st.prompt_hid.append(hid)
            if st.prefilled < P:
                return
            if not int(req.max_new_tokens):           # echo with max_tokens 0: the prompt's logprobs only
                self._finish(req, None)
                return
            first = draw(n - 1)
            if st.budget:                             # the drafter sees the whole prompt at once, as solo does
                self.drafter.extend(st.dcache, _joined(st.prompt_hid))
                st.prompt_hid = []
                st.bonus = first
            self._commit(req, [first], logits[n - 1:])
            return
        res.stage_seconds["verify"] += dt
        if kind == "ar":
            res.acceptance_lengths.append(1)
            token = draw(0)
            if not self._commit(req, [token], logits) and st.budget:   # the drafter gets this row when it drafts
                st.bonus = token
                st.pending_hid.append({i: x.copy() for i, x in hid.items()})
            return
        t0 = time.perf_counter()
        tree, start = extra
        if st.sampler is None:
            path, new_bonus = self.model.ops.tree_accept(np.asarray(tree.parents, np.int32),
                                                         np.asarray(tree.tokens, np.int32), argmax)
        else:                                         # draw at each visited row, in output-position order
            path, new_bonus = sampled_walk(tree.parents, tree.tokens, draw)
        path = np.asarray(path, np.int64)
        res.acceptance_lengths.append(int(path.size) + 1)
        rows = np.concatenate([[0], path + 1])       # block rows of root + accepted path
        st.cache.keep(start, start + rows)
        committed = [int(t) for t in np.asarray(tree.tokens)[path]] + [int(new_bonus)]
        res.stage_seconds["accept"] += time.perf_counter() - t0
        if not self._commit(req, committed, logits[rows]):
            st.bonus = int(new_bonus)
            self.drafter.extend(st.dcache, {i: x[rows] for i, x in hid.items()})

    def _commit(self, req: BatchRequest, tokens: List[int], rows: np.ndarray) -> bool:
        """Commit with AR's stop rules, then the stop strings; report the new tokens; True when it finished.
        rows f32[len(tokens), V]: the logits row that predicted each token (logprobs)."""
        res, st = req.result, self._state[id(req)]
        n0 = len(res.tokens)
        over = commit_tokens(res, tokens, int(req.max_new_tokens), self.eos_id, req.stop_ids)
        if req.stop_check is not None and len(res.tokens) > n0:
            keep = req.stop_check(res.tokens)
            if keep is not None:
                del res.tokens[max(int(keep), n0):]
                res.finish_reason, over = "stop", True
        if st.top is not None:
            res.logprobs += [token_logprob(rows[i], res.tokens[n0 + i], st.top) for i in range(len(res.tokens) - n0)]
        if len(res.tokens) > n0:
            if not req.first_token_at:
                req.first_token_at = time.monotonic()
            if req.on_tokens is not None:
                req.on_tokens(res.tokens[n0:])
        if over:
            self._finish(req, None)
            return True
        return False

    def _reap(self, req: BatchRequest, now: float) -> None:
        st = self._state[id(req)]
        if req.cancelled.is_set():
            self._finish(req, RequestCancelled(f"request cancelled after {len(req.result.tokens)} tokens"), locked=True)
        elif now > st.deadline:
            limit = st.deadline - req.submitted_at
            self._finish(req, RequestTimeout(
                f"request ran past its time limit of {limit:g} s (serve.request_timeout_s) after "
                f"{len(req.result.tokens)} tokens; raise serve.request_timeout_s or lower max_tokens"), locked=True)

    def _finish(self, req: BatchRequest, error: Optional[BaseException], locked: bool = False) -> None:
        if req.done.is_set():
            return
        if not locked:
            with self._lock:
                return self._finish(req, error, locked=True)
        st = self._state.pop(id(req))
        if req in self._running:
            self._running.remove(req)
            self.pool_used -= st.need
        elif req in self._waiting:
            self._waiting.remove(req)
        if st.cache is not None and hasattr(st.cache, "release"):
            st.cache.release()                    # its rows of the arena are free for the next admission now
        st.cache = st.dcache = None
        req.error = error
        req.finished_at = time.monotonic()
        req.result.seconds = req.finished_at - req.submitted_at
        if error is None:
            self.finished += 1
        req.done.set()
        if req.notify is not None:
            req.notify(req)


__all__ = ["BatchRequest", "BatchScheduler", "ContextLengthExceeded", "RequestCancelled", "RequestTimeout",
           "forward_batch"]
