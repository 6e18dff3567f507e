"""TextStream (the SSE text of one streamed choice) and the streamed job queue, without a server: for any
split of the tokens into commits, the pieces concatenate to the non-streamed text, never split a UTF-8
character, and hold back only what could still be the start of a stop string."""
from __future__ import annotations

import queue
import random
import threading

from kdtree.decode.result import GenerationResult
from kdtree.serve.text_stream import TextStream, cut_at_stop
from kdtree.serve.request_queue import Cancelled, EngineWorker, Job
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


class FakeEngine:
    """engine.generate's contract: on_tokens per commit, then the result."""

    def __init__(self):
        self.release = threading.Event()

    def generate(self, prompt_ids, max_new_tokens, stop_ids=(), on_tokens=None):
        out = []
        for k in range(max_new_tokens):
            if k == 2:
                self.release.wait(10)
            out.append(k)
            if on_tokens is not None:
                on_tokens([k])
        return GenerationResult(tokens=out)


def test_worker_streams_commits_before_the_job_ends_and_cancels():
    eng = FakeEngine()
    w = EngineWorker(eng, 4)
    job = w.submit(Job([1], 5, stream=queue.Queue()))
    got = []
    for batch in iter(job.stream.get, None):
        got.extend(batch)
        if got == [0, 1]:
            assert not job.done.is_set()                   # the first tokens arrived while generating
            eng.release.set()
    assert got == [0, 1, 2, 3, 4] and job.result.tokens == got
    eng.release.clear()
    job = w.submit(Job([1], 5, stream=queue.Queue()))
    assert job.stream.get() == [0]
    job.cancel()
    eng.release.set()
    job.wait(10)
    assert isinstance(job.error, Cancelled) and job.result is None
    plain = w.submit(Job([1], 3))                          # not streamed: no callback, same result
    plain.wait(10)
    assert plain.result.tokens == [0, 1, 2]
    assert w.drain(10)
