"""Decoding with the latent cache: incremental == full recompute, exact batch invariance, tree visibility
(a chain equals causal; a node sees only its ancestors and equals the AR step on its path, bit for bit),
cache compaction with keep(), and the greedy AR loop's stopping rules and counters.

Run: .venv/bin/python -m pytest -q tests/model/test_decode.py
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree.tree import pack_visibility
from tests.decode.loops import generate_ar
from kdtree.errors import ConfigError

PROMPT = np.array([256, 50, 43, 50, 61], np.int32)   # "<bos>2+2="


def ancestors_mask(parents):
    """Block row i sees itself and its ancestors (parents[i] = parent block row, -1 = none)."""
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def prefill(m, tokens=PROMPT, max_len=128):
    cache = m.new_cache(max_len)
    logits, _ = m.forward(tokens, np.arange(len(tokens)), cache)
    return cache, logits


def test_incremental_decoding_equals_full_recompute(tiny_model):
    m = tiny_model
    res = generate_ar(m, PROMPT, 12)
    assert len(res.tokens) == 12 and res.finish_reason == "length"
    seq = np.concatenate([PROMPT, np.array(res.tokens[:-1], np.int32)])
    full, _ = m.forward(seq, np.arange(len(seq)), m.new_cache(64))
    assert full[len(PROMPT) - 1:].argmax(-1).tolist() == res.tokens
    # the step logits themselves, not only their argmax, are those of the full recompute
    cache, logits = prefill(m)
    steps = [logits[-1]]
    for i, tok in enumerate(res.tokens[:-1]):
        lg, _ = m.forward(np.array([tok]), np.array([len(PROMPT) + i]), cache)
        steps.append(lg[0])
    assert np.array_equal(np.stack(steps), full[len(PROMPT) - 1:])


def test_block_forward_is_bit_identical_to_one_row_forwards(tiny_cfg, tiny_model):
    m = tiny_model
    block = np.array([10, 200, 33, 33, 7, 259, 0], np.int32)
    pos = len(PROMPT) + np.arange(len(block))
    layers = tuple(range(tiny_cfg.num_hidden_layers))
    c1, _ = prefill(m)
    lg_block, hid_block = m.forward(block, pos, c1, hidden_layers=layers)
    c2, _ = prefill(m)
    rows = [m.forward(block[i:i + 1], pos[i:i + 1], c2, hidden_layers=layers) for i in range(len(block))]
    assert np.array_equal(lg_block, np.concatenate([r[0] for r in rows]))
    for layer in layers:
        assert np.array_equal(hid_block[layer], np.concatenate([r[1][layer] for r in rows]))
        assert np.array_equal(c1.kv[layer][:c1.length], c2.kv[layer][:c2.length])
    assert c1.length == c2.length == len(PROMPT) + len(block)


def test_chain_visibility_equals_causal_across_two_mask_words(tiny_model):
    m = tiny_model
    block = np.random.default_rng(0).integers(0, 256, 70).astype(np.int32)   # 70 rows: two u64 words per row
    pos = len(PROMPT) + np.arange(70)
    chain = pack_visibility(ancestors_mask(list(range(-1, 69))))
    assert chain.shape == (70, 2)
    c1, _ = prefill(m)
    c2, _ = prefill(m)
    causal, _ = m.forward(block, pos, c1)
    as_chain, _ = m.forward(block, pos, c2, visibility=chain)
    assert np.array_equal(causal, as_chain)
    assert np.array_equal(c1.kv[3][:c1.length], c2.kv[3][:c2.length])


# verify block: row 0 = root (the round's bonus token), rows 1.. = tree nodes
TREE_TOKENS = np.array([61, 52, 53, 10, 11, 12, 13], np.int32)
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 4]            # block row -> parent block row
TREE_DEPTHS = [0, 1, 1, 2, 2, 2, 3]


def verify_tree(m, tokens=TREE_TOKENS):
    cache, _ = prefill(m)
    start = cache.length
    vis = pack_visibility(ancestors_mask(TREE_PARENTS))
    logits, _ = m.forward(tokens, start + np.array(TREE_DEPTHS), cache, visibility=vis)
    return cache, logits


def path_of(row):
    path = []
    while row >= 0:
        path.append(row)
        row = TREE_PARENTS[row]
    return path[::-1]


def test_tree_node_equals_the_ar_step_on_its_path(tiny_model):
    """The lossless invariant: every node's logits are bit-identical to AR decoding of its ancestor path."""
    m = tiny_model
    _, tree_logits = verify_tree(m)
    for row in range(len(TREE_TOKENS)):
        cache, _ = prefill(m)
        for d, r in enumerate(path_of(row)):
            lg, _ = m.forward(TREE_TOKENS[r:r + 1], np.array([len(PROMPT) + d]), cache)
        assert np.array_equal(lg[0], tree_logits[row]), row


