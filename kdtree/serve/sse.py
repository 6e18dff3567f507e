"""Server-sent events: a streamed completion's chunks (text never splitting a UTF-8 character nor a possible stop
string, logprobs, finish_reason, usage, [DONE]; an error after the first byte is an SSE error event)."""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from types import SimpleNamespace
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from fastapi.responses import Response, StreamingResponse

from kdtree.decode.sampling import SamplingParams
from kdtree.serve.bridge import pieces
from kdtree.serve.chat_output import OutputStream
from kdtree.serve.logprobs import chat_logprobs, completion_logprobs
from kdtree.decode.request import Request
from kdtree.serve.text_stream import TextStream, cut_at_stop
from kdtree.serve.tools import finish_reason


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def seed_of(sampling: Optional[SamplingParams]) -> Optional[int]:
    """The seed to report: the request's (sample 0's) when it samples; None for greedy (no draw, nothing to replay)."""
    return None if sampling is None or sampling.greedy else int(sampling.seed)


def final_text(serve, req: Request, stops: List[str], specials: bool = False) -> Tuple[str, str]:
    """The choice's text (specials=True: special tokens as their text, k26's markers for the output parsers)."""
    tokens = req.result.tokens
    decoded = serve.engine.tokenizer.decode(tokens, skip_special_tokens=False) if specials else \
        serve.engine.tokenizer.decode(tokens)
    text, stopped = cut_at_stop(decoded, stops)
    return text, "stop" if stopped or req.result.finish_reason in ("stop", "eos") else "length"


@dataclass
class Chunks:
    """How one streamed response's chunks look: its id, kind (text_completion | chat.completion.chunk), model, seed."""
    kind: str
    model: str
    seed: Optional[int]
    chat: bool = field(init=False)
    cid: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.chat = self.kind == "chat.completion.chunk"
        self.cid = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def head(self) -> dict:
        return {"id": self.cid, "object": self.kind, "created": self.created, "model": self.model}

    def event(self, index: int, text: Optional[str], finish: Optional[str], role: bool = False, lp: Any = None,
              delta: Optional[dict] = None) -> bytes:
        """One choice's chunk: its text (chat: or a parsed `delta`: reasoning_content, tool_calls), its finish."""
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        out = {**self.head(), "choices": [choice]}
        if self.seed is not None:
            out["kdtree"] = {"seed": self.seed}
        return sse(out)


