"""The OpenAI completions and chat completions APIs as pydantic models: what the server accepts and answers.

One class per request and per response. Requests are strict (a string is not a bool, a float is not an int,
NaN is not a temperature) and closed (`extra="forbid"`: an unknown parameter is a 400 naming it, never
ignored). Parameters that kdtree does not implement are typed fields all the same, so the schema at
/openapi.json says what they are; `unsupported()` names the ones a request sets to a value other than the
identity (logit_bias, best_of != 1, suffix). The sampling fields (temperature, top_p, top_k, seed, penalties,
n, logprobs, echo) become a SamplingParams in ServeApp (SamplingParams.from_openai, #20); an omitted one takes
the engine's default (the checkpoint's generation_config.json, else OpenAI's temperature 1).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

DEFAULT_MAX_TOKENS = 16           # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def _no_lone_surrogates(s: str) -> str:
    # valid JSON ("\ud800") but not text: it cannot be encoded to UTF-8, so no tokenizer can take it
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"string has a lone UTF-16 surrogate {s[e.start]!r} at character {e.start}; "
                         f"send valid Unicode text") from None
    return s


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
TokenId = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
Probability = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)]


SGLANG_IDENTITY = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                   "return_hidden_states": False, "continue_final_message": False}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
JsonSchema = Dict[str, Any]


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[Text] = None
    schema_: Optional[JsonSchema] = Field(default=None, alias="schema")
    strict: Optional[bool] = None          # always enforced: the output is constrained by the grammar engine


class ResponseFormat(_Request):
    """text | json_object (any JSON object) | json_schema (a JSON value valid under json_schema.schema)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format type json_schema needs json_schema.schema (a JSON schema object)")
        return self

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_}
        return out


class _SamplingFields(_Request):
    """Fields both APIs share. None = not set: the server's default (sampling_defaults())."""
    model: Optional[Text] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[Text, Annotated[List[Text], Field(max_length=16)]]] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[Probability] = None
    top_k: Optional[Annotated[int, Field(ge=-1)]] = None               # vLLM's extension: -1 or 0 = all tokens
    n: Optional[Annotated[int, Field(ge=1, le=128)]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepetitionPenalty] = None             # vLLM's extension: 1 = off
    logit_bias: Optional[Dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]]] = None
    user: Optional[Text] = None
    # SGLang's extensions, which sglang-router (the fleet's router) sends with every request at these values:
    # taken at them, refused otherwise
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False
    response_format: Optional[ResponseFormat] = None                   # structured output (a grammar, llguidance)

    def unsupported(self) -> Optional[tuple]:
        """(param, message) for the first field set to something kdtree cannot do; None when all are fine."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported; send none"
        for name, identity in SGLANG_IDENTITY.items():
            if getattr(self, name, identity) != identity:
                return name, f"{name}={getattr(self, name)} (an SGLang extension) is not supported; send {name}={identity}"
        return None

    def stops(self) -> List[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: Union[Text, Annotated[List[TokenId], Field(min_length=1)], Annotated[List[Text], Field(min_length=1)],
                  Annotated[List[Annotated[List[TokenId], Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: Optional[Annotated[int, Field(ge=0, le=5)]] = None
    best_of: Optional[Annotated[int, Field(ge=1, le=128)]] = None
    suffix: Optional[Text] = None

    def unsupported(self) -> Optional[tuple]:
        if self.best_of is not None and self.best_of != 1:
            return "best_of", f"best_of={self.best_of} is not supported; use n for several samples (best_of=1)"
        if self.suffix is not None:
            return "suffix", "suffix (insertion) is not supported by this model; drop the parameter"
        return super().unsupported()

    def prompts(self) -> List[Union[str, List[int]]]:
        """One prompt per choice: a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class FunctionCallIn(_Request):
    name: Text
    arguments: Text                        # JSON text, as the API sends it


