"""Grammar-constrained decoding (kdtree/decode/grammar.py, llguidance) is exact under speculation: with a JSON schema
or a Lark grammar, tree=ddtree and tree=chain commit the same tokens as tree=ar, greedy and seeded sampling, alone
and batched, numpy and the native cpu backend -- and the output parses and validates against the schema. Also the
tree pruning itself: a node the grammar refuses on its own path never reaches the verify.

Run: .venv/bin/python -m pytest -q tests/decode/test_grammar_exact.py
"""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from omegaconf import OmegaConf

from kdtree.backends.base import unpack_bitmask
from kdtree.decode.grammar import GrammarError, Grammars, constrain_tree
from kdtree.decode.request import Request
from kdtree.decode.sampling import SamplingParams
from kdtree.decode.scheduler import Scheduler
from kdtree.engine import AR_TREE, Engine
from kdtree.tokenizer import ByteTokenizer
from kdtree.tree import Tree, ancestor_visibility
from tests.native_lib import CPU_SKIPPED

BACKENDS = ["numpy"] + ([] if CPU_SKIPPED else ["cpu"])
DDTREE = OmegaConf.create({"kind": "ddtree", "width": 4, "depth": 7, "budget": 12})
CHAIN = OmegaConf.create({"kind": "chain", "width": 1, "depth": 5, "budget": 5})
TREES = {"ddtree": DDTREE, "chain": CHAIN, "ar": AR_TREE}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "kind": {"enum": ["file", "dir", "link"]},
                                      "size": {"type": "integer", "minimum": 0, "maximum": 99999}},
     "required": ["name", "kind", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"args": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3},
                                      "opts": {"type": "object", "properties": {"verbose": {"type": "boolean"}},
                                               "required": ["verbose"], "additionalProperties": False}},
     "required": ["args", "opts"], "additionalProperties": False},
]
PROMPTS = ["def parse_args(argv):\n    \"\"\"Return the options as JSON: ", "import os\nstat = "]
_engines = {}


def engine_for(compose_cfg, backend) -> Engine:
    if backend not in _engines:
        _engines[backend] = Engine.from_config(compose_cfg(f"backend={backend}", "tree=ddtree", "load.progress=false",
                                                           "serve.prefix_cache=false"))
    return _engines[backend]


def grammars(engine) -> Grammars:
    return Grammars.for_tokenizer(engine.tokenizer, int(engine.model.cfg.vocab_size))


def scheduler(engine) -> Scheduler:
    return Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                     max_batch_tokens=64, pool_tokens=8192)


def requests(engine, spec, tree, sampled, n_prompts=2, max_new=96):
    out = []
    for i, text in enumerate(PROMPTS[:n_prompts]):
        sp = SamplingParams(temperature=0.9, top_p=0.95, seed=77 + i) if sampled else None
        out.append(Request(engine.tokenizer.encode(text), max_new, sampling=sp, tree=tree, grammar=spec.start()))
    return out


def run_alone(engine, reqs):
    sched = scheduler(engine)
    for r in reqs:
        sched.drive(sched.submit(r))
    return reqs


def run_batched(engine, reqs):
    sched = scheduler(engine)
    for r in reqs:
        sched.submit(r)
    for r in reqs:
        sched.drive(r)
    return reqs


def text_of(engine, req) -> str:
    assert req.error is None, req.error
    return engine.tokenizer.decode(req.result.tokens)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_schema_output_is_exact_under_speculation(compose_cfg, backend, sampled, schema):
    engine = engine_for(compose_cfg, backend)
    spec = grammars(engine).json_schema(SCHEMAS[schema])
    base = [text_of(engine, r) for r in run_alone(engine, requests(engine, spec, AR_TREE, sampled))]
    for text in base:                      # the answer is the schema's, whole: it parses and validates
        jsonschema.validate(json.loads(text), SCHEMAS[schema])
    for kind in ("ddtree", "chain"):
        alone = run_alone(engine, requests(engine, spec, TREES[kind], sampled))
        assert [text_of(engine, r) for r in alone] == base, kind
        batched = run_batched(engine, requests(engine, spec, TREES[kind], sampled))
        assert [text_of(engine, r) for r in batched] == base, kind
        assert all(r.result.finish_reason == "stop" for r in alone)
    ar_batched = run_batched(engine, requests(engine, spec, AR_TREE, sampled))
    assert [text_of(engine, r) for r in ar_batched] == base


