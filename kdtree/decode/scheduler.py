"""The scheduler: every admitted request decoded together, each one's tokens identical to its run alone.

    sched = Scheduler(model, drafter, tree_cfg, eos_id, max_context, max_batch_tokens=512, pool_tokens=16384)
    req = sched.submit(Request(prompt_ids, max_new_tokens=64))   # from any thread
    sched.start()            # the engine thread steps while there is work (the server) ...
    sched.drive(req)         # ... or the caller steps until req is done (generate, warm-up, bench)

One step (`step()`):
  reap     cancelled and timed-out requests leave (their latent rows go back to the pool)
  admit    waiting requests join, oldest first, while the pool has free pages for their reservation
           (prompt + max_new_tokens + tree budget rows, in pages of page_tokens rows); the rest wait. Every backend's
           latent rows are pages of ONE paged arena reserved at start (pool_tokens // page_tokens pages,
           kdtree/model/pages.py): any free pages will do, so a request waits only when free pages run out (after
           the prefix cache gave back the least recently used pages only it held)
           prefix cache (prefix_cache=PrefixCache): an admitted request maps the pages of its longest cached prefix
           (whole pages, at most prompt - 1 tokens) into its page table -- zero-copy, shared with every other
           request that maps them -- and prefills only the rest; a request that finishes hands its whole pages of
           committed rows (prompt + generated tokens) to the cache. Exact: the same tokens hit or miss
  plan     every decoding request's block (DecodeState.plan: its tree, drafted now, or its AR row), then prefill
           chunks fill the step up to max_batch_tokens rows (the oldest prefilling request always moves)
  forward  ONE Target.forward_batch over all blocks: each sees its own cache and its own block's visibility
  advance  every request's rows back (DecodeState.advance: accept, keep, commit, drafter extend)
The target's ops are batch-invariant and forward_batch keeps each sequence's attention to its own cache, so a
request's rows are bit-identical to its run alone (tests/decode/test_batch_scheduler.py); the drafter runs per
request on the same inputs as alone, so even the trees match. Only target_forwards counts batched forwards.

Speculation off under load (`speculate_max_batch`, vLLM's speculative_disable_by_batch_size): past that many
decoding requests a speculative request feeds one row (its bonus token, as AR does) and keeps the hidden rows for
its drafter; it speculates again, its drafter caught up in one extend, once the batch is back under the limit. The
committed tokens do not depend on the tree, so they stay identical; only the acceptance counts differ.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from kdtree.decode.request import Request, RequestCancelled, RequestTimeout
from kdtree.decode.cost import ForwardCosts
from kdtree.decode.prefix_cache import pool_page_counts
from kdtree.decode.state import DecodeState
from kdtree.errors import CachePoolBusy, ConfigError, KdtreeError
from kdtree.model.pages import DEFAULT_PAGE_ROWS


def forward_batch(model, seqs, hidden_layers=()):
    """ONE forward over every sequence's rows: model.forward_batch; a single sequence takes model.forward, the same
    rows bit for bit (batch-invariant kernels) with less per-call overhead (an AR step of the tiny model is ~250 us)."""
    if len(seqs) == 1 or not hasattr(model, "forward_batch"):
        outs = [model.forward(t, p, c, visibility=v, hidden_layers=hidden_layers) for t, p, c, v in seqs]
        logits = outs[0][0] if len(outs) == 1 else np.concatenate([o[0] for o in outs])
        hid = outs[0][1] if len(outs) == 1 else {i: np.concatenate([o[1][i] for o in outs]) for i in hidden_layers}
        return logits, np.argmax(logits, axis=-1).astype(np.int32), hid
    return model.forward_batch(seqs, hidden_layers)


class Scheduler:
    def __init__(self, model, drafter, tree, eos_id: Optional[int], max_context: int,
                 max_batch_tokens: int = 512, pool_tokens: int = 16384, request_timeout_s: float = 0.0,
                 speculate_max_batch: int = 0, reserve_pool: bool = True, prefix_cache=None,
                 page_tokens: int = DEFAULT_PAGE_ROWS):
        if int(max_batch_tokens) < 1:
            raise ConfigError(f"serve.max_batch_tokens={max_batch_tokens} must be >= 1 row; e.g. 512")
        if int(pool_tokens) < 1:
            raise ConfigError(f"serve.kv_pool_tokens={pool_tokens} must be >= 1 token; e.g. 16384")
        if int(speculate_max_batch) < 0:
            raise ConfigError(f"serve.speculate_max_batch={speculate_max_batch} must be >= 0 (0 = always speculate)")
        self.model, self.drafter, self.tree = model, drafter, tree
        self.eos_id = eos_id
        self.max_context = int(max_context)
        self.max_batch_tokens = int(max_batch_tokens)
        self.pool_tokens = int(pool_tokens)
        self.request_timeout_s = float(request_timeout_s)
        self.speculate_max_batch = int(speculate_max_batch)   # 0 = no limit
        self.speculating = True                         # the last step's mode (status)
        self.prefix_cache = prefix_cache                # a PrefixCache (kdtree/decode/prefix_cache.py) or None
        self.prefix_enabled = prefix_cache is not None  # False: new requests neither look up nor insert (a toggle)
        self._lock = threading.Condition()
        self._waiting: List[Request] = []
        self._running: List[Request] = []
        self._state: Dict[int, DecodeState] = {}       # id(request) -> its state until it finishes
        self._deadline: Dict[int, float] = {}
        self.costs: Optional[ForwardCosts] = None       # tree.policy=cost: forward seconds by rows, measured
        self.steps = 0
        self.last_batch_size = 0                        # sequences in the last step's forward
        self.last_batch_rows = 0                        # rows in the last step's forward
        self.finished = 0
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        page = prefix_cache.page if prefix_cache is not None else int(page_tokens)
        self.pages = model.pages                        # the model's page pool: every request's rows are its pages
        # reserved: a fixed arena of pool_tokens rows (a full pool makes arrivals wait); else it grows on demand
        self.pooled = self._reserve(page) if reserve_pool else False
        if self.pooled:                                 # whole pages: a request never needs more than the pool has
            self.pool_tokens = min(self.pool_tokens, self.pages.total * self.pages.page_rows)
        if prefix_cache is not None:
            prefix_cache.attach(self.pages)

    def _reserve(self, page: int) -> bool:
        """The model's pool reserved at pool_tokens rows; its page count is remembered, so that admission can
        restore it after another scheduler of the same model (tests, benches) resized the shared pool."""
        ok = bool(self.model.reserve_cache_pool(self.pool_tokens, page))
        self._pool_pages = self.pages.total
        return ok

    # -- any thread -----------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request (its shape checked now: a ConfigError / ContextLengthExceeded names what is wrong)."""
        if req.sampling is not None and req.sampling.n != 1:
            raise ConfigError(f"n={req.sampling.n}: the scheduler decodes one completion per request; "
                              f"submit n requests (Engine.generate_n)")
        st = DecodeState(req, self.model, self.drafter, self.tree if req.tree is None else req.tree, self.eos_id,
                         self.max_context, self.pool_tokens,
                         prefix=self.prefix_cache if self.prefix_enabled else None)
        timeout = req.timeout_s or self.request_timeout_s
        req.submitted_at = time.monotonic()
        if st.policy == "cost":                          # measured forward costs, shared by every such request
            if self.costs is None:
                self.costs = ForwardCosts(self.model)
            st.costs = self.costs
        with self._lock:
            self._state[id(req)] = st
            self._deadline[id(req)] = req.submitted_at + timeout if timeout > 0 else float("inf")
            self._waiting.append(req)
            if not st.needs_forward:                     # nothing to generate: done without a forward
                self._finish(req, None, locked=True)
            self._lock.notify_all()
        return req

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def page_counts(self) -> Dict[str, int]:
        """The pool's pages: used (held by running requests), cached (held by prefix caches alone), free, total."""
        return pool_page_counts(self.pages)

    @property
    def pool_used(self) -> int:
        """Latent rows in the pages running requests hold (their reservations and the cached pages they mapped)."""
        return self.page_counts()["used"] * self.pages.page_rows

    def snapshot(self) -> Dict[str, int]:
        """What /status and /metrics show: kv_pool_* in tokens (pages x page tokens), prefix_cache_pages_* the
        pool's pages by state (they add up to its total), and the prefix cache's counters."""
        with self._lock:
            pages, P = self.page_counts(), self.pages.page_rows
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "batch_size": self.last_batch_size, "batch_rows": self.last_batch_rows,
                    "kv_pool_used": pages["used"] * P, "kv_pool_tokens": pages["total"] * P, "steps": self.steps,
                    "speculating": self.speculating, "kv_pool_page_tokens": P,
                    **{f"prefix_cache_pages_{k}": v for k, v in pages.items()},
                    **({"prefix_cache_enabled": self.prefix_enabled, **self.prefix_cache.stats()}
                       if self.prefix_cache is not None else {})}

    def set_prefix_cache(self, enabled: bool) -> None:
        """Turn the prefix cache on/off for requests submitted from now on (its pages are kept; bench_serve measures
        both ways on one server this way). ConfigError when the engine has none (serve.prefix_cache=false)."""
        if self.prefix_cache is None:
            raise ConfigError("this engine has no prefix cache (serve.prefix_cache=false or prefix_cache_tokens=0); "
                              "restart it with serve.prefix_cache=true to toggle it")
        with self._lock:
            self.prefix_enabled = bool(enabled)

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # -- who steps: the engine thread (server) or the caller (generate) ------------------------------------
    def start(self) -> None:
        """The engine thread: step while there is work until stop(). Idempotent."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(self._stop,), name="engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def threaded(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drive(self, req: Request) -> Request:
        """Until `req` is done: wait for the engine thread, or (none running) step here."""
        if self.threaded:
            req.wait()
            return req
        while not req.done.is_set():
            if not self.step() and not req.done.is_set():
                with self._lock:
                    stuck = req in self._waiting and not self._running
                if stuck:                              # nothing runs that could free pages for it
                    need, P = self._state[id(req)].need, self.pages.page_rows
                    self._finish(req, KdtreeError(
                        f"request of {need} latent rows ({-(-need // P)} pages of {P}) cannot be admitted: the "
                        f"cache pool has {self.pages.free} free pages of {self.pages.total} and nothing running "
                        f"holds the rest (serve.kv_pool_tokens={self.pool_tokens})"))
        return req

    def run(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step while there is work, sleep on the condition otherwise, until stop is set."""
        while not stop.is_set():
            try:
                worked = self.step()
            except Exception as e:                    # a bug: fail the batch, keep serving
                with self._lock:
                    for req in list(self._running):
                        self._finish(req, e, locked=True)
                continue
            if not worked:
                with self._lock:
                    if not self._waiting and not self._running and not stop.is_set():
                        self._lock.wait(idle_wait_s)

    # -- one step ----------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step (see the module docstring). False when there was nothing to do."""
        self._admit()
        active = list(self._running)
        if not active:
            return False
        decoding = sum(1 for req in active if not self._state[id(req)].prefilling)
        self.speculating = speculate = not self.speculate_max_batch or decoding <= self.speculate_max_batch
        plan, rows_left = [], self.max_batch_tokens                  # plan: (request, block) in forward order
        for req in active:                                           # decoding requests: one block each
            st = self._state[id(req)]
            st.solo = len(active) == 1
            if not st.prefilling:
                self._plan(plan, req, st, 0, speculate)
        rows_left -= sum(b.rows for _, b in plan)
        first = True
        for req in active:                                           # prefill chunks fill the rest of the step
            st = self._state[id(req)]
            if not st.prefilling:
                continue
            # the oldest prefilling request always moves (arrivals never starve behind many decoders)
            rows = rows_left if not first else max(rows_left, max(1, self.max_batch_tokens // 8))
            if rows <= 0:
                break
            first = False
            if self._plan(plan, req, st, rows, speculate):
                rows_left -= plan[-1][1].rows
        if not plan:
            return True
        self._forward(plan)
        return True

    def _plan(self, plan: list, req: Request, st: DecodeState, rows: int, speculate: bool) -> bool:
        try:
            block = st.plan(rows, speculate)
        except Exception as e:                       # a failed draft: this request ends alone
            self._finish(req, e)
            return False
        if block is not None:
            plan.append((req, block))
        return block is not None

    def _forward(self, plan: list) -> None:
        states = [self._state[id(req)] for req, _ in plan]
        seqs = [(b.tokens, b.positions, st.cache, b.visibility) for (_, b), st in zip(plan, states)]
        layers = next((st.layers for st in states if st.layers), ())
        values = [b.values for _, b in plan]
        t0 = time.perf_counter()
        try:
            if any(v is not None for v in values):      # tree.prune_experts: the native forward may prune drafts
                logits, argmax, hid = self.model.forward_batch(seqs, layers, values=values)
                pruned = getattr(self.model, "pruned", None)
                r0 = 0
                for _, b in plan:
                    b.pruned, r0 = None if pruned is None else pruned[r0:r0 + b.rows], r0 + b.rows
            else:
                logits, argmax, hid = forward_batch(self.model, seqs, layers)
        except Exception as e:                        # every request of the step ends with the error
            for req, _ in plan:
                self._finish(req, e)
            return
        dt = time.perf_counter() - t0
        if self.costs is not None and len(plan) == 1 and plan[0][1].kind != "prefill":
            self.costs.observe(plan[0][1].rows, dt)
        self.steps += 1
        self.last_batch_size, self.last_batch_rows = len(seqs), sum(b.rows for _, b in plan)
        r0 = 0
        for (req, block), st in zip(plan, states):
            r1 = r0 + block.rows
            try:
                over = st.advance(block, logits[r0:r1], argmax[r0:r1], {i: x[r0:r1] for i, x in hid.items()}, dt)
            except Exception as e:                    # on_tokens raised (client gone) or the drafter failed
                self._finish(req, e)
            else:
                if over:
                    self._finish(req, None)
            r0 = r1

    def _admit(self) -> None:
        now = time.monotonic()
        with self._lock:
            for req in list(self._waiting) + list(self._running):
                self._reap(req, now)
            if self.pooled and self._waiting and self.pages.total != self._pool_pages:
                self._reserve(self.pages.page_rows)        # another scheduler of this model resized the pool
            while self._waiting:
                req = self._waiting[0]
                st = self._state[id(req)]
                try:
                    over = st.allocate()                   # its pages (a prefix cache hit's mapped first)
                except CachePoolBusy:                      # too few free pages: wait for running requests
                    break
                except Exception as e:                     # this request fails alone; the rest go on
                    self._finish(req, e, locked=True)
                    continue
                self._waiting.pop(0)
                req.admitted_at = now
                self._running.append(req)
                if over:
                    self._finish(req, None, locked=True)

    def _reap(self, req: Request, now: float) -> None:
        if req.cancelled.is_set():
            self._finish(req, RequestCancelled(f"request cancelled after {req.generated} tokens"), locked=True)
        elif now > self._deadline[id(req)]:
            limit = self._deadline[id(req)] - req.submitted_at
            self._finish(req, RequestTimeout(
                f"request ran past its time limit of {limit:g} s (serve.request_timeout_s) after {req.generated} "
                f"tokens; raise serve.request_timeout_s or lower max_tokens"), locked=True)

    def _finish(self, req: Request, error: Optional[BaseException], locked: bool = False) -> None:
        if req.done.is_set():
            return
        if not locked:
            with self._lock:
                return self._finish(req, error, locked=True)
        st = self._state.pop(id(req))
        self._deadline.pop(id(req), None)
        if any(r is req for r in self._running):
            self._running.remove(req)
        elif any(r is req for r in self._waiting):
            self._waiting.remove(req)
        if error is None:
            try:
                st.insert_prefix()                # its whole pages of committed rows to the prefix cache (held)
            except Exception as e:                # never fails a finished request; the cache just misses later
                print(f"[scheduler] prefix cache insert failed: {type(e).__name__}: {e}", file=sys.stderr)
        st.release()                              # its pages go back (those the prefix cache holds stay cached)
        if self.prefix_cache is not None:
            self.prefix_cache.evict()             # back under serve.prefix_cache_tokens (its pages are free now)
        req.error = error
        req.finished_at = time.monotonic()
        req.result.seconds = req.finished_at - req.submitted_at
        if error is None:
            self.finished += 1
        req.done.set()
        if req.notify is not None:
            req.notify(req)


__all__ = ["Scheduler", "forward_batch"]
