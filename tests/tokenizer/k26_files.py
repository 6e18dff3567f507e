"""A synthetic Kimi K2.6 tokenizer checkpoint, written by the tests (nothing downloaded).

    ckpt = write_k26_tokenizer(tmp_path)      # tiktoken.model + tokenizer_config.json
    tok = k26_tokenizer(ckpt)                 # kdtree's load_tokenizer on conf/model/k26.yaml

tiktoken.model: the 256 bytes, a few merges, then filler ranks up to 163584 (4-byte tokens starting 0xFF, which no
UTF-8 text contains, so no text encodes to them): the vocabulary is the checkpoint's size, 163840, and the special
tokens sit at the checkpoint's ids.

K26_SPECIALS: names and ids as the public checkpoints' tokenizer_config.json `added_tokens_decoder` declares them
(Kimi-K2-Instruct / K2-Thinking / K2.5 / K2.6 share the table; the K2.6 card says its tokenizer_config.json is
byte-identical to K2.5's). Cross-checked against several independent copies of that table in public code
(tokenizer converters, serving tests, a JS tiktoken port: 163584 [BOS] ... 163601 <|im_middle|>, 163602-163605 the
media tokens, 163606/163607 <think>/</think>, 163838 [UNK], 163839 [PAD]); the ids in between are reserved.

K26_CHAT_TEMPLATE: K2-Thinking's chat_template.jinja as published in its pieces (the render_content / set_roles /
render_toolcalls macros, the history/suffix split at the last assistant message without tool calls, whose earlier
turns get an empty `<think></think>` and the suffix's assistant turns `<think>{reasoning_content}</think>`, the
`tool_declare` system turn with compact JSON, the default system prompt, `## Return of {tool_call_id}` tool
results), plus K2.5/K2.6's documented switches: `thinking=false` (instant mode: `<think></think>` after the
generation prompt and in the suffix, else the prompt ends with an open `<think>`) and `preserve_thinking=true`
(K2.6: every assistant turn keeps its reasoning). The full upstream file was not in the stored corpus verbatim, so
this is a reconstruction of it -- the reference for every byte of kdtree's rendering is transformers'
apply_chat_template on this same text.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from kdtree.tokenizer import load_tokenizer
from tests.checkpoint.configs import model_cfg

N_BASE = 163584                 # mergeable ranks; the 256 special ids follow
VOCAB = 163840

K26_SPECIALS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
# what the chat template writes and K2's tool-call / reasoning parsers read
MARKERS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
           "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>")

MERGES = (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ion", b"func", b"tions", b"functions",
          b"\"}", b"{\"", b"\":", "é".encode(), "中文".encode(), b"123")

K26_CHAT_TEMPLATE = r"""{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for content in c -%}
        {% if content['type'] == 'image' or content['type'] == 'image_url' -%}
          <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
        {% else -%}
          {{ content['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{% macro set_roles(message) -%}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}

{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- set formatted_id = tool_call['id'] -%}
    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}

{# Find last non-tool-call assisitant message #}
{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}
{%- if not (preserve_thinking is defined and preserve_thinking) -%}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
        {%- set ns.last_non_tool_call_assistant_msg = idx -%}
        {%- break -%}
    {%- endif -%}
{%- endfor -%}
{%- endif -%}

{# split all messages into history & suffix, reasoning_content in suffix should be reserved.#}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}

{%- if tools -%}
  {%- if tools_ts_str is defined and tools_ts_str -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools_ts_str }}<|im_end|>
  {%- else -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
  {%- endif -%}
{%- endif -%}

{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}

{%- for message in hist_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{render_content(message)}}
    {%- if message.get('tool_calls') -%}
      {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- for message in suffix_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    {%- if thinking is defined and thinking is false -%}
    <think></think>{{render_content(message)}}
    {%- else -%}
    {%- set rc = message.get('reasoning_content', '') -%}
    <think>{{rc}}</think>{{render_content(message)}}
    {%- endif -%}
    {%- if message.get('tool_calls') -%}
     {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}


{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}
    <think></think>
  {%- else -%}
    <think>
  {%- endif -%}
{%- endif -%}"""


def _ranks():
    tokens = [bytes([i]) for i in range(256)] + list(MERGES)
    tokens += [b"\xff" + i.to_bytes(3, "big") for i in range(N_BASE - len(tokens))]
    return tokens


def tokenizer_config():
    added = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for name, i in K26_SPECIALS.items()}
    return {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]",
            "pad_token": "[PAD]", "chat_template": K26_CHAT_TEMPLATE, "tokenizer_class": "TikTokenTokenizer",
            "model_max_length": 262144}


def write_k26_tokenizer(directory) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                              for i, t in enumerate(_ranks())))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    return d


def k26_tokenizer(directory):
    return load_tokenizer(model_cfg("k26"), directory)