def test_changing_a_non_ancestor_leaves_a_node_unchanged(tiny_model):
    m = tiny_model
    _, base = verify_tree(m)
    changed = TREE_TOKENS.copy()
    changed[2] = 99                               # row 2 is an ancestor of row 5 only
    _, other = verify_tree(m, changed)
    for row in range(len(TREE_TOKENS)):
        if 2 in path_of(row):
            assert not np.allclose(base[row], other[row])
        else:
            assert np.array_equal(base[row], other[row]), row


def test_keep_compacts_the_accepted_path_and_decoding_continues_as_ar(tiny_model):
    m = tiny_model
    cache, _ = verify_tree(m)
    start = len(PROMPT)
    accepted = path_of(6)                         # rows 0, 1, 4, 6
    cache.keep(start, [start + r for r in accepted])
    assert cache.length == start + len(accepted)
    nxt, _ = m.forward(np.array([7]), np.array([cache.length]), cache)
    ar_cache, _ = prefill(m)
    for d, r in enumerate(accepted):
        m.forward(TREE_TOKENS[r:r + 1], np.array([start + d]), ar_cache)
    ref, _ = m.forward(np.array([7]), np.array([ar_cache.length]), ar_cache)
    assert np.array_equal(nxt, ref)
    for layer in range(len(cache.kv)):
        assert np.array_equal(cache.kv[layer][:cache.length], ar_cache.kv[layer][:ar_cache.length])
    cache.truncate(start)
    assert cache.length == start


def test_generate_ar_stops_at_eos_and_stop_ids(tiny_model):
    m = tiny_model
    free = generate_ar(m, PROMPT, 8)
    assert free.target_forwards == 8 and free.acceptance_lengths == [1] * 7
    assert free.stage_seconds["prefill"] > 0 and free.stage_seconds["verify"] > 0
    eos = free.tokens[3]
    first = free.tokens.index(eos)
    res = generate_ar(m, PROMPT, 8, eos_id=eos)
    assert res.tokens == free.tokens[:first] and res.finish_reason == "eos"
    assert res.target_forwards == first + 1
    res = generate_ar(m, PROMPT, 8, stop_ids=[free.tokens[2]])
    assert res.tokens == free.tokens[:free.tokens.index(free.tokens[2])] and res.finish_reason == "stop"
    assert generate_ar(m, PROMPT, 0).tokens == []


def test_cache_overflow_and_empty_prompt_are_one_line_errors(tiny_model):
    m = tiny_model
    cache = m.new_cache(6)
    with pytest.raises(ConfigError, match="cannot hold 0 \\+ 7"):
        m.forward(np.zeros(7, np.int32), np.arange(7), cache)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        m.new_cache(10 ** 6)
    with pytest.raises(ConfigError, match="prompt is empty"):
        generate_ar(m, [], 4)


def test_tree_module_packs_the_same_visibility():
    """kdtree.tree builds verify masks with node parents (-1 = root); it must equal ours."""
    from kdtree.tree import ancestor_visibility

    node_parents = np.array([p - 1 for p in TREE_PARENTS[1:]], np.int32)
    assert np.array_equal(ancestor_visibility(node_parents), pack_visibility(ancestors_mask(TREE_PARENTS)))


def test_int4_experts_keep_the_tree_bit_identical_to_ar(tiny_cfg, tiny_weights):
    from kdtree.backends import get_ops
    from kdtree.model.k2 import K2Model
    from kdtree.quant.int4 import Int4Weight, quantize_weight

    w = dict(tiny_weights)
    for name in [k for k in w if ".experts." in k and k.endswith("_proj.weight")]:
        packed, scale, shape = quantize_weight(w[name], 32, name)
        w[name] = Int4Weight.from_tensors(name, packed, scale, shape, 32)
    m = K2Model(tiny_cfg, w, get_ops("numpy"))
    _, tree_logits = verify_tree(m)
    cache, _ = prefill(m)
    for d, r in enumerate(path_of(6)):
        lg, _ = m.forward(TREE_TOKENS[r:r + 1], np.array([len(PROMPT) + d]), cache)
    assert np.array_equal(lg[0], tree_logits[6])
