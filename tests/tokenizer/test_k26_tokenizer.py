"""k26's tokenizer on a synthetic checkpoint with K2.6's special-token table: every marker is one special id in and
out (decoded back to its exact text when specials are kept), and streaming never splits a marker."""
from __future__ import annotations

import random

import pytest

from kdtree.serve.text_stream import TextStream, cut_at_stop
from tests.tokenizer.k26_files import K26_SPECIALS, MARKERS, VOCAB, k26_tokenizer, write_k26_tokenizer

# what K2.6 answers in thinking mode with two parallel tool calls (the prompt ended with `<think>`)
OUTPUT = ("Paris and Rome: two calls, one each.</think>Checking both.<|tool_calls_section_begin|>"
          "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
          "<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
          "{\"city\": \"Rome\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
MIXED = "<think>é中文 hello</think>中<|im_end|>\n\n<|tool_call_begin|>functions.x:0<|tool_call_argument_begin|>{}"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return k26_tokenizer(write_k26_tokenizer(tmp_path_factory.mktemp("k26tok")))


def test_special_ids_and_vocabulary_are_the_checkpoints(tok):
    assert tok.vocab_size == VOCAB
    for name, i in K26_SPECIALS.items():
        assert tok.special_tokens[name] == i, name
    assert tok.special_tokens["<|reserved_token_163589|>"] == 163589          # the gaps are reserved ids
    assert (tok.bos_id, tok.eos_id, tok.mask_id, tok.pad_id) == (163584, 163585, 163838, 163839)


@pytest.mark.parametrize("name", sorted(K26_SPECIALS))
def test_each_special_is_one_id_in_and_its_exact_text_out(tok, name):
    i = K26_SPECIALS[name]
    assert tok.encode(name, allow_special=True) == [i]
    assert tok.decode([i], skip_special_tokens=False) == name
    assert tok.token_bytes(i, skip_special_tokens=False) == name.encode()
    assert tok.decode([i]) == "" and tok.token_bytes(i) == b""             # skipped by default, as before
    plain = tok.encode(name)                                                  # not allowed: ordinary text
    assert i not in plain and len(plain) > 1 and tok.decode(plain) == name


@pytest.mark.parametrize("text", [OUTPUT, MIXED])
def test_text_with_markers_round_trips_with_one_id_per_marker(tok, text):
    ids = tok.encode(text, allow_special=True)
    for m in MARKERS:
        assert ids.count(K26_SPECIALS[m]) == text.count(m), m
    assert tok.decode(ids, skip_special_tokens=False) == text
    stripped = text
    for m in MARKERS:
        stripped = stripped.replace(m, "")
    assert tok.decode(ids) == stripped


def _marker_spans(text):
    spans = []
    for m in MARKERS:
        start = text.find(m)
        while start >= 0:
            spans.append((start, start + len(m)))
            start = text.find(m, start + 1)
    return spans


def _stream(tok, ids, stops, sizes):
    ts, pieces, i = TextStream(tok, stops, skip_special_tokens=False), [], 0
    for n in sizes:
        if i >= len(ids) or ts.stopped:
            break
        pieces.append(ts.push(ids[i:i + n]))
        i += n
    pieces.append(ts.finish())
    return pieces


@pytest.mark.parametrize("text", [OUTPUT, MIXED])
def test_streaming_one_id_at_a_time_yields_each_marker_whole(tok, text):
    ids = tok.encode(text, allow_special=True)
    pieces = _stream(tok, ids, [], [1] * len(ids))
    assert "".join(pieces) == text
    for t, piece in zip(ids, pieces):
        if t in tok.special_ids:
            assert piece == tok.decode([t], skip_special_tokens=False)      # the marker, whole, in one piece


@pytest.mark.parametrize("text", [OUTPUT, MIXED])
def test_no_piece_ends_inside_a_marker_even_when_a_stop_string_holds_text_back(tok, text):
    """Stop strings that a marker's tail could start (`|>` + more) hold text back; the hold starts at the marker,
    never inside it, and the pieces still join to the non-streamed text."""
    ids = tok.encode(text, allow_special=True)
    rng = random.Random(0)
    spans = _marker_spans(text)
    for stops in ([], ["|>x"], ["_end|>!", "begin|>{\"z"], ["k>Z"], ["}<|tool_call_end|>X"]):
        for trial in range(30):
            sizes = [1 if trial == 0 else rng.randint(1, 4) for _ in range(len(ids))]
            pieces = _stream(tok, ids, stops, sizes)
            assert "".join(pieces) == cut_at_stop(text, stops)[0], (stops, pieces)
            cuts, at = [], 0
            for p in pieces:
                at += len(p)
                cuts.append(at)
            assert not any(s < c < e for c in cuts for s, e in spans), (stops, pieces)


def test_stream_skipping_specials_is_unchanged(tok):
    ids = tok.encode(OUTPUT, allow_special=True)
    ts = TextStream(tok, [])                                   # the default: specials dropped, as before
    assert "".join(ts.push([t]) for t in ids) + ts.finish() == tok.decode(ids) == (
        "Paris and Rome: two calls, one each.Checking both.functions.get_weather:0{\"city\": \"Paris\"}"
        "functions.get_weather:1{\"city\": \"Rome\"}")
