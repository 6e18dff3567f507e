"""What a generation request asks of its output, decided before it is submitted: the grammar every sample decodes
under (kdtree/serve/tool_grammar.py -> kdtree/decode/grammar.py), and how the text is read back (reasoning split,
K2 tool calls: kdtree/serve/chat_output.py).

    plan = chat_plan(serve, req)           # ApiError 400 naming the parameter when a grammar cannot be built
    plan = completion_plan(serve, req)     # response_format only; the text is never parsed
    Request(..., grammar=plan.grammar.start())     # one matcher per sample (ServeApp.submit)

serve.reasoning_parser: kimi_k2 (thinking on unless chat_template_kwargs.thinking is false, as vLLM), none, or
auto: kimi_k2 whose thinking default is on when `<think>` is a special token of the tokenizer (K2.6) and off
otherwise (tiny: chat_template_kwargs {"thinking": true} turns it on). serve.tool_call_parser: kimi_k2 | none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kdtree.decode.grammar import GrammarError, Grammars
from kdtree.errors import ConfigError
from kdtree.serve.reasoning import THINK
from kdtree.serve.tool_grammar import check_tool_choice, output_grammar
from kdtree.serve.transport import ApiError


@dataclass
class OutputPlan:
    grammar: Any = None              # a GrammarSpec, or None: unconstrained
    reasoning: bool = False          # split <think>...</think> into reasoning_content
    tools: bool = False              # parse K2's tool-call markers into tool_calls

    @property
    def parses(self) -> bool:
        return self.reasoning or self.tools


def thinking(serve, kwargs: Optional[dict]) -> bool:
    """Whether this request's output starts with a reasoning block to split off (see the module doc)."""
    parser = getattr(serve, "reasoning_parser", "auto")
    if parser == "none":
        return False
    special = getattr(serve.engine.tokenizer, "special_tokens", {}) or {}
    default = parser == "kimi_k2" or THINK in special
    value = (kwargs or {}).get("thinking", default)
    return bool(value) if value is not None else default


def _grammars(serve) -> Grammars:
    cfg = getattr(serve.engine, "cfg", None)
    vocab = int(cfg.model.vocab_size) if cfg is not None else int(serve.engine.tokenizer.vocab_size)
    return Grammars.for_tokenizer(serve.engine.tokenizer, vocab)


def _built(fn, param: str):
    try:
        return fn()
    except GrammarError as e:
        raise ApiError(400, str(e), param=e.param or param, code="invalid_grammar") from None
    except ConfigError as e:                      # a tokenizer llguidance cannot take
        raise ApiError(400, f"{param}: structured output is not available for this model: {e}", param=param,
                       code="invalid_grammar") from None


def chat_plan(serve, req) -> OutputPlan:
    tools, choice = req.tool_dicts(), req.choice()
    rf = req.response_format.as_dict() if req.response_format is not None else None
    think = thinking(serve, req.chat_template_kwargs)
    _built(lambda: check_tool_choice(tools, choice), "tool_choice")
    need = choice not in (None, "auto") or (rf is not None and rf["type"] != "text")
    spec = None
    if need:
        spec = _built(lambda: output_grammar(_grammars(serve), tools, choice, req.parallel_tool_calls, rf, think),
                      "tool_choice" if choice not in (None, "auto", "none") else "response_format")
    parse_tools = bool(tools) and choice != "none" and getattr(serve, "tool_call_parser", "kimi_k2") != "none"
    return OutputPlan(grammar=spec, reasoning=think, tools=parse_tools)


def completion_plan(serve, req) -> OutputPlan:
    rf = req.response_format.as_dict() if req.response_format is not None else None
    if rf is None or rf["type"] == "text":
        return OutputPlan()
    return OutputPlan(grammar=_built(lambda: output_grammar(_grammars(serve), None, None, None, rf), "response_format"))


__all__ = ["OutputPlan", "chat_plan", "completion_plan", "thinking"]