class ToolCallIn(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[Text, List[TextPart]]] = None
    name: Optional[Text] = None
    tool_calls: Optional[List[ToolCallIn]] = None          # assistant: the calls it made (content may be None)
    tool_call_id: Optional[Text] = None                    # tool: the call this is the result of
    reasoning_content: Optional[Text] = None               # assistant: its thinking (vLLM's field)

    def text(self) -> str:
        c = self.content
        return "" if c is None else c if isinstance(c, str) else "".join(p.text for p in c)

    def for_template(self) -> Dict[str, Any]:
        """The message as the chat template reads it (HF's dict shape; unset fields absent)."""
        out: Dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for k in ("tool_call_id", "reasoning_content"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


class FunctionDef(_Request):
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[JsonSchema] = None   # a JSON schema of the arguments (none: no arguments, {})
    strict: Optional[bool] = None             # always enforced under tool_choice required / named

    def for_template(self) -> Dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None and k != "strict"}


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[List[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    add_generation_prompt: bool = True            # vLLM's extension, rendered into the template as HF does
    continue_final_message: bool = False          # SGLang/vLLM extensions sglang-router sends (identity values only)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    tools: Optional[Annotated[List[Tool], Field(max_length=128)]] = None
    tool_choice: Optional[ToolChoice] = None          # None: auto with tools, none without (OpenAI's default)
    parallel_tool_calls: Optional[bool] = None        # false: at most one call (exactly one under required/named)
    chat_template_kwargs: Optional[Dict[str, Any]] = None   # vLLM's: extra template variables ({"thinking": false})

    def tool_dicts(self) -> Optional[List[Dict[str, Any]]]:
        """The tools as the template and the grammar builder read them (OpenAI's dict shape)."""
        if not self.tools:
            return None
        return [{"type": "function", "function": t.function.for_template()} for t in self.tools]

    def choice(self) -> Any:
        """tool_choice as plain data: a string or {"type": "function", "function": {"name"}}."""
        c = self.tool_choice
        return c.model_dump() if isinstance(c, BaseModel) else c

    def unsupported(self) -> Optional[tuple]:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_tokens", "give max_completion_tokens or max_tokens, not both"
        return super().unsupported()

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses -------------------------------------------------------------------------------------------
class ErrorBody(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Response):
    error: ErrorBody


class PromptTokensDetails(_Response):
    cached_tokens: int = 0              # prompt tokens served from the prefix cache (OpenAI's field)


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0           # completion tokens of the reasoning (thinking) part


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    completion_tokens_details: Optional[CompletionTokensDetails] = None   # only with a reasoning parser's split


class KdtreeStats(_Response):
    target_forwards: int
    mean_acceptance_length: float
    seconds: float
    seed: Optional[int] = None          # the request's sampling seed (given or drawn): replay with "seed": this


class CompletionLogprobs(_Response):
    tokens: List[str]
    token_logprobs: List[Optional[float]]
    top_logprobs: List[Optional[Dict[str, float]]]
    text_offset: List[int]


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob]


class ChatLogprobs(_Response):
    content: Optional[List[ChatTokenLogprob]] = None


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None
    kdtree: Optional[KdtreeStats] = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    # absent (not null) unless the output had them: a response without tools reads as it always did
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReason


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChatChoice]
    usage: Usage
    kdtree: Optional[KdtreeStats] = None


class DeltaFunctionCall(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Response):
    index: int
    id: Optional[str] = None             # the first delta of a call: id, type, function.name (arguments "")
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Response):
    """A streamed chunk's delta (the SSE writer sends only the fields a chunk has)."""
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[DeltaToolCall]] = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kdtree"
    max_model_len: int
    root: str


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: List[ModelCard]


# the fields added with tools and reasoning: absent when None (a response without them reads as it always did)
OMIT_NONE = frozenset(("reasoning_content", "tool_calls", "completion_tokens_details"))


def _omit(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _omit(v) for k, v in obj.items() if not (v is None and k in OMIT_NONE)}
    if isinstance(obj, list):
        return [_omit(v) for v in obj]
    return obj


def dump(model: BaseModel) -> Dict[str, Any]:
    """The JSON-ready dict of a response model (None fields kept: OpenAI sends `logprobs: null`; but OMIT_NONE's)."""
    return _omit(model.model_dump(mode="json"))
