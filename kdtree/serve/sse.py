"""Server-sent events: a streamed completion's chunks (text never splitting a UTF-8 character nor a possible stop
string, logprobs, finish_reason, usage, [DONE]; an error after the first byte is an SSE error event)."""
from __future__ import annotations

import json
import sys
import time
import uuid
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

from fastapi.responses import Response, StreamingResponse

from kdtree.decode.sampling import SamplingParams
from kdtree.serve.bridge import pieces
from kdtree.serve.logprobs import chat_logprobs, completion_logprobs
from kdtree.serve.request_queue import Job
from kdtree.serve.text_stream import TextStream, cut_at_stop


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def seed_of(sampling: Optional[SamplingParams]) -> Optional[int]:
    """The seed to report: the request's (sample 0's) when it samples; None for greedy (no draw, nothing to replay)."""
    return None if sampling is None or sampling.greedy else int(sampling.seed)


def final_text(serve, job: Job, stops: List[str]) -> Tuple[str, str]:
    text, stopped = cut_at_stop(serve.engine.tokenizer.decode(job.result.tokens), stops)
    return text, "stop" if stopped or job.result.finish_reason in ("stop", "eos") else "length"


async def stream(serve, jobs: List[Job], stops: List[str], kind: str, echo: bool, texts: List[str],
                  n_prompt: int, include_usage: bool, sampling: Optional[SamplingParams] = None) -> Response:
    first = await jobs[0].aqueue.get()                 # the first tokens, or the end of a job that failed
    if first is None and jobs[0].error is not None:
        for job in jobs:
            job.cancel()
        raise serve.job_error(jobs[0])                 # nothing sent yet: a JSON error like a non-streamed one
    chat = kind == "chat.completion.chunk"
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    tok = serve.engine.tokenizer
    want_lp = sampling is not None and sampling.logprobs is not None
    seed = seed_of(sampling)

    def event(index: int, text: Optional[str], finish: Optional[str], role: bool = False, lp: Any = None) -> bytes:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        out = {"id": cid, "object": kind, "created": created, "model": serve.model_name, "choices": [choice]}
        if seed is not None:
            out["kdtree"] = {"seed": seed}
        return sse(out)

    async def body():
        t0, n_out = time.monotonic(), 0
        try:
            for index, job in enumerate(jobs):
                ts = TextStream(tok, stops)
                sent, offset = 0, 0 if chat else len(texts[index])   # logprob entries sent; completions' text_offset

                def logprobs(final: bool = False):
                    nonlocal sent, offset
                    if not want_lp or job.live is None:
                        return None
                    have = job.live.logprobs or []
                    entries = have[sent:] if final else have[sent:len(ts.tokens)]
                    sent += len(entries)
                    part = SimpleNamespace(logprobs=entries, prompt_logprobs=None)
                    if chat:
                        return chat_logprobs(tok, part)
                    out = completion_logprobs(tok, part, text_offset=offset)
                    offset += sum(len(t) for t in out["tokens"])
                    return out

                if chat:
                    yield event(index, None, None, role=True)
                pre = first if index == 0 else ...
                if echo and want_lp and index > 0:
                    pre = await job.aqueue.get()       # its prefill is done: the prompt's logprobs are in
                if echo:
                    lp = None
                    if want_lp and job.live is not None:
                        prompt = SimpleNamespace(logprobs=[], prompt_logprobs=job.live.prompt_logprobs)
                        lp = completion_logprobs(tok, prompt, prompt_ids=job.prompt_ids)
                        offset = sum(len(t) for t in lp["tokens"])
                    yield event(index, texts[index], None, lp=lp)
                async for ids in pieces(job, pre):
                    piece = ts.push(ids)
                    if piece:
                        yield event(index, piece, None, lp=logprobs())
                    if ts.stopped:
                        job.cancel()                # the text is over; free the engine for the next request
                        break
                if not ts.stopped:
                    await job.future
                if not ts.stopped and job.error is not None:
                    e = serve.job_error(job)
                    print(f"[serve] stream ended early: {e.message}", file=sys.stderr, flush=True)
                    yield sse(e.body())
                    yield b"data: [DONE]\n\n"
                    return
                piece = ts.finish()
                if piece:
                    yield event(index, piece, None, lp=logprobs())
                r = job.result
                finish = "stop" if ts.stopped or (r is not None and r.finish_reason in ("stop", "eos")) else "length"
                rest = logprobs(final=True)
                if rest is not None and not (rest.get("content") if chat else rest["tokens"]):
                    rest = None
                yield event(index, None if chat else "", finish, lp=rest)
                n_out += len(ts.tokens)
            if include_usage:
                yield sse({"id": cid, "object": kind, "created": created, "model": serve.model_name, "choices": [],
                            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                      "total_tokens": n_prompt + n_out}})
            yield b"data: [DONE]\n\n"
            print(f"[serve] stream {n_prompt}+{n_out} tokens {time.monotonic() - t0:.3f} s", file=sys.stderr,
                  flush=True)
        finally:                                        # a stop string, an error, the client gone: stop the rest
            for job in jobs:
                job.cancel()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