class _Logprobs:
    """The logprobs of one streamed choice, sent as its text goes out (completions count their text_offset)."""

    def __init__(self, tok, chunks: Chunks, req: Request, want: bool, offset: int):
        self.tok, self.chat, self.req, self.want = tok, chunks.chat, req, want
        self.sent, self.offset = 0, offset

    def prompt(self) -> Any:
        """Completions with echo: the prompt's logprobs (the prompt's text is the choice's first chunk)."""
        if not self.want:
            return None
        part = SimpleNamespace(logprobs=[], prompt_logprobs=self.req.result.prompt_logprobs)
        lp = completion_logprobs(self.tok, part, prompt_ids=self.req.prompt_ids)
        self.offset = sum(len(t) for t in lp["tokens"])
        return lp

    def next(self, upto: int, final: bool = False) -> Any:
        if not self.want:
            return None
        have = self.req.result.logprobs or []
        entries = have[self.sent:] if final else have[self.sent:upto]
        self.sent += len(entries)
        part = SimpleNamespace(logprobs=entries, prompt_logprobs=None)
        if self.chat:
            return chat_logprobs(self.tok, part)
        out = completion_logprobs(self.tok, part, text_offset=self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


def _texts(ch: Chunks, index: int, piece: str, os: Optional[OutputStream], lps: "_Logprobs", upto: int,
           final: bool = False):
    """The events of a piece of final text: as it is, or (a parsed chat) its deltas; the logprobs ride on the first."""
    if os is None:
        if piece:
            yield ch.event(index, piece, None, lp=lps.next(upto))
        return
    for d in (os.push(piece) if piece else []) + (os.finish() if final else []):
        yield ch.event(index, None, None, lp=lps.next(upto), delta=d)


async def _choice(serve, ch: Chunks, index: int, req: Request, first: Any, stops: List[str], echo: bool,
                  text: str, want_lp: bool, out: List[int], plan: Any = None):
    """The chunks of choice `index`: (chat) the role, (echo) the prompt, the text as it commits (parsed into
    reasoning / tool-call deltas when `plan` says so), the finish chunk. An engine error after the stream started
    ends it with an SSE error event (out[1] = 1)."""
    tok = serve.engine.tokenizer
    os = OutputStream(plan.reasoning, plan.tools) if plan is not None and plan.parses else None
    ts = TextStream(tok, stops, skip_special_tokens=os is None)       # parsed: k26's markers as their text
    lps = _Logprobs(tok, ch, req, want_lp, 0 if ch.chat else len(text))
    if ch.chat:
        yield ch.event(index, None, None, role=True)
    if echo:
        if want_lp and index > 0:
            first = await req.tag.aqueue.get()      # its prefill is done: the prompt's logprobs are in
        yield ch.event(index, text, None, lp=lps.prompt())
    async for ids in pieces(req, first):
        for event in _texts(ch, index, ts.push(ids), os, lps, len(ts.tokens)):
            yield event
        if ts.stopped:
            req.cancel()                            # the text is over; free the engine for the next request
            break
    if not ts.stopped:
        await req.tag.future
        if req.error is not None:
            e = serve.request_error(req)
            print(f"[serve] stream ended early: {e.message}", file=sys.stderr, flush=True)
            out[1] = 1
            yield sse(e.body())
            return
    for event in _texts(ch, index, ts.finish(), os, lps, len(ts.tokens), final=True):
        yield event
    finish = "stop" if ts.stopped or req.result.finish_reason in ("stop", "eos") else "length"
    if os is not None:
        finish = finish_reason(os.calls, os.open, finish)
    if os is not None and plan.reasoning:
        out[2] += len(tok.encode(os.reasoning)) if os.reasoning else 0
    rest = lps.next(len(ts.tokens), final=True)
    if rest is not None and not (rest.get("content") if ch.chat else rest["tokens"]):
        rest = None
    yield ch.event(index, None if ch.chat else "", finish, lp=rest)
    out[0] += len(ts.tokens)


async def interleaved(gens: List[Any]):
    """The items of several async generators as each produces them (each one's own order kept); an exception in
    one is raised here; the rest are closed when the consumer stops."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(gen):
        try:
            async for item in gen:
                await queue.put(item)
        except Exception as e:                          # handed to the consumer
            await queue.put(e)
        finally:
            await queue.put(end)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    left = len(tasks)
    try:
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def stream(serve, reqs: List[Request], stops: List[str], kind: str, echo: bool, texts: List[str],
                 n_prompt: int, include_usage: bool, sampling: Optional[SamplingParams] = None,
                 plan: Any = None) -> Response:
    """The SSE response of `reqs` (one per choice, in order); an error before the first token is a JSON error."""
    first = await reqs[0].tag.aqueue.get()             # the first tokens, or the end of a request that failed
    if first is None and reqs[0].error is not None:
        for r in reqs:
            r.cancel()
        raise serve.request_error(reqs[0])             # nothing sent yet: a JSON error like a non-streamed one
    ch = Chunks(kind, serve.model_name, seed_of(sampling))
    want_lp = sampling is not None and sampling.logprobs is not None

    async def body():
        t0, out = time.monotonic(), [0, 0, 0]          # completion tokens sent, failed, reasoning tokens
        try:
            choices = [_choice(serve, ch, index, req, first if index == 0 else ..., stops, echo, texts[index],
                               want_lp, out, plan) for index, req in enumerate(reqs)]
            async for chunk in interleaved(choices):       # n > 1: the choices' chunks as they are decoded
                yield chunk
                if out[1]:
                    break
            else:
                if include_usage:
                    usage = {"prompt_tokens": n_prompt, "completion_tokens": out[0], "total_tokens": n_prompt + out[0],
                             "prompt_tokens_details": {"cached_tokens": sum(r.result.cached_tokens for r in reqs)}}
                    if plan is not None and plan.reasoning:
                        usage["completion_tokens_details"] = {"reasoning_tokens": out[2]}
                    yield sse({**ch.head(), "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
            if not out[1]:
                print(f"[serve] stream {n_prompt}+{out[0]} tokens {time.monotonic() - t0:.3f} s", file=sys.stderr,
                      flush=True)
        finally:                                        # a stop string, an error, the client gone: stop the rest
            for r in reqs:
                r.cancel()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
