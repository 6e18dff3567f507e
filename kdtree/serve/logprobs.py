"""OpenAI `logprobs` objects from a GenerationResult (kdtree/decode/sampling.py computes the numbers).

    completion_logprobs(tokenizer, result, prompt_ids=ids if echo else None, text_offset=0)
        -> {"tokens", "token_logprobs", "top_logprobs", "text_offset"}     # /v1/completions (legacy layout)
    chat_logprobs(tokenizer, result) -> {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}

A token's text is its bytes decoded as UTF-8 with U+FFFD for a partial character; "bytes" carries them exactly.
The first prompt token has no logprob (None), as in OpenAI's echo.
"""
from __future__ import annotations

from typing import List, Optional, Sequence


def _text(tokenizer, token: int) -> str:
    return tokenizer.token_bytes(int(token)).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer, result, prompt_ids: Optional[Sequence[int]] = None, text_offset: int = 0) -> dict:
    """prompt_ids given (echo) and result.prompt_logprobs computed: the prompt's tokens come first."""
    entries: List[tuple] = []
    if prompt_ids is not None and result.prompt_logprobs is not None:
        entries += [(int(t), e) for t, e in zip(prompt_ids, result.prompt_logprobs)]
    entries += [(e["token"], e) for e in (result.logprobs or [])]
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = int(text_offset)
    for token, e in entries:
        text = _text(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e is None else e["logprob"])
        top = None
        if e is not None:                            # best first; two ids with one text keep the likelier
            top = {}
            for t, lp in e["top"]:
                top.setdefault(_text(tokenizer, t), lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer, result) -> dict:
    def item(token: int, lp: float) -> dict:
        return {"token": _text(tokenizer, token), "logprob": lp, "bytes": list(tokenizer.token_bytes(int(token)))}

    return {"content": [dict(item(e["token"], e["logprob"]), top_logprobs=[item(t, lp) for t, lp in e["top"]])
                        for e in (result.logprobs or [])]}
