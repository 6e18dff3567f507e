"""The engine thread -> event loop bridge: a request's streamed tokens and its end reach the HTTP side's asyncio queue
and future (its Wire, kept in `req.tag`) through one mailbox per loop (one wake-up per burst), and a waiting route
notices a client that went away."""
from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from fastapi import Request as HttpRequest

from kdtree.decode.request import Request


class Mailbox:
    """The engine thread's way into the event loop, one wake-up per burst: a batch step commits tokens for every
    running request, and a call_soon_threadsafe each would write the loop's self-pipe once per request and
    step. put() queues the callback and wakes the loop only when the box was empty; the loop runs everything
    queued since, in order (a request's last tokens before its end). One box per loop."""
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
            except Exception as e:           # one request's callback must not drop the others' tokens
                print(f"[serve] delivering to a request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


Mailbox._boxes = weakref.WeakKeyDictionary()


@dataclass
class Wire:
    """The HTTP side of one request (its `tag`): the future its end resolves and, when streamed, the asyncio.Queue
    that each commit's token ids (then None, at its end) reach through the loop's mailbox."""
    future: Any
    aqueue: Optional[asyncio.Queue] = None


def wired(req: Request, loop, stream: bool) -> Request:
    """`req` with its Wire: on_tokens (scheduler thread) feeds the queue when streamed, notify resolves the future
    (after None on the queue). Returns req."""
    box = Mailbox.of(loop)
    wire = Wire(loop.create_future(), asyncio.Queue() if stream else None)

    def done(_req) -> None:
        if wire.aqueue is not None:
            box.put(wire.aqueue.put_nowait, None)
        box.put(lambda: wire.future.done() or wire.future.set_result(None))

    if stream:
        req.on_tokens = lambda ids: box.put(wire.aqueue.put_nowait, list(ids))
    req.notify, req.tag = done, wire
    return req


async def pieces(req: Request, first: Any = ...):
    """The token-id lists a streamed request commits, each holding all that arrived since the last; ends with it.
    first: an item already taken from its queue."""
    q = req.tag.aqueue
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


async def until_done_or_gone(request: HttpRequest, reqs: List[Request], poll_s: float = 0.05) -> None:
    """Wait for every request; a client that disconnects first cancels them (they leave the batch at the next
    step)."""
    waiting = asyncio.ensure_future(asyncio.gather(*(r.tag.future for r in reqs)))
    try:
        while not waiting.done():
            await asyncio.wait([waiting], timeout=poll_s)
            if not waiting.done() and await request.is_disconnected():
                for r in reqs:
                    r.cancel()
                await waiting                         # each ends at the next step boundary
                return
    finally:
        if not waiting.done():                    # the handler itself was cancelled
            for r in reqs:
                r.cancel()