@pytest.mark.parametrize("backend", BACKENDS)
def test_lark_grammar_with_text_markers_is_exact(compose_cfg, backend):
    engine = engine_for(compose_cfg, backend)
    g = grammars(engine)
    lark = (f'start: {g.marker("<|tool_calls_section_begin|>")} call {g.marker("<|tool_calls_section_end|>")}\n'
            f'call: {g.marker("<|tool_call_begin|>")} "functions.ls:0" {g.marker("<|tool_call_argument_begin|>")} '
            f'args {g.marker("<|tool_call_end|>")}\n'
            'args: ' + g.json_rule(SCHEMAS[0]) + "\n")
    spec = g.lark(lark)
    base = [text_of(engine, r) for r in run_alone(engine, requests(engine, spec, AR_TREE, False, max_new=200))]
    for text in base:
        assert text.startswith("<|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0"
                               "<|tool_call_argument_begin|>") and text.endswith("<|tool_call_end|>"
                                                                                "<|tool_calls_section_end|>")
        args = text.split("<|tool_call_argument_begin|>")[1].split("<|tool_call_end|>")[0]
        jsonschema.validate(json.loads(args), SCHEMAS[0])
    for kind in ("ddtree", "chain"):
        reqs = run_batched(engine, requests(engine, spec, TREES[kind], False, max_new=200))
        assert [text_of(engine, r) for r in reqs] == base
    # the forced markers are where speculation pays: more than one token per target forward
    dd = run_alone(engine, requests(engine, spec, DDTREE, False, max_new=200))
    assert sum(r.generated for r in dd) / sum(r.result.target_forwards for r in dd) > 1.5


def test_constrain_tree_prunes_refused_nodes_and_adds_forced_ones():
    tok = ByteTokenizer()
    g = Grammars.for_tokenizer(tok, 260)
    state = g.json_schema({"enum": ["ab", "ac", "b"]}).start()
    # root (nothing consumed yet) -> '"' -> 'a' -> {'b', 'x', 'c'}; '"' -> 'q'; 'z'
    toks = [ord('"'), ord('a'), ord('b'), ord('x'), ord('c'), ord('q'), ord('z')]
    par = [-1, 0, 1, 1, 1, 0, -1]
    tree = Tree(np.array(toks, np.int32), np.array(par, np.int32), np.array([1, 2, 3, 3, 3, 2, 1], np.int32),
                ancestor_visibility(np.array(par, np.int32)))
    kept, bits = constrain_tree(state, tree, budget=9)
    masks = unpack_bitmask(bits, 260)
    eos = tok.eos_id
    # refused: 'x' after '"a', 'q' after '"', 'z' at the root; forced and added: the closing quote, then the end
    assert [t if t == eos else chr(t) for t in kept.tokens] == ['"', 'a', 'b', 'c', '"', eos, '"', eos]
    assert list(kept.parents) == [-1, 0, 1, 1, 2, 4, 3, 6] and list(kept.depths) == [1, 2, 3, 3, 4, 5, 4, 5]
    assert masks.shape == (9, 260)
    assert np.flatnonzero(masks[0]).tolist() == [ord('"')]          # the root: the state as committed
    assert sorted(chr(t) for t in np.flatnonzero(masks[2])) == ['b', 'c']   # after '"a'
    assert np.flatnonzero(masks[3]).tolist() == [ord('"')]          # after '"ab': the closing quote
    assert np.flatnonzero(masks[5]).tolist() == [eos]               # after '"ab"': complete
    assert np.flatnonzero(state.mask()).tolist() == [ord('"')]      # the state is left as it was
    small, _ = constrain_tree(state, tree, budget=0)                # budget 0: never more nodes than drafted
    assert small.size <= tree.size


