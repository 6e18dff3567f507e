"""The server's engine thread with continuous batching: every accepted request is decoded together.

The seam between the HTTP routes and the engine (submit(Job) / drain / depth / in_flight / finished): the routes
submit a Job and wait on it; this worker turns it into a kdtree.decode.request.Request for the engine's own
scheduler (the one generate, warm-up and bench drive) and starts that scheduler's thread. A job's cancel() (its client went away, its stream hit a stop string)
ends it at the next step; its multi-token stop strings end generation in the step they complete in (the same
tokens streamed or not, so usage agrees). Each request's tokens equal its solo run (tests/decode).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from kdtree.decode.request import Request, RequestCancelled
from kdtree.serve.request_queue import Cancelled, Draining, Job, QueueFull


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
        self.on_done = on_done                     # fn(job) after each finished job (metrics)
        self.max_queue = max(1, int(max_queue))
        self.scheduler = engine.scheduler          # the engine's: serve.max_batch_tokens, kv_pool_tokens, ...
        self._accepting = True
        self._lock = threading.Lock()
        self.finished = 0                          # jobs ended with a result (metrics, drain report)
        self._jobs = {}                            # id(request) -> job, while it runs or waits
        self.scheduler.start()

    running = None                                 # no single running job: see snapshot()

    @property
    def depth(self) -> int:
        return self.scheduler.waiting

    @property
    def in_flight(self) -> int:
        return self.scheduler.running

    def snapshot(self) -> dict:
        return self.scheduler.snapshot()

    def submit(self, job: Job) -> Job:
        """Queue a job; raises Draining, QueueFull, or the scheduler's ContextLengthExceeded (a 400)."""
        with self._lock:
            if not self._accepting:
                raise Draining()
            if self.scheduler.waiting >= self.max_queue:
                raise QueueFull()
            req = Request(job.prompt_ids, job.max_new_tokens, stop_ids=tuple(job.stop_ids),
                               stop_check=stop_string_check(self.engine.tokenizer, getattr(job, "stops", ())),
                               on_tokens=job._on_tokens, notify=self._done, cancelled=job.cancelled,
                               sampling=getattr(job, "sampling", None))
            self._jobs[id(req)] = job
            job.live = req.result
            try:
                self.scheduler.submit(req)
            except BaseException:
                self._jobs.pop(id(req), None)
                raise
        return job

    def _done(self, req: Request) -> None:
        job = self._jobs.pop(id(req))
        job.result = req.result
        job.error = Cancelled() if isinstance(req.error, RequestCancelled) else req.error
        job.finished_at = req.finished_at
        job.started_at = req.admitted_at or req.finished_at     # queue time ends when it joins the batch
        if job.error is None:
            self.finished += 1
            if self.on_done is not None:
                try:
                    self.on_done(job)
                except Exception:
                    pass
        if job.stream is not None:
            job.stream.put(None)
        job.done.set()
        if job.notify is not None:
            job.notify()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Refuse new jobs, finish every accepted one, stop the thread. True when it finished in time; on a
        timeout the jobs still waiting or running are cancelled (their requests end with an error)."""
        self.stop_accepting()
        end = None if timeout is None else time.monotonic() + timeout
        while self.scheduler.running + self.scheduler.waiting and (end is None or time.monotonic() < end):
            time.sleep(0.01)
        finished = not (self.scheduler.running + self.scheduler.waiting)
        if not finished:
            for job in list(self._jobs.values()):
                job.cancel()                       # they leave at the next step
            self.scheduler.wake()
            stop_by = time.monotonic() + 5.0
            while self._jobs and time.monotonic() < stop_by:
                time.sleep(0.01)
        self.scheduler.stop()
        return finished
