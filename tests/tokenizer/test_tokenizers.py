"""Tokenizers round-trip text (non-ASCII too), drop special ids on decode, and load from the model config."""
from __future__ import annotations

import base64
import json

import pytest

from kdtree.errors import CheckpointError, ConfigError
from kdtree.tokenizer import ByteTokenizer, TiktokenTokenizer, load_tokenizer
from tests.checkpoint.configs import model_cfg

TEXTS = ["2+2=", "hello world, it's me", "café naïve — ünïcödé", "中文和日本語のテキスト", "emoji 🙂🚀\n\ttabs  ", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode(tok.encode(text, bos=True) + [257, 259]) == text


def test_byte_decode_of_a_broken_sequence_replaces():
    tok = ByteTokenizer()
    assert tok.decode(list("é".encode())[:1] + [ord("a")]) == "\ufffda"
    assert tok.vocab_size == 260 and tok.token_bytes(258) == b""


MERGES = (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", "é".encode(), "中文".encode(), b"34", b"12", b"123")


def write_bpe(path, merges=MERGES):
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return len(tokens)


@pytest.fixture
def bpe(tmp_path):
    n = write_bpe(tmp_path / "tiktoken.model")
    return TiktokenTokenizer.from_file(tmp_path / "tiktoken.model", {"[BOS]": n, "[EOS]": n + 1}, bos=n, eos=n + 1), n


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_round_trip(bpe, text):
    tok, _ = bpe
    assert tok.decode(tok.encode(text)) == text


def test_tiktoken_uses_the_merges_and_kimi_pretokenizer(bpe):
    tok, n = bpe
    assert tok.encode("hello world") == [259, 262, 108, 100]          # "hello", " wor", "l", "d"
    assert tok.encode("中文") == [264]                                   # a Han run kept whole, then merged
    assert tok.encode("1234") == [267, 52]    # digits pre-split in threes: "123"+"4", never the "34" merge
    assert tok.vocab_size == n + 256


def test_tiktoken_special_tokens(bpe):
    tok, n = bpe
    assert tok.encode("[EOS]") == list(b"[EOS]")                        # plain text unless allowed
    assert tok.encode("[EOS]", allow_special=True) == [n + 1]
    assert tok.encode("hi", bos=True)[0] == n
    assert tok.decode([n] + tok.encode("hi") + [n + 1, n + 7]) == "hi"  # specials (named or reserved) dropped
    assert tok.special_tokens[f"<|reserved_token_{n + 7}|>"] == n + 7


def test_corrupt_tiktoken_file_names_the_line(tmp_path):
    f = tmp_path / "tiktoken.model"
    f.write_text("YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(CheckpointError, match=r"tiktoken.model:2"):
        TiktokenTokenizer.from_file(f)


def test_load_tokenizer_from_model_config(tmp_path):
    assert isinstance(load_tokenizer(model_cfg("tiny"), tmp_path), ByteTokenizer)
    cfg = model_cfg("tiny")
    n = write_bpe(tmp_path / "tiktoken.model")
    cfg.tokenizer, cfg.vocab_size = "tiktoken", n + 256
    cfg.bos_token_id, cfg.eos_token_id, cfg.mask_token_id, cfg.pad_token_id = n, n + 1, n + 254, n + 255
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"}}}))
    tok = load_tokenizer(cfg, tmp_path)
    assert tok.special_tokens["[EOS]"] == n + 1 and tok.eos_id == n + 1 and tok.mask_id == n + 254
    assert tok.decode(tok.encode("héllo") + [n + 1]) == "héllo"
    cfg.vocab_size = n + 10
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_tokenizer(cfg, tmp_path)
    cfg.tokenizer = "sentencepiece"
    with pytest.raises(ConfigError, match="model.tokenizer='sentencepiece'"):
        load_tokenizer(cfg, tmp_path)
    cfg.tokenizer = "tiktoken"
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(cfg, tmp_path / "elsewhere")
