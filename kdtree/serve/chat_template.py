"""Chat messages -> prompt text, rendered from the model's Jinja2 chat template as HF transformers renders it.

    tpl = ChatTemplate.for_checkpoint(checkpoint_dir, model_name)     # ChatTemplateError when there is none
    text = tpl.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)

Where the template comes from (the first that exists): `<checkpoint>/chat_template.jinja`, the `chat_template`
of `<checkpoint>/tokenizer_config.json` (a string, or a list of {name, template}: the one named "default"),
and for the tiny model the template shipped with its assets (kdtree/assets/tiny/chat_template.jinja).
Rendering matches transformers' apply_chat_template: a sandboxed ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, `raise_exception` and `strftime_now` available, the tokenizer's special
tokens (bos_token, eos_token, ...) as variables, `messages` and `add_generation_prompt`.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

from kdtree.errors import KdtreeError

TINY_TEMPLATE = Path(__file__).resolve().parent.parent / "assets" / "tiny" / "chat_template.jinja"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


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
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.origin = origin
        # tiny's byte tokenizer has no end-of-turn token: the template's end marker is a stop string instead
        self.stops = ["<|im_end|>"] if origin == str(TINY_TEMPLATE) else []
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template of {origin or 'the model'} does not compile: {e}") from None
        self.special_tokens = {k: "" for k in _SPECIAL_KEYS}
        self.special_tokens.update(special_tokens or {})

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
               tools: Optional[List[Dict[str, Any]]] = None, **kwargs: Any) -> str:
        """`tools` (OpenAI tool dicts) and the extra variables (chat_template_kwargs: thinking, ...) as HF passes
        them; the special tokens and messages/add_generation_prompt/tools cannot be overridden by kwargs."""
        from jinja2 import TemplateError

        extra = {k: v for k, v in kwargs.items() if k not in ("messages", "add_generation_prompt", "tools")}
        try:
            return self._template.render(**{**extra, **self.special_tokens}, messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt)
        except TemplateError as e:       # raise_exception(...) in the template: the messages are not valid for it
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
