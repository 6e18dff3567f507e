"""The server's engine thread with continuous batching: every accepted request is decoded together.

The seam between the HTTP routes and the engine (submit / drain / depth / in_flight / finished): the routes build a
kdtree.decode.request.Request -- the one record from the route to the scheduler -- and this worker hands it to the
engine's own scheduler (the one generate, warm-up and bench drive), whose thread it starts; it adds only the
server's accounting (queue limit, draining, metrics). A request's cancel() (its client went away, its stream hit a
stop string) ends it at the next step; its multi-token stop strings end generation in the step they complete in
(the same tokens streamed or not, so usage agrees). Each request's tokens equal its solo run (tests/decode).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from kdtree.decode.request import Request
from kdtree.serve.request_queue import Draining, QueueFull


def stop_string_check(tokenizer, stops: Sequence[str]) -> Optional[Callable]:
    """Committed tokens -> how many to keep once a stop string appears in their text (the shortest prefix whose
    text contains it; the text itself is cut at the stop string's start by the route), else None.

    Called after every commit with all the request's tokens: a byte-level tokenizer's check decodes only the new
    tokens and the few bytes before them that a stop string could reach back into (a new occurrence must end in
    the new text), not the whole text again (quadratic in the output length); a hit is confirmed on the whole."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    bytes_of = getattr(tokenizer, "token_bytes", None)
    reach = 4 * max(len(s) for s in stops) + 4        # utf-8 bytes of the longest stop, plus a split character
    anywhere = any("\ufffd" in s for s in stops)      # a stop holding U+FFFD may match an incomplete tail: scan all
    clean = [0]                                       # tokens whose text holds no stop string

    def contains(tokens) -> bool:
        return any(s in tokenizer.decode(tokens) for s in stops)

    def check(tokens):
        start = clean[0]
        if bytes_of is None or anywhere or start == 0:
            hit = contains(tokens)
        else:
            back = 0
            while start > 0 and back < reach:
                start -= 1
                back += len(bytes_of(tokens[start]))
            hit = contains(tokens[start:]) and contains(tokens)
        lo = 1 if anywhere else max(1, clean[0])
        clean[0] = len(tokens)
        if not hit:
            return None
        return next(k for k in range(lo, len(tokens) + 1) if contains(tokens[:k]))
    return check


class BatchWorker:
    def __init__(self, engine: Any, max_queue: int = 256, on_done=None):
        self.engine = engine
        self.on_done = on_done                     # fn(request) after each finished request (metrics)
        self.max_queue = max(1, int(max_queue))
        self.scheduler = engine.scheduler          # the engine's: serve.max_batch_tokens, kv_pool_tokens, ...
        self._accepting = True
        self._lock = threading.Lock()
        self.finished = 0                          # requests ended with a result (metrics, drain report)
        self._live = {}                            # id(request) -> (request, its own notify) while it runs or waits
        self.scheduler.start()

    running = None                                 # no single running request: see snapshot()

    @property
    def depth(self) -> int:
        return self.scheduler.waiting

    @property
    def in_flight(self) -> int:
        return self.scheduler.running

    def snapshot(self) -> dict:
        return self.scheduler.snapshot()

    def submit(self, req: Request) -> Request:
        """Queue a request; raises Draining, QueueFull, or the scheduler's ContextLengthExceeded (a 400). Its
        stop_strings get their check here (the tokenizer is the engine's); its notify runs after the worker's
        accounting."""
        with self._lock:
            if not self._accepting:
                raise Draining()
            if self.scheduler.waiting >= self.max_queue:
                raise QueueFull()
            if req.stop_strings and req.stop_check is None:
                req.stop_check = stop_string_check(self.engine.tokenizer, req.stop_strings)
            self._live[id(req)] = (req, req.notify)
            req.notify = self._done
            try:
                self.scheduler.submit(req)
            except BaseException:
                req.notify = self._live.pop(id(req))[1]
                raise
        return req

    def _done(self, req: Request) -> None:
        _, notify = self._live.pop(id(req))
        if req.error is None:
            self.finished += 1
            if self.on_done is not None:
                try:
                    self.on_done(req)
                except Exception:
                    pass
        if notify is not None:
            notify(req)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Refuse new requests, finish every accepted one, stop the thread. True when it finished in time; on a
        timeout the requests still waiting or running are cancelled (they end with RequestCancelled)."""
        self.stop_accepting()
        end = None if timeout is None else time.monotonic() + timeout
        while self.scheduler.running + self.scheduler.waiting and (end is None or time.monotonic() < end):
            time.sleep(0.01)
        finished = not (self.scheduler.running + self.scheduler.waiting)
        if not finished:
            for req, _ in list(self._live.values()):
                req.cancel()                       # they leave at the next step
            self.scheduler.wake()
            stop_by = time.monotonic() + 5.0
            while self._live and time.monotonic() < stop_by:
                time.sleep(0.01)
        self.scheduler.stop()
        return finished