def test_bad_schemas_name_the_parameter():
    g = Grammars.for_tokenizer(ByteTokenizer(), 260)
    for bad, word in [({"type": "nosuch"}, "type"), ({"properties": 3}, "properties"), ([1], "object")]:
        with pytest.raises(GrammarError) as e:
            g.json_schema(bad, param="response_format.json_schema.schema")
        assert e.value.param == "response_format.json_schema.schema"
        assert "response_format.json_schema.schema" in str(e.value) and word in str(e.value)
    with pytest.raises(GrammarError) as e:
        g.lark("start: nosuchrule", param="tool_choice")
    assert e.value.param == "tool_choice" and "nosuchrule" in str(e.value)


def test_every_row_mask_is_its_own_paths_state_when_nothing_is_pruned():
    """Nodes in breadth-first order (the depth-first walk visits them in another): each row still gets the mask of
    the state its own path reaches (a mask out of node order once committed a token the grammar refused)."""
    tok = ByteTokenizer()
    spec = Grammars.for_tokenizer(tok, 260).json_schema({"enum": ["ab", "ac", "b"]})
    toks = [ord('"'), ord('a'), ord('b'), ord('b'), ord('c')]
    par = [-1, 0, 0, 1, 1]
    tree = Tree(np.array(toks, np.int32), np.array(par, np.int32), np.array([1, 2, 2, 3, 3], np.int32),
                ancestor_visibility(np.array(par, np.int32)))
    kept, bits = constrain_tree(spec.start(), tree, budget=5)
    assert kept is tree
    for row in range(tree.size + 1):
        path, node = [], row - 1
        while node >= 0:
            path.insert(0, toks[node])
            node = par[node]
        fresh = spec.start()
        fresh.consume(path)
        assert np.array_equal(unpack_bitmask(bits[row:row + 1], 260)[0], fresh.mask()), row


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_schema_output_is_the_same_with_a_prefix_cache_hit(compose_cfg, backend, sampled):
    """A grammar-constrained request with no hit, a full-prompt hit and a partial hit of the prefix cache: the same
    answer as without a cache (AR and DDTree)."""
    from kdtree.decode.prefix_cache import PrefixCache
    engine = engine_for(compose_cfg, backend)
    spec = grammars(engine).json_schema(SCHEMAS[0])
    pc = PrefixCache(page_tokens=16, max_tokens=4096)
    cached = Scheduler(engine.model, engine.drafter, engine.cfg.tree, engine.eos_id, engine.max_context,
                       max_batch_tokens=64, pool_tokens=8192, prefix_cache=pc)
    ids = engine.tokenizer.encode(PROMPTS[0] * 2)
    other = ids[:40] + engine.tokenizer.encode(PROMPTS[1])
    for tree in (AR_TREE, TREES["ddtree"]):
        for prompt, want_cached in ((ids, 0), (ids, (len(ids) - 1) // 16 * 16), (other, 32)):
            sp = SamplingParams(temperature=0.9, top_p=0.95, seed=5) if sampled else None
            base = run_alone(engine, [Request(list(prompt), 64, sampling=sp, tree=AR_TREE, grammar=spec.start())])[0]
            req = cached.submit(Request(list(prompt), 64, sampling=sp, tree=tree, grammar=spec.start()))
            cached.drive(req)
            assert text_of(engine, req) == text_of(engine, base)
            if tree is AR_TREE:                                  # the first pass fills the cache; DDTree hits it all
                assert req.result.cached_tokens == want_cached, (len(prompt), req.result.cached_tokens)
            else:
                assert req.result.cached_tokens >= want_cached > 0 or want_cached == 0
    assert pc.hits > 0
