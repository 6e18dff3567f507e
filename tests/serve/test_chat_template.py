"""Chat templates rendered as HF transformers renders them: from the checkpoint's tokenizer_config.json (or
chat_template.jinja), sandboxed, with the special tokens, add_generation_prompt and raise_exception."""
from __future__ import annotations

import json

import pytest

from kdtree.serve.chat_template import ChatTemplate, ChatTemplateError

# The shape of Kimi K2's template (role markers are special tokens; a system prompt is added when none is given)
KIMI_LIKE = (
    "{%- if messages[0]['role'] != 'system' -%}<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}{{ raise_exception('tool messages need tool_call_id') }}{%- endif -%}"
    "<|im_{{ 'user' if message['role'] == 'user' else message['role'] }}|>{{ message['role'] }}<|im_middle|>"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def _checkpoint(tmp_path, **config):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_template_from_tokenizer_config_with_special_tokens_and_generation_prompt(tmp_path):
    ckpt = _checkpoint(tmp_path, chat_template="{{ bos_token }}" + KIMI_LIKE,
                       bos_token={"content": "[BOS]", "lstrip": False}, eos_token="[EOS]")
    tpl = ChatTemplate.for_checkpoint(ckpt, "k26")
    msgs = [{"role": "user", "content": "2+2="}]
    assert tpl.render(msgs) == ("[BOS]<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
                                "<|im_user|>user<|im_middle|>2+2=<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert not tpl.render(msgs, add_generation_prompt=False).endswith("<|im_middle|>")
    with pytest.raises(ChatTemplateError, match="tool messages need tool_call_id"):
        tpl.render([{"role": "tool", "content": "x"}])


def test_named_templates_jinja_file_and_the_tiny_fallback(tmp_path):
    ckpt = _checkpoint(tmp_path, chat_template=[{"name": "tool_use", "template": "TOOLS"},
                                                {"name": "default", "template": "DEFAULT {{ messages|length }}"}])
    assert ChatTemplate.for_checkpoint(ckpt).render([{"role": "user", "content": "x"}]) == "DEFAULT 1"
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    assert ChatTemplate.for_checkpoint(ckpt).render([{"role": "user", "content": "x"}]) == "FILE x"
    tiny = ChatTemplate.for_checkpoint(tmp_path / "nothing-here", "tiny")
    assert tiny.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.stops == ["<|im_end|>"]
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.for_checkpoint(tmp_path / "nothing-here", "k26")


def test_template_is_sandboxed(tmp_path):
    ckpt = _checkpoint(tmp_path, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.for_checkpoint(ckpt).render([{"role": "user", "content": "x"}])
