"""model=tiny_wide: the trained tiny widened by a function-preserving transform (kdtree/checkpoint/widen.py), here at
narrow widths (hidden 256, dense MLP 1024, experts 512: 2x tiny's) on the numpy reference:

* every tensor of the generated target and drafter has the widened shape names.py derives from the config;
* prompt logits within LOGITS_ATOL of tiny's, the same greedy tokens;
* DDTree output (depth 15: tiny_wide's drafter is tiny's block-16 one) equals AR output on the widened model, with
  tiny's number of target forwards (acceptance kept);
* the INT4 checkpoint (quant=int4_w4a16, BF16 non-experts) is made through the quantize path and decodes exactly;
* widths that are not multiples of tiny's, init=random, or another source are refused with a ConfigError.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from kdtree.checkpoint.index import open_checkpoint
from kdtree.checkpoint.tiny import checkpoint_key, ensure_tiny_checkpoint
from kdtree.checkpoint.widen import Widener, embedding, source_config
from kdtree.decode import generate
from kdtree.engine import AR_TREE, Engine
from kdtree.errors import CheckpointError, ConfigError
from kdtree.model.names import drafter_tensor_shapes, target_tensor_shapes

LOGITS_ATOL = 1e-4
PROMPT = "def __init__(self, "
NEW_TOKENS = 24
NARROW = ["model=tiny_wide", "model.hidden_size=256", "model.intermediate_size=1024", "model.moe_intermediate_size=512"]
DEEP = ["tree=ddtree", "tree.depth=15", "tree.budget=16"]


@pytest.fixture(scope="module")
def engines(kdtree_cache):
    from hydra import compose, initialize_config_dir

    from kdtree.pipeline.registry import register_schema
    from tests.conftest import REPO

    register_schema()

    def cfg(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", "load.progress=false",
                                                            *overrides])

    tiny = Engine.from_config(cfg("model=tiny", "model.drafter.block_size=16", *DEEP))
    wide = Engine.from_config(cfg(*NARROW, *DEEP))
    yield {"tiny": tiny, "wide": wide, "cfg": cfg}
    tiny.close()
    wide.close()


def _run(engine):
    ids = engine.tokenizer.encode(PROMPT)
    pos = np.arange(len(ids), dtype=np.int32)
    logits, _ = engine.model.forward(np.asarray(ids, np.int32), pos, engine.model.new_cache(len(ids)))
    ar = generate(engine.model, None, AR_TREE, ids, NEW_TOKENS)
    tree = generate(engine.model, engine.drafter, engine.cfg.tree, ids, NEW_TOKENS)
    return logits, ar, tree


def test_every_tensor_has_the_widened_shape(engines):
    wide = engines["wide"]
    m = wide.cfg.model
    assert (m.hidden_size, m.intermediate_size, m.moe_intermediate_size) == (256, 1024, 512)
    for d, want in ((wide.checkpoint, target_tensor_shapes(m)), (wide.checkpoint / "drafter", drafter_tensor_shapes(m))):
        have = {n: tuple(t.shape) for n, t in open_checkpoint(d).tensors.items()}
        assert have == {n: tuple(s) for n, s in want.items()}
    assert tuple(open_checkpoint(wide.checkpoint).tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].shape) \
        == (512, 256)
    assert tuple(open_checkpoint(wide.checkpoint / "drafter").tensors["layers.0.mlp.gate_proj.weight"].shape) \
        == (256, 256)   # the drafter keeps tiny's MLP width


def test_logits_tokens_and_acceptance_are_tiny_s(engines):
    logits0, ar0, tree0 = _run(engines["tiny"])
    logits, ar, tree = _run(engines["wide"])
    diff = float(np.abs(logits - logits0).max())
    print(f"tiny_wide (256/1024/512) prompt logits max|diff| vs tiny = {diff:.2e}")
    assert diff < LOGITS_ATOL
    assert ar.tokens == ar0.tokens and len(ar.tokens) == NEW_TOKENS
    assert tree.tokens == ar.tokens
    assert tree.target_forwards == tree0.target_forwards and tree.acceptance_lengths == tree0.acceptance_lengths


def test_int4_checkpoint_is_quantized_from_bf16_and_decodes_exactly(engines):
    engine = Engine.from_config(engines["cfg"](*NARROW, "quant=int4_w4a16"))
    try:
        idx = open_checkpoint(engine.checkpoint)
        assert {t.dtype for n, t in idx.tensors.items() if ".experts." not in n} == {"BF16"}
        assert idx.tensors["model.layers.1.mlp.experts.7.down_proj.weight_packed"].dtype == "I32"
        ids = engine.tokenizer.encode(PROMPT)
        ar = generate(engine.model, None, AR_TREE, ids, NEW_TOKENS).tokens
        assert generate(engine.model, engine.drafter, engine.cfg.tree, ids, NEW_TOKENS).tokens == ar
    finally:
        engine.close()


def test_q_rows_are_orthonormal_with_disjoint_supports():
    v = embedding(128, 512, 0).astype(np.float64)
    q = np.zeros((128, 512))
    for i in range(128):
        q[i, 4 * i:4 * i + 4] = v[i]
    assert np.allclose(q @ q.T, np.eye(128), atol=1e-6)
    assert np.array_equal(embedding(128, 512, 0), embedding(128, 512, 0))
    assert not np.array_equal(embedding(128, 512, 0), embedding(128, 512, 1))


def test_widths_key_the_directory_and_bad_configs_are_refused(engines, tmp_path):
    cfg = engines["cfg"]
    narrow, default = cfg(*NARROW), cfg("model=tiny_wide")
    assert checkpoint_key(narrow.model, None) != checkpoint_key(default.model, None)
    assert checkpoint_key(narrow.model, None) != checkpoint_key(cfg(*NARROW, "model.seed=1").model, None)
    with pytest.raises(ConfigError, match="multiple"):
        ensure_tiny_checkpoint(cfg("model=tiny_wide", "model.hidden_size=200").model, None, str(tmp_path))
    with pytest.raises(ConfigError, match="init"):
        ensure_tiny_checkpoint(cfg(*NARROW, "model.init=random").model, None, str(tmp_path))
    with pytest.raises(ConfigError, match="widen_from"):
        ensure_tiny_checkpoint(cfg(*NARROW, "model.widen_from=k26").model, None, str(tmp_path))
    with pytest.raises(ConfigError, match="architecture"):
        ensure_tiny_checkpoint(cfg(*NARROW, "model.num_hidden_layers=3").model, None, str(tmp_path))
    assert checkpoint_key(narrow.model, None) != checkpoint_key(cfg(*NARROW, "model.drafter.block_size=8").model, None)
    with pytest.raises(ConfigError, match="block_size=8 or model.drafter.block_size=16"):
        ensure_tiny_checkpoint(cfg(*NARROW, "model.drafter.block_size=12").model, None, str(tmp_path))


def test_an_unknown_tensor_name_raises(engines):
    m = engines["wide"].cfg.model
    w = Widener(source_config(m), {**source_config(m), "hidden_size": 256, "intermediate_size": 1024,
                                   "moe_intermediate_size": 512})
    with pytest.raises(CheckpointError, match="no rule"):
        w.widen("model.layers.0.mlp.new_proj.weight", np.zeros((4, 128), np.float32), drafter=False)


def test_two_generations_are_byte_identical(engines, tmp_path):
    m = engines["cfg"](*NARROW).model
    a, b = ensure_tiny_checkpoint(m, None, str(tmp_path / "a")), ensure_tiny_checkpoint(m, None, str(tmp_path / "b"))
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert a.name == b.name and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_weights_map_onto_cache_lines_or_the_load_says_so(engines, tmp_path):
    """The native kernels read weight rows 64 bytes at a time (rows 16 bytes off a line: up to 1.3x slower at 9-17
    rows). This writer's files map every whole-line tensor onto a line; a file written by the safetensors package
    (8-byte alignment) maps them off, NativeTarget.off_line_bytes counts those bytes (the load stage reports them),
    and load.strategy=eager copies them onto lines."""
    from safetensors.numpy import load_file, save_file

    from kdtree.checkpoint.safetensors_io import read_header

    cfg = engines["cfg"]
    foreign = tmp_path / "foreign"
    shutil.copytree(engines["wide"].checkpoint, foreign)
    for f in sorted(foreign.glob("*.safetensors")):
        tensors = load_file(f)
        for pad in range(8):                                 # a header length that leaves the data off a line
            save_file(tensors, f, metadata={"format": "pt", "pad": "x" * pad})
            if read_header(f).data_start % 64:
                break
    off = {}
    for label, overrides in (("ours", []), ("foreign", [f"model.path={foreign}"]),
                             ("foreign eager", [f"model.path={foreign}", "load.strategy=eager"])):
        e = Engine.from_config(cfg(*NARROW, "backend=cpu", "tree=ar", *overrides))
        try:
            off[label] = e.model.off_line_bytes()
            held = sum(a.nbytes for a in e.model.held_arrays(1 << 20))
        finally:
            e.close()
    print("off_line_bytes", off, "held", held)
    assert held > 0
    assert off["ours"] == 0 and off["foreign eager"] == 0, off
    assert off["foreign"] > 0, off
