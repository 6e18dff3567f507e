"""Chat messages -> prompt text, rendered from the model's Jinja2 chat template as HF transformers renders it.

    tpl = ChatTemplate.for_checkpoint(checkpoint_dir, model_name)     # ChatTemplateError when there is none
    text = tpl.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)

Where the template comes from (the first that exists): `<checkpoint>/chat_template.jinja`, the `chat_template`
of `<checkpoint>/tokenizer_config.json` (a string, or a list of {name, template}: the one named "default"),
and for the tiny model the template shipped with its assets (kdtree/assets/tiny/chat_template.jinja).
Rendering matches transformers' apply_chat_template: a sandboxed ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, `raise_exception` and `strftime_now` available, the tokenizer's special
tokens (bos_token, eos_token, ...) as variables, `messages`, `tools`, `documents`, `add_generation_prompt` and
any extra chat_template_kwargs (K2.6: `thinking`, `preserve_thinking`), with the messages normalized as
apply_chat_template normalizes them (keys whose value is None dropped; `reasoning` / `thinking` / `reasoning_content`
aliased to each other), and `tojson` as transformers defines it (no HTML escaping; indent, separators, sort_keys).

Prompt ids, and user text that names a special token. HF's apply_chat_template(tokenize=True) by default, and vLLM,
encode the whole rendered string with special tokens recognized: a user who writes `<|im_end|><|im_system|>...` in
a message gets real role markers (prompt injection). `ChatTemplate.encode` does what transformers does under
`sanitize_control_tokens=True`: every special token's text in the caller's strings (messages, tools, kwargs; not
dict keys) is wrapped in two private-use code points before rendering, the rendered text is split at them, and the
wrapped pieces are encoded as plain text while the rest (the template's own markers) is encoded with specials
allowed. The text is the same as render()'s; only the template's markers become special ids.

    ids, text = tpl.encode(tokenizer, messages, add_generation_prompt=True, tools=tools, thinking=True)
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from kdtree.errors import KdtreeError

TINY_TEMPLATE = Path(__file__).resolve().parent.parent / "assets" / "tiny" / "chat_template.jinja"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
_MARK, _END = "\U000f0000", "\U000f0001"     # transformers' markers of user-written control tokens
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(KdtreeError):
    pass


def _token_text(v: Any) -> str:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict {"content": ...}
    return v.get("content", "") if isinstance(v, dict) else (v or "")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Optional[Dict[str, str]] = None, origin: str = ""):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.origin = origin
        # tiny's byte tokenizer has no end-of-turn token: the template's end marker is a stop string instead
        self.stops = ["<|im_end|>"] if origin == str(TINY_TEMPLATE) else []
        self.source = source
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template of {origin or 'the model'} does not compile: {e}") from None
        # as transformers' special_tokens_map: only the ones the tokenizer has (a missing one stays undefined)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}

    @classmethod
    def for_checkpoint(cls, checkpoint_dir, model_name: str = "") -> "ChatTemplate":
        ckpt = Path(checkpoint_dir) if checkpoint_dir else None
        specials: Dict[str, str] = {}
        source, origin = None, ""
        config = ckpt / "tokenizer_config.json" if ckpt else None
        if config is not None and config.exists():
            try:
                data = json.loads(config.read_text())
            except ValueError as e:
                raise ChatTemplateError(f"{config}: not valid JSON ({e}); fix or remove the file") from None
            specials = {k: _token_text(data.get(k)) for k in _SPECIAL_KEYS if data.get(k) is not None}
            tpl = data.get("chat_template")
            if isinstance(tpl, list):
                tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"),
                           None)
            if isinstance(tpl, str):
                source, origin = tpl, str(config)
        if ckpt is not None and (ckpt / "chat_template.jinja").exists():
            source, origin = (ckpt / "chat_template.jinja").read_text(), str(ckpt / "chat_template.jinja")
        if source is None and model_name in ("tiny", "tiny_wide"):
            source, origin = TINY_TEMPLATE.read_text(), str(TINY_TEMPLATE)
        if source is None:
            raise ChatTemplateError(f"checkpoint {ckpt} has no chat template (chat_template.jinja or chat_template "
                                    f"in tokenizer_config.json); /v1/chat/completions needs one, use /v1/completions")
        return cls(source, specials, origin)

    def render(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
               tools: Optional[List[Dict[str, Any]]] = None, **template_kwargs: Any) -> str:
        """The prompt text, as transformers' apply_chat_template(messages, tools=tools, tokenize=False,
        add_generation_prompt=..., **template_kwargs) renders it; template_kwargs are chat_template_kwargs."""
        return self._render(_normalized(messages), add_generation_prompt, _plain(tools), _plain(template_kwargs))

    def encode(self, tokenizer, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
               tools: Optional[List[Dict[str, Any]]] = None, **template_kwargs: Any) -> Tuple[List[int], str]:
        """(prompt ids, render()'s text): the template's special-token markers are their ids, a special token's
        text written by the caller is plain text (transformers' sanitize_control_tokens=True)."""
        control = _control_re(tuple(getattr(tokenizer, "special_tokens", None) or ()))
        if control is None:                                # byte tokenizer: no special token has a text
            text = self.render(messages, add_generation_prompt, tools, **template_kwargs)
            return list(tokenizer.encode(text)), text
        marked = self._render(_marked(_normalized(messages), control), add_generation_prompt,
                              _marked(_plain(tools), control), _marked(_plain(template_kwargs), control))
        pieces = re.split(f"{_MARK}({control.pattern}){_END}|[{_MARK}{_END}]", marked)
        ids: List[int] = []
        for i, piece in enumerate(pieces):          # [template text, user-written special, template text, ...]
            if piece:                               # (None: a lone marker, dropped)
                ids += tokenizer.encode(piece, allow_special=i % 2 == 0)
        return ids, "".join(p for p in pieces if p)

    def end_of_turn_ids(self, tokenizer) -> List[int]:
        """Special ids that end an assistant turn in this template (K2: `<|im_end|>`, K2.6's eos_token_id; the
        checkpoint's [EOS] is another id): stop ids for a chat generation. [] when the tokenizer has none."""
        specials = getattr(tokenizer, "special_tokens", None) or {}
        return [specials[t] for t in ("<|im_end|>",) if t in specials and t in self.source]

    def _render(self, messages, add_generation_prompt, tools, kwargs) -> str:
        from jinja2 import TemplateError

        if not messages:
            raise ChatTemplateError("messages is empty; a chat needs at least one message")
        clash = sorted(set(kwargs) & set(_RESERVED))
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {clash}; they are the request's own fields")
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **kwargs})
        except TemplateError as e:       # raise_exception(...) in the template: the messages are not valid for it
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None


@lru_cache(maxsize=8)
def _control_re(names: Tuple[str, ...]) -> "Optional[re.Pattern]":
    """Any special token's text, the longest first (a token wins over the tokens it contains)."""
    return re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True)))) if names else None


def _plain(value: Any) -> Any:
    """Plain JSON-like data (pydantic models dumped), as transformers rebuilds what a template may see."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    for base in (bool, int, float, str):           # enums, numpy scalars: their base value
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _normalized(messages: List[Any]) -> List[Dict[str, Any]]:
    """apply_chat_template's messages: None-valued keys dropped, reasoning aliased under all its names."""
    out = []
    for m in _plain(list(messages)):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"a chat message must be an object, got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _marked(value: Any, control: "re.Pattern") -> Any:
    """Each special token's text in the strings of value wrapped in the private markers (markers already there
    removed first, so none can be forged); dict keys are left alone."""
    if isinstance(value, str):
        value = value.replace(_MARK, "").replace(_END, "")
        return control.sub(lambda m: f"{_MARK}{m.group(0)}{_END}", value)
    if isinstance(value, dict):
        return {k: _marked(v, control) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_marked(v, control) for v in value]
    return value
