"""A request as the HTTP routes hand it to the engine worker (kdtree/serve/batch_worker.py), and its errors.

The HTTP routes only `worker.submit(Job)` and wait on the job (its `notify` callback, its `stream`); they never
call the engine (one engine thread runs every step of the batch). A full queue is refused (QueueFull, HTTP 429)
instead of growing without bound.

A streamed job has `stream`, a queue the worker fills while it generates: each commit's new token ids, then None
once the job is done (result or error set). `job.cancel()` ends a job early (its client went away, or a stop
string ended its stream): it leaves the batch at the next step with job.error = Cancelled.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


class Cancelled(Exception):
    """The job was cancelled (job.cancel()) before it finished."""


@dataclass
class Job:
    prompt_ids: List[int]
    max_new_tokens: int
    stop_ids: Sequence[int] = ()
    stops: Sequence[str] = ()          # stop strings (the batch worker ends generation where one completes)
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0            # time.monotonic seconds: the worker took it
    first_token_at: float = 0.0        # the first commit's tokens arrived
    finished_at: float = 0.0
    generated: int = 0                 # tokens committed so far
    result: Any = None                 # GenerationResult
    error: Optional[BaseException] = None
    done: threading.Event = field(default_factory=threading.Event)
    stream: Optional["queue.Queue[Optional[List[int]]]"] = None    # live token ids, then None (see above)
    cancelled: threading.Event = field(default_factory=threading.Event)
    notify: Optional[Callable[[], None]] = None    # called (worker thread) once done is set: wakes an async waiter
    future: Any = None                 # the HTTP side's asyncio future, resolved through notify
    aqueue: Any = None                 # the HTTP side's asyncio.Queue that `stream` feeds
    sampling: Any = None               # SamplingParams (n=1, seed resolved); None = greedy
    live: Any = None                   # the GenerationResult while it fills (logprobs of the streamed tokens)

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.done.wait(timeout)

    def cancel(self) -> None:
        self.cancelled.set()

    def _on_tokens(self, ids: List[int]) -> None:
        if self.cancelled.is_set():
            raise Cancelled()
        if not self.first_token_at:
            self.first_token_at = time.monotonic()
        self.generated += len(ids)
        if self.stream is not None:
            self.stream.put(list(ids))
