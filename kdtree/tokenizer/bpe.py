"""Kimi's tiktoken tokenizer: `tiktoken.model` (one `base64(token bytes) rank` per line) + special tokens.

The pre-tokenizer regex is Kimi K2's (`tokenization_kimi.py`): Han runs, cased word pieces with
English contractions, 1-3 digit numbers, punctuation runs, newlines, spaces. Special tokens occupy the
ids after the mergeable ranks; unnamed ones are `<|reserved_token_{id}|>` like Kimi's.

Specials in and out: `encode(text, allow_special=True)` maps a special's text (`<|im_end|>`, `<think>`) to its one
id (the chat template's output is encoded so, see kdtree/serve/chat_template.py for user text that names one);
`decode(ids)` / `token_bytes(id)` drop specials unless `skip_special_tokens=False`, which gives their exact text
(what K2's tool-call and reasoning parsers read), as HF's `decode(..., skip_special_tokens=False)` does.
"""
from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import tiktoken

from kdtree.errors import CheckpointError

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256


def read_tiktoken_model(path) -> Dict[bytes, int]:
    """`tiktoken.model` -> {token bytes: rank}; a bad line is a CheckpointError naming file and line."""
    path = Path(path)
    ranks: Dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: tokenizer file does not exist; copy the checkpoint's tiktoken.model "
                              f"next to config.json or set model.tokenizer=byte") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path}:{n}: expected 'base64-token rank', got {line[:60]!r}; "
                                  f"the tiktoken.model file is corrupt") from None
    return ranks


class TiktokenTokenizer:
    """tiktoken.Encoding over Kimi's file format and regex; special ids are dropped on decode unless asked to keep."""

    def __init__(self, encoding: tiktoken.Encoding, special_tokens: Dict[str, int], bos: Optional[int] = None,
                 eos: Optional[int] = None, mask: Optional[int] = None, pad: Optional[int] = None):
        self.enc = encoding
        self.special_tokens = dict(special_tokens)
        self.special_ids = frozenset(self.special_tokens.values())
        self._special_bytes = {i: name.encode("utf-8") for name, i in self.special_tokens.items()}
        self.bos_id, self.eos_id, self.mask_id, self.pad_id = bos, eos, mask, pad
        self.vocab_size = encoding.n_vocab

    @classmethod
    def from_file(cls, path, special_tokens: Optional[Dict[str, int]] = None,
                  num_reserved: int = NUM_RESERVED_SPECIAL, **ids) -> "TiktokenTokenizer":
        """path: Kimi's tiktoken.model; special_tokens: name -> id (ids after the ranks; gaps are filled
        with `<|reserved_token_{id}|>` up to num_reserved specials); ids: bos=, eos=, mask=, pad=."""
        ranks = read_tiktoken_model(path)
        n_base = len(ranks)
        named = dict(special_tokens or {})
        by_id = {i: name for name, i in named.items()}
        top = max([n_base + num_reserved - 1] + list(by_id))
        specials = {by_id.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, top + 1)}
        enc = tiktoken.Encoding(name=Path(path).name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                special_tokens=specials)
        return cls(enc, specials, **ids)

    def encode(self, text: str, bos: bool = False, allow_special: bool = False) -> List[int]:
        """allow_special: text like `<|im_end|>` becomes its special id (else it is encoded as plain text)."""
        ids = self.enc.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        return [self.bos_id] + ids if bos and self.bos_id is not None else ids

    def token_bytes(self, token: int, skip_special_tokens: bool = True) -> bytes:
        """One token's bytes; a special is b"" (skipped) or its name's UTF-8 (`<|tool_call_begin|>`), whole."""
        if token in self.special_ids:
            return b"" if skip_special_tokens else self._special_bytes[token]
        return self.enc.decode_single_token_bytes(token)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            kept = [t for t in ids if t not in self.special_ids]
            return self.enc.decode_bytes(kept).decode("utf-8", errors="replace")
        return b"".join(self.token_bytes(t, False) for t in ids).decode("utf-8", errors="replace")
