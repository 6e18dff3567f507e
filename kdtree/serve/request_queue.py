"""One engine worker thread consuming a bounded request queue: the scheduler seam of the server.

The HTTP routes only `submit(Job)` and wait on the job (its `notify` callback, its `stream`); they never call the
engine. Continuous batching (#18) replaces this class behind the same submit/drain/depth/in_flight interface.

The numpy engine (and a single CUDA stream) is not thread-safe, so HTTP handler threads never touch it:
they submit a Job and wait. Concurrency = queueing; a full queue is refused (HTTP 429) instead of
growing without bound. Results are per request, so greedy output never depends on the other requests.

A streamed job has `stream`, a queue the worker fills while it generates: each commit's new token ids
(engine.generate's on_tokens), then None once the job is done (result or error set). `job.cancel()` ends a
job early (its client went away, or a stop string ended its stream): a queued job is skipped, a running one
stops at its next commit with job.error = Cancelled.
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


class EngineWorker:
    def __init__(self, engine: Any, max_queue: int = 256, on_done=None):
        self.engine = engine
        self.on_done = on_done                     # fn(job) after each job (metrics)
        self._q: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max(1, int(max_queue)))
        self._accepting = True
        self._lock = threading.Lock()
        self.in_flight = 0
        self.finished = 0                          # jobs ended with a result (metrics, drain report)
        self._running: Optional[Job] = None
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    @property
    def running(self) -> Optional[Job]:
        return self._running

    @property
    def depth(self) -> int:
        return self._q.qsize()

    def submit(self, job: Job) -> Job:
        with self._lock:
            if not self._accepting:
                raise Draining()
            try:
                self._q.put_nowait(job)
            except queue.Full:
                raise QueueFull() from None
        return job

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Refuse new jobs, finish every accepted one, stop the thread. True when it finished in time; on a
        timeout the jobs still waiting or running are cancelled (their requests end with an error)."""
        self.stop_accepting()
        self._q.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return True
        while True:                                  # cut: cancel what is left so every waiter gets an answer
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.error = Cancelled()
                if job.stream is not None:
                    job.stream.put(None)
                job.done.set()
                if job.notify is not None:
                    job.notify()
        running = self._running
        if running is not None:
            running.cancel()                          # stops at its next commit (one verify round)
        self._q.put(None)
        self._thread.join(5.0)
        return False

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            self.in_flight = 1
            self._running = job
            job.started_at = time.monotonic()
            try:
                if job.cancelled.is_set():
                    raise Cancelled()
                job.result = self.engine.generate(job.prompt_ids, job.max_new_tokens, stop_ids=tuple(job.stop_ids),
                                                  on_tokens=job._on_tokens)
            except BaseException as e:             # reported to the waiting request, the worker lives on
                job.error = e
            finally:
                self.in_flight = 0
                self._running = None
                job.finished_at = time.monotonic()
                if job.error is None:
                    self.finished += 1
                if self.on_done is not None and job.error is None:
                    try:
                        self.on_done(job)
                    except Exception:
                        pass
                if job.stream is not None:
                    job.stream.put(None)
                job.done.set()
                if job.notify is not None:
                    job.notify()
