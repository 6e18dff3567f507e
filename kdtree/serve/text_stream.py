"""Stop strings and live text: what a streamed choice sends, equal in the end to the non-streamed text.

    text, stopped = cut_at_stop(decode(tokens), stops)
    ts = TextStream(tokenizer, stops); ts.push(ids) -> final text so far; ts.finish() -> the rest
    TextStream(tokenizer, stops, skip_special_tokens=False): special tokens come out as their text (k26's
    `<|tool_call_begin|>`, `</think>`: what tool-call / reasoning parsers read), each one whole in one piece
"""
from __future__ import annotations

import codecs
from typing import List, Tuple


def cut_at_stop(text: str, stops: List[str]) -> Tuple[str, bool]:
    """Text up to (excluding) the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class TextStream:
    """The text of one streamed choice, piece by piece as tokens arrive, equal in the end to the non-streamed
    text (cut_at_stop(decode(tokens), stops)).

        ts = TextStream(tokenizer, stops)
        ts.push([ids...]) -> str      text that is final now ("" while it could still change)
        ts.finish()       -> str      the rest, once generation ended
        ts.stopped                    a stop string was reached: nothing more will be emitted

    Held back: a trailing incomplete UTF-8 character (decodes to U+FFFD until its bytes arrive), and a tail
    that could still be the start of a stop string. A stop string ends the text at its earliest start, as
    cut_at_stop does, once no earlier-starting stop string can still complete.

    skip_special_tokens=False keeps special tokens as their text (decode(ids, skip_special_tokens=False) in the
    end), and a piece never ends inside one: text held back for a stop string is held from the special's start.
    """

    def __init__(self, tokenizer, stops: List[str], skip_special_tokens: bool = True):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.skip_special_tokens = bool(skip_special_tokens)
        self._specials = frozenset() if skip_special_tokens else frozenset(getattr(tokenizer, "special_ids", ()))
        self._spans: List[Tuple[int, int]] = []     # [start, end) of kept specials' text not yet all emitted
        self.tokens: List[int] = []
        self.emitted = 0                  # characters of the text already returned (no stop starts before)
        self.stopped = False
        # byte-level tokenizers (both of kdtree's): the text grows by the new tokens' bytes through an incremental
        # UTF-8 decoder (it holds an incomplete character back; its output equals one decode of all the bytes),
        # so a push costs its own tokens, not the whole text again (that was quadratic in the output length)
        self._bytes_of = getattr(tokenizer, "token_bytes", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""

    def push(self, ids: List[int]) -> str:
        new = [int(t) for t in ids]
        self.tokens.extend(new)
        if self._bytes_of is not None and self.skip_special_tokens:
            self._text += self._utf8.decode(b"".join(self._bytes_of(t) for t in new))
        elif self._bytes_of is not None:         # one token at a time: where each kept special's text lies
            for t in new:
                raw = self._bytes_of(t, False)
                self._text += self._utf8.decode(raw)
                if t in self._specials and raw:     # its text ends the decoded piece (an incomplete character
                    n = len(raw.decode("utf-8", errors="replace"))           # before it came out as U+FFFD)
                    self._spans.append((len(self._text) - n, len(self._text)))
        return self._advance(final=False)

    def finish(self) -> str:
        if self._bytes_of is not None:
            self._text += self._utf8.decode(b"", final=True)
        return self._advance(final=True)

    def _decoded(self, final: bool) -> str:
        if self._bytes_of is not None:
            return self._text
        text = (self.tokenizer.decode(self.tokens) if self.skip_special_tokens      # any other tokenizer: decode
                else self.tokenizer.decode(self.tokens, skip_special_tokens=False))  # it all again
        return text if final else text.rstrip("\ufffd")   # maybe an incomplete multi-byte character: wait

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self._decoded(final)
        e = self.emitted
        cut = min((i for i in (text.find(s, e) for s in self.stops) if i >= 0), default=-1)
        pending = None                          # earliest start of a stop string that may still complete
        if not final and self.stops:
            longest = max(len(s) for s in self.stops)
            for i in range(max(e, len(text) - longest + 1), len(text)):
                tail = text[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                    pending = i
                    break
        if cut >= 0 and (pending is None or pending >= cut):
            self.stopped = True
            end = cut
        else:
            end = min(x for x in (len(text), cut if cut >= 0 else None, pending) if x is not None)
            end = self._not_inside_a_special(end)
        piece = text[e:end] if end > e else ""
        self.emitted = max(e, end)
        return piece

    def _not_inside_a_special(self, end: int) -> int:
        self._spans = [(s, t) for s, t in self._spans if t > self.emitted]
        return next((s for s, t in self._spans if s < end < t), end)
