"""The one generation path of /v1/completions and /v1/chat/completions: the route has turned its request into token
ids, texts and sampling parameters (a Generation); this submits one kdtree.decode.request.Request per choice to the
engine's scheduler, then answers with the SSE stream (kdtree/serve/sse.py) or the whole response, whose choices
differ between the two APIs only in shape (text + logprobs vs message + logprobs)."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import List, Optional

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from kdtree.decode.sampling import SamplingParams
from kdtree.serve import protocol as P
from kdtree.serve.bridge import until_done_or_gone
from kdtree.serve.chat_output import parse_output
from kdtree.serve.logprobs import chat_logprobs, completion_logprobs
from kdtree.serve.output_plan import OutputPlan
from kdtree.serve.sse import final_text, stream
from kdtree.serve.tools import finish_reason


@dataclass
class Generation:
    chat: bool
    prompts: List[List[int]]       # token ids of each prompt (chat: the one rendered conversation)
    texts: List[str]               # each prompt's text (completions: echo and logprobs' text_offset)
    max_tokens: int
    stops: List[str]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False    # stream_options.include_usage
    echo: bool = False             # completions only
    plan: OutputPlan = field(default_factory=OutputPlan)     # the grammar; how the text is read back (chat)
    stop_ids: List[int] = field(default_factory=list)        # chat: the template's end-of-turn ids (k26 <|im_end|>)


def reasoning_tokens(serve, reasoning: Optional[str]) -> int:
    """Completion tokens of the reasoning part (its text re-encoded: the byte tokenizer's count is exact)."""
    return len(serve.engine.tokenizer.encode(reasoning)) if reasoning else 0


def _message(serve, g: Generation, text: str, finish: str, counts: List[int]):
    if not g.plan.parses:
        return P.AssistantMessage(content=text), finish
    out = parse_output(text, reasoning=g.plan.reasoning, tools=g.plan.tools)
    counts.append(reasoning_tokens(serve, out.reasoning))
    calls = [P.ToolCall(id=c["id"], function=P.FunctionCall(**c["function"])) for c in out.calls] or None
    return P.AssistantMessage(content=out.content, reasoning_content=out.reasoning, tool_calls=calls), \
        finish_reason(out.calls, out.open, finish)


def _choice(serve, g: Generation, i: int, req, text: str, finish: str, counts: List[int]):
    tok = serve.engine.tokenizer
    if g.chat:
        lp = chat_logprobs(tok, req.result) if g.sampling.logprobs is not None else None
        message, finish = _message(serve, g, text, finish, counts)
        return P.ChatChoice(index=i, message=message, logprobs=lp, finish_reason=finish)
    prompt_text = g.texts[i // g.sampling.n]
    lp = None
    if g.sampling.logprobs is not None:
        lp = completion_logprobs(tok, req.result, prompt_ids=req.prompt_ids if g.echo else None,
                                 text_offset=0 if g.echo else len(prompt_text))
    return P.CompletionChoice(index=i, text=(prompt_text + text) if g.echo else text, logprobs=lp,
                              finish_reason=finish)


async def respond(serve, http: HttpRequest, g: Generation) -> Response:
    """Submit every choice of `g` (all or none), then stream them or wait for all (a client that goes away cancels
    them) and answer; a choice that ended with an error answers that error."""
    reqs = await asyncio.to_thread(serve.submit, g.prompts, g.max_tokens, g.stops, asyncio.get_running_loop(),
                                   g.stream, g.sampling, g.plan.grammar, g.stop_ids)   # off the event loop
    n_prompt = sum(len(ids) for ids in g.prompts)
    if g.stream:
        texts = [g.texts[k // g.sampling.n] for k in range(len(reqs))]
        kind = "chat.completion.chunk" if g.chat else "text_completion"
        return await stream(serve, reqs, g.stops, kind, g.echo, texts, n_prompt, g.include_usage, g.sampling,
                            plan=g.plan if g.chat else None)
    await until_done_or_gone(http, reqs)
    choices, counts = [], []
    for i, req in enumerate(reqs):
        if req.error is not None:
            raise serve.request_error(req)
        choices.append(_choice(serve, g, i, req, *final_text(serve, req, g.stops, g.chat and g.plan.parses), counts))
    results = [req.result for req in reqs]
    n_out = sum(len(r.tokens) for r in results)
    usage = P.Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                    prompt_tokens_details=P.PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in results)),
                    completion_tokens_details=P.CompletionTokensDetails(reasoning_tokens=sum(counts))
                    if g.plan.reasoning else None)
    cls, prefix = (P.ChatCompletionResponse, "chatcmpl") if g.chat else (P.CompletionResponse, "cmpl")
    resp = cls(id=f"{prefix}-{uuid.uuid4().hex[:24]}", model=serve.model_name, choices=choices, usage=usage,
               kdtree=serve.stats(results, g.sampling))
    return JSONResponse(P.dump(resp))
