"""Byte-level tokenizer of the tiny model: token i < 256 is byte i; bos/eos/mask/pad follow."""
from __future__ import annotations

from typing import Iterable, List


class ByteTokenizer:
    """utf-8 bytes as tokens; special ids are dropped on decode, invalid utf-8 decodes to U+FFFD."""

    def __init__(self, bos: int = 256, eos: int = 257, mask: int = 258, pad: int = 259):
        self.bos_id, self.eos_id, self.mask_id, self.pad_id = int(bos), int(eos), int(mask), int(pad)
        self.special_ids = frozenset((self.bos_id, self.eos_id, self.mask_id, self.pad_id))
        if min(self.special_ids) < 256 or len(self.special_ids) != 4:
            raise ValueError(f"ByteTokenizer special ids {sorted(self.special_ids)} must be 4 distinct ids >= 256")
        self.vocab_size = max(self.special_ids) + 1

    def encode(self, text: str, bos: bool = False) -> List[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id] + ids if bos else ids

    def token_bytes(self, token: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes of one token (b"" for specials, which have no text here, kept or not): for streaming decoders
        that join bytes themselves."""
        return bytes([token]) if 0 <= token < 256 else b""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")
