"""Tokenizers: byte-level (tiny) and Kimi's tiktoken (k26), chosen by model.tokenizer.

    tok = load_tokenizer(cfg.model, checkpoint_dir)      # .encode(text) -> ids, .decode(ids) -> text

model.tokenizer: `byte`, `tiktoken` (`<checkpoint>/tiktoken.model`, special names from the checkpoint's
tokenizer_config.json when present), or a path to a tiktoken.model file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

from kdtree.errors import CheckpointError, ConfigError
from kdtree.tokenizer.bpe import KIMI_PAT_STR, TiktokenTokenizer, read_tiktoken_model
from kdtree.tokenizer.byte import ByteTokenizer

__all__ = ["ByteTokenizer", "TiktokenTokenizer", "KIMI_PAT_STR", "read_tiktoken_model", "load_tokenizer"]


def _special_names(checkpoint_dir: Path) -> Dict[str, int]:
    """name -> id from tokenizer_config.json's added_tokens_decoder ({} when absent)."""
    f = checkpoint_dir / "tokenizer_config.json"
    if not f.exists():
        return {}
    try:
        added = json.loads(f.read_text()).get("added_tokens_decoder") or {}
        return {v["content"]: int(k) for k, v in added.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{f}: cannot read added_tokens_decoder ({e!r}); fix or remove the file") from None


def load_tokenizer(model_cfg, checkpoint_dir):
    kind = str(model_cfg.tokenizer)
    ids = dict(bos=int(model_cfg.bos_token_id), eos=int(model_cfg.eos_token_id),
               mask=int(model_cfg.mask_token_id), pad=int(model_cfg.pad_token_id))
    if kind == "byte":
        return ByteTokenizer(**ids)
    ckpt = Path(checkpoint_dir) if checkpoint_dir else Path(".")
    if kind == "tiktoken":
        path = ckpt / "tiktoken.model"
    elif kind.endswith(".model") or "/" in kind:
        path = Path(kind).expanduser()
    else:
        raise ConfigError(f"model.tokenizer={kind!r} is unknown; use byte, tiktoken, or a path to tiktoken.model")
    tok = TiktokenTokenizer.from_file(path, _special_names(ckpt), **ids)
    vocab = int(model_cfg.vocab_size)
    if tok.vocab_size > vocab:
        raise CheckpointError(f"{path}: tokenizer has {tok.vocab_size} ids but model.vocab_size={vocab}; use the "
                              f"tokenizer shipped with this checkpoint")
    return tok
