"""The engine thread -> event loop bridge: a job's streamed tokens and its end reach the HTTP side's asyncio queue and
future through one mailbox per loop (one wake-up per burst), and a waiting route notices a client that went away."""
from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from typing import Any, Callable, List

from fastapi import Request

from kdtree.serve.request_queue import Job


class Mailbox:
    """The engine thread's way into the event loop, one wake-up per burst: a batch step commits tokens for every
    running request, and a call_soon_threadsafe each would write the loop's self-pipe once per request and
    step. put() queues the callback and wakes the loop only when the box was empty; the loop runs everything
    queued since, in order (a job's last tokens before its end). One box per loop."""
    _boxes: "weakref.WeakKeyDictionary[Any, Mailbox]"

    def __init__(self, loop):
        self.loop, self._lock, self._items = loop, threading.Lock(), []

    @classmethod
    def of(cls, loop) -> "Mailbox":
        box = cls._boxes.get(loop)
        if box is None:
            box = cls._boxes[loop] = cls(loop)
        return box

    def put(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            wake = not self._items
            self._items.append((fn, args))
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:             # the loop is closed: the server is gone, nobody reads any more
                pass

    def _run(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fn, args in items:
            try:
                fn(*args)
            except Exception as e:           # one job's callback must not drop the other jobs' tokens
                print(f"[serve] delivering to a request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


Mailbox._boxes = weakref.WeakKeyDictionary()


class LoopSink:
    """The worker thread's side of a streamed job: token lists (then None) into an asyncio.Queue of the loop."""

    def __init__(self, box: Mailbox, q: asyncio.Queue):
        self.box, self.q = box, q

    def put(self, item) -> None:
        self.box.put(self.q.put_nowait, item)


def notifier(box: Mailbox, fut):
    def done():
        box.put(lambda: fut.done() or fut.set_result(None))
    return done


async def pieces(job: Job, first: Any = ...):
    """The token-id lists a streamed job commits, each holding all that arrived since the last; ends with the job.
    first: an item already taken from the job's queue."""
    q = job.aqueue
    item = await q.get() if first is ... else first
    while item is not None:
        batch = list(item)
        while not q.empty():
            item = q.get_nowait()
            if item is None:
                break
            batch.extend(item)
        else:
            item = ...
        yield batch
        if item is ...:
            item = await q.get()


async def until_done_or_gone(request: Request, jobs: List[Job], poll_s: float = 0.05) -> None:
    """Wait for every job; a client that disconnects first cancels them (they leave the batch at the next step)."""
    waiting = asyncio.ensure_future(asyncio.gather(*(job.future for job in jobs)))
    try:
        while not waiting.done():
            await asyncio.wait([waiting], timeout=poll_s)
            if not waiting.done() and await request.is_disconnected():
                for job in jobs:
                    job.cancel()
                await waiting                         # each job ends at the next step boundary
                return
    finally:
        if not waiting.done():                    # the handler itself was cancelled
            for job in jobs:
                job.cancel()
