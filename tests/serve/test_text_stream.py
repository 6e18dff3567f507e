"""TextStream (the SSE text of one streamed choice) and the streamed job queue, without a server: for any
split of the tokens into commits, the pieces concatenate to the non-streamed text, never split a UTF-8
character, and hold back only what could still be the start of a stop string."""
from __future__ import annotations

import queue
import random

from kdtree.serve.text_stream import TextStream, cut_at_stop
from kdtree.decode.request import Request, RequestCancelled
from kdtree.tokenizer.byte import ByteTokenizer

TOK = ByteTokenizer()


def stream(text_or_ids, stops, sizes=None, rng=None):
    ids = TOK.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    ts, pieces, i = TextStream(TOK, stops), [], 0
    while i < len(ids) and not ts.stopped:
        n = sizes.pop(0) if sizes else (rng.randint(1, 5) if rng else 1)
        pieces.append(ts.push(ids[i:i + n]))
        i += n
    pieces.append(ts.finish())
    return pieces, ts


def test_pieces_concatenate_to_the_cut_text_for_any_commit_sizes():
    rng = random.Random(0)
    texts = ["Hello wörld, 你好 🙂 end", "abcabcabd", "xx<|stop|>yy", "aaaa", "no stop here", "🙂🙂🙂"]
    stop_sets = [[], ["d"], ["abd"], ["bc", "abcabd"], ["<|stop|>"], ["aaa", "aa"], ["🙂"], ["wörld", "好 "],
                 ["cab", "abca"], ["zz"]]
    for text in texts:
        for stops in stop_sets:
            want, stopped = cut_at_stop(TOK.decode(TOK.encode(text)), stops)
            for trial in range(20):
                pieces, ts = stream(text, stops, rng=rng if trial else None)
                assert "".join(pieces) == want, (text, stops, pieces)
                assert ts.stopped == stopped
                assert all("\ufffd" not in p for p in pieces), pieces      # no character split in two


def test_random_bytes_with_invalid_utf8_match_the_final_decode():
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.choice([0x61, 0x62, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x99, 0x82, 0xFF, 257])
               for _ in range(rng.randint(0, 30))]
        stops = rng.choice([[], ["a"], ["ab", "é"], ["\u4f60a"], ["ba"]])
        want, _ = cut_at_stop(TOK.decode(ids), stops)
        pieces, _ = stream(ids, stops, rng=rng)
        assert "".join(pieces) == want, (ids, stops, pieces)


def test_held_back_only_while_a_stop_string_could_still_start():
    ts = TextStream(TOK, ["STOP"])
    assert ts.push(TOK.encode("abc S")) == "abc "          # "S" could start "STOP"
    assert ts.push(TOK.encode("T")) == ""
    assert ts.push(TOK.encode("x")) == "STx"               # no longer a stop: released at once
    assert ts.push(TOK.encode("ST")) == ""
    assert ts.push(TOK.encode("OP and more")) == "" and ts.stopped
    assert ts.finish() == ""
    ts = TextStream(TOK, [])
    assert ts.push([0xE4, 0xBD]) == ""                     # 2 of the 3 bytes of 你
    assert ts.push([0xA0, 0x21]) == "你!"
    # the earliest-starting stop string wins, as in the non-streamed cut, even when a later one completes first
    ts = TextStream(TOK, ["abcd", "bc"])
    assert ts.push(TOK.encode("xabc")) == "x" and not ts.stopped
    assert ts.push(TOK.encode("d")) == "" and ts.stopped


