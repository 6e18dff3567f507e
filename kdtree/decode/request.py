"""A request: the one record from whoever asks (an HTTP route, a pipeline stage, a test) to the scheduler and back.

    req = engine.submit(Request(prompt_ids, max_new_tokens=64, sampling=params, on_tokens=send))
    req.wait(); req.result.tokens, req.error

The submitter fills the inputs; the scheduler (kdtree/decode/scheduler.py) fills `result`, the timestamps and
`error`, sets `done` and calls `notify` once. `cancel()` ends it at the next step boundary (RequestCancelled).
`tag` is the submitter's own (the server keeps its stream bridge there); the decoder never reads it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

from kdtree.decode.result import GenerationResult
from kdtree.decode.sampling import SamplingParams
from kdtree.errors import ConfigError, KdtreeError


class ContextLengthExceeded(ConfigError):
    """A request that can never fit (its context or the whole cache pool is too small)."""
    code = "context_length_exceeded"


class RequestCancelled(KdtreeError):
    """The request was cancelled (its client went away, a stop string ended its stream) before it finished."""
    code = "cancelled"


class RequestTimeout(KdtreeError):
    """The request ran past its wall-clock limit (serve.request_timeout_s)."""
    code = "timeout"


@dataclass(eq=False)                           # identity: a request is one object, compared with `is`
class Request:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: Optional[SamplingParams] = None   # None / greedy: argmax (penalised when it sets penalties)
    tree: Any = None                       # a tree config (ar | chain | ddtree); None = the scheduler's
    stop_ids: Sequence[int] = ()           # single-token stops (the token is not kept)
    stop_strings: Sequence[str] = ()       # text stops (the route cuts the text; stop_check ends generation)
    # committed tokens -> how many to keep when a stop string completed in them (None = not yet); ends the request
    stop_check: Optional[Callable[[List[int]], Optional[int]]] = None
    on_tokens: Optional[Callable[[List[int]], None]] = None   # each commit's new tokens (scheduler thread)
    notify: Optional[Callable[["Request"], None]] = None      # called once, after done is set (scheduler thread)
    timeout_s: float = 0.0                 # wall-clock limit from submit; 0 = the scheduler's request_timeout_s
    prefill: Any = None                    # a SharedPrefill: the n samples of generate_n share one prompt forward
    grammar: Any = None                    # a GrammarState (kdtree/decode/grammar.py): every token it refuses is masked
    tag: Any = None                        # the submitter's own data; never read by the decoder
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

    @property
    def generated(self) -> int:
        """Tokens committed so far."""
        return len(self.result.tokens)


__all__ = ["ContextLengthExceeded", "Request", "RequestCancelled", "RequestTimeout"]