def test_worker_streams_commits_before_the_request_ends_and_cancels(compose_cfg):
    from kdtree.engine import Engine
    from kdtree.serve.batch_worker import BatchWorker

    engine = Engine.from_config(compose_cfg("backend=numpy", "tree=ddtree", "tree.budget=4", "load.progress=false"))
    w = BatchWorker(engine, 4)
    ids = engine.tokenizer.encode("def __init__(self, ")
    solo = engine.generate(ids, 40).tokens

    def streamed(n):
        q = queue.Queue()
        req = Request(ids, n, on_tokens=lambda t: q.put(list(t)), notify=lambda r: q.put(None))
        return w.submit(req), q

    req, q = streamed(40)
    commits = list(iter(q.get, None))
    assert len(commits) > 1 and sum(commits, []) == req.result.tokens == solo     # streamed commit by commit
    req, q = streamed(1500)
    assert q.get() and not req.done.is_set()               # the first tokens arrive while it generates
    req.cancel()
    assert req.wait(10) and isinstance(req.error, RequestCancelled)
    plain = w.submit(Request(ids, 40))                     # not streamed: no callback, same result
    assert plain.wait(30) and plain.result.tokens == solo
    assert w.drain(10)


class _Counting(ByteTokenizer):
    """The byte tokenizer, counting the tokens its decode() is given (a whole-text decode per commit shows)."""
    decoded = 0

    def decode(self, ids):
        ids = list(ids)
        self.decoded += len(ids)
        return super().decode(ids)


class _DecodeOnly:
    """A tokenizer with decode() only (no token_bytes): TextStream decodes the whole text at each push."""

    def decode(self, ids):
        return TOK.decode(ids)


def test_incremental_decode_equals_the_whole_decode_and_stays_linear():
    """Byte-level tokenizers grow the text through an incremental UTF-8 decoder: for random bytes (invalid ones
    too) split at random commits, the pieces equal the decode-everything path's, and a push decodes only its
    own tokens (a 20000-token stream never decodes the whole text again)."""
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.choice([0x61, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x99, 0x82, 0xFF, 0x80, 257])
               for _ in range(rng.randint(0, 40))]
        stops = rng.choice([[], ["a"], ["é"], ["\ufffda"]])
        cuts, i = [], 0
        while i < len(ids):
            cuts.append(rng.randint(1, 4))
            i += cuts[-1]
        outs = []
        for tok in (TOK, _DecodeOnly()):
            ts, pieces, i = TextStream(tok, stops), [], 0
            for n in cuts:
                pieces.append(ts.push(ids[i:i + n]))
                i += n
            pieces.append(ts.finish())
            outs.append("".join(pieces))
        assert outs[0] == outs[1] == cut_at_stop(TOK.decode(ids), stops)[0], (ids, stops)

    counting = _Counting()
    ts = TextStream(counting, ["STOP"])
    text = "".join(ts.push(TOK.encode("ab")) for _ in range(10000)) + ts.finish()
    assert text == "ab" * 10000 and counting.decoded == 0


def test_stop_string_check_sees_only_new_text_and_keeps_the_same_tokens():
    """The engine-side stop check after each commit: the same `keep` as decoding everything each time (random
    bytes with invalid UTF-8, stops across commit boundaries, multi-byte stops), and a long stream never decodes
    its whole text again."""
    from kdtree.serve.batch_worker import stop_string_check

    def reference(stops):
        def check(tokens):
            if not any(s in TOK.decode(tokens) for s in stops):
                return None
            return next(k for k in range(1, len(tokens) + 1) if any(s in TOK.decode(tokens[:k]) for s in stops))
        return check

    rng = random.Random(3)
    alphabet = [0x61, 0x62, 0x63, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xFF, 257]
    for _ in range(400):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 60))]
        stops = rng.choice([["abc"], ["é"], ["ca", "bb"], ["\u4f60b"], ["\ufffda"], ["cab" * 3]])
        fast, ref, n, got = stop_string_check(TOK, stops), reference(stops), 0, [None, None]
        while n < len(ids) and got == [None, None]:
            n = min(len(ids), n + rng.randint(1, 5))
            got = [fast(ids[:n]), ref(ids[:n])]
        assert got[0] == got[1], (ids, stops, n, got)

    counting = _Counting()
    check, tokens = stop_string_check(counting, ["STOP"]), []
    for _ in range(5000):
        tokens += TOK.encode("ab")
        assert check(tokens) is None
    assert counting.decoded < 200_000                       # ~38 per commit, not the 25M of whole-text decodes
    tokens += TOK.encode("xSTOPyy")
    assert check(tokens) == 10000 + 5
