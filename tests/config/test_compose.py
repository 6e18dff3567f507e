"""Config composition: every group combination composes against the typed schemas, and bad overrides
fail before any work with one line naming the key and what is valid."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kdtree.backends import check_device, cuda_device_problem
from kdtree.pipeline.registry import register_schema as register
from kdtree.config.validate import validate
from kdtree.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
register()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _choices(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model,quant,tp,backend,tree", list(itertools.product(
    _choices("model"), _choices("quant"), ["'1'", "'8'"], _choices("backend"), _choices("tree"))))
def test_every_combination_composes(model, quant, tp, backend, tree):
    cfg = _compose(f"model={model}", f"quant={quant}", f"tp={tp}", f"backend={backend}", f"tree={tree}")
    assert cfg.model.name == model and cfg.quant.method == quant and cfg.backend.name == backend
    assert cfg.tree.kind == tree and cfg.tp.size == int(tp.strip("'"))
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def test_k26_has_the_real_kimi_k26_dimensions():
    m = _compose("model=k26").model
    assert (m.hidden_size, m.num_hidden_layers, m.first_k_dense_replace) == (7168, 61, 1)
    assert (m.n_routed_experts, m.num_experts_per_tok, m.n_shared_experts) == (384, 8, 1)
    assert (m.moe_intermediate_size, m.intermediate_size, m.num_attention_heads) == (2048, 18432, 64)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert (m.vocab_size, m.rope_theta, m.routed_scaling_factor, m.rms_norm_eps) == (163840, 50000.0, 2.827, 1e-5)
    assert (m.rope_scaling.factor, m.rope_scaling.original_max_position_embeddings,
            m.rope_scaling.beta_fast, m.rope_scaling.beta_slow) == (64.0, 4096, 32.0, 1.0)
    assert (m.scoring_func, m.topk_method) == ("sigmoid", "noaux_tc")
    d = m.drafter
    assert (d.num_hidden_layers, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.block_size) == \
        (6, 64, 8, 128, 8)
    assert list(d.target_layer_ids) == [1, 12, 24, 35, 47, 58]


def test_tiny_is_the_same_architecture_scaled_down():
    m = _compose().model
    assert m.first_k_dense_replace >= 1 and m.num_hidden_layers - m.first_k_dense_replace >= 2
    assert m.n_routed_experts > m.num_experts_per_tok > 1 and m.n_shared_experts == 1
    assert m.vocab_size >= 259 and {m.bos_token_id, m.eos_token_id, m.mask_token_id} <= set(range(256, m.vocab_size))


def test_unknown_key_and_wrong_type_fail_at_compose_time():
    with pytest.raises(Exception, match="nope"):
        _compose("model.nope=1")
    with pytest.raises(Exception, match="tree.depth"):
        _compose("tree.depth=abc")


@pytest.mark.parametrize("overrides,match", [
    (["tp='8'", "model.num_attention_heads=12"], r"tp=8 does not divide num_attention_heads=12 \(model=tiny\); use tp=1, 2, 4"),
    (["tree.depth=-1"], r"tree.depth=-1 is out of range for tree=ddtree; use 1..7"),
    (["tree.depth=8"], r"tree.depth=8 is out of range"),
    (["tree=chain", "tree.width=3"], r"chain has width 1"),
    (["quant=int4_w4a16", "tp='8'", "quant.group_size=64"], r"not a multiple of quant.group_size=64"),
    (["model.path=/does/not/exist"], r"model.path=/does/not/exist does not exist"),
    (["model=k26"], r"model.path is empty for model=k26"),
    (["load.strategy=fast"], r"load.strategy=fast is unknown; use load.strategy=mmap"),
    (["load.threads=0"], r"load.threads=0 must be >= 1"),
    (["load.throttle_mb_s=-5"], r"load.throttle_mb_s=-5.0 must be >= 0"),
    (["bench_load.gb=0"], r"bench_load.gb=0.0 must be positive; use e.g. bench_load.gb=0.01"),
    (["bench_peer.threads=0"], r"bench_peer.threads=0 must be >= 1; use e.g. bench_peer.threads=1"),
    (["bench_peer.trees=[ddtree-w4-x7]"], r"bench_peer.trees item 'ddtree-w4-x7': part 'x7' is not one of wN, dN, bN"),
    (["bench_peer.trees=[tree-w4]"], r"item 'tree-w4': starts with 'tree'; a shape starts with chain or ddtree"),
    (["bench_peer.trees=[ddtree-d9]"], r"item 'ddtree-d9': tree.depth=9 is out of range for tree=ddtree; use 1..7"),
    (["bench_peer.trees=[chain-w2-d5]"], r"item 'chain-w2-d5': a chain has width 1"),
    (["tree=ar", "bench_peer.trees=[chain-d7]"], r"bench_peer.trees=\['chain-d7'\] with tree=ar: .* set tree=ddtree"),
    (["load.mlock=true", "load.strategy=eager"], r"load.mlock=true with load.strategy=eager: .* use load.strategy=mmap"),
    (["backend=cuda", "backend.drafter_forward=fast"], r"backend.drafter_forward=fast is unknown; use native .* or per_op"),
    (["tp.collective=mpi"], r"tp.collective=mpi is unknown; use auto, host or nccl"),
    (["tp.collective=nccl"], r"tp.collective=nccl with backend=numpy: NCCL on the stream is the CUDA forward's"),
])
def test_cross_field_rules_name_the_key_and_the_fix(overrides, match):
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, stages=["load"])


def test_bench_peer_tree_shapes_start_with_tree_and_drop_duplicates():
    from kdtree.config.validate import peer_tree_shapes
    cfg = _compose("tree.budget=8", "bench_peer.trees=[ddtree-b6,ddtree-w2-d5-b5,chain-d5,ddtree-w4-d7-b8]")
    got = [(t.kind, t.width, t.depth, t.budget) for t in peer_tree_shapes(cfg)]
    # unset parts come from `tree` (w4 d7); a chain's budget is its depth; the last item repeats `tree`
    assert got == [("ddtree", 4, 7, 8), ("ddtree", 4, 7, 6), ("ddtree", 2, 5, 5), ("chain", 1, 5, 5)]
    assert peer_tree_shapes(_compose("tree=ar")) == []


@pytest.mark.parametrize("stage", ["bench", "bench_peer"])
def test_a_bench_stages_extra_shapes_inherit_what_they_do_not_name_from_tree(stage):
    """bench.trees / bench_peer.trees items are `tree` with the item's parts: tree.policy=cost reaches the chain and
    the other ddtree too (bench_peer had measured its extra shapes with the fixed policy)."""
    from kdtree.config.validate import tree_shapes
    cfg = _compose("tree=ddtree", "tree.policy=cost", "tree.budget=8", f"{stage}.trees=[chain-d5-prune,ddtree-w2-b4]")
    got = [(t.kind, t.width, t.depth, t.budget, t.prune_experts, t.policy) for t in tree_shapes(cfg, stage)]
    assert got == [("ddtree", 4, 7, 8, False, "cost"), ("chain", 1, 5, 5, True, "cost"),
                   ("ddtree", 2, 7, 4, False, "cost")]


def test_backend_cuda_without_a_device_names_the_fix():
    if not cuda_device_problem():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ConfigError, match=r"backend=cuda needs a CUDA device"):
        check_device(_compose("backend=cuda"))


def test_plan_needs_neither_checkpoint_nor_gpu():
    validate(_compose("model=k26", "tp='8'", "quant=int4_w4a16", "backend=cuda"), stages=["plan"])


def _run(*args, tmp_path):
    env = dict(os.environ, KDTREE_RUNS=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "kdtree.run", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


@pytest.mark.parametrize("args,match", [
    (["model=nope"], "model=nope is not a known model config; valid: k26, k26_mini, tiny"),
    (["tp=3"], "tp=3 is not a known tp config; valid: 1, 2, 4, 8"),
    (["pipeline=generate", "tree.depth=-1"], "tree.depth=-1 is out of range"),
    (["pipeline=generate", "model.path=/nope/ckpt"], "model.path=/nope/ckpt does not exist"),
])
def test_bad_overrides_exit_nonzero_with_one_line(args, match, tmp_path):
    r = _run(*args, tmp_path=tmp_path)
    assert r.returncode != 0
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and match in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("pipeline,content,match", [
    ("bench_peer", '{"prompts": []}', 'has no "prompts" list with a prompt in it (got [])'),
    ("bench_serve", None, "cannot read it (No such file or directory)"),
    ("bench_http", '{"prompts": [null]}', "prompt 0 is null, not a non-empty string"),
])
def test_every_bench_pipeline_refuses_a_bad_prompt_file_at_start_up(pipeline, content, match, tmp_path):
    """bench_peer (like bench) before its load; bench_serve and bench_http, which read bench.prompts on the
    controller, before the server starts."""
    path = tmp_path / "prompts.json"
    if content is not None:
        path.write_text(content)
    r = _run(f"pipeline={pipeline}", "backend=cpu", f"bench.prompts={path}", tmp_path=tmp_path)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and f"bench.prompts={path}: {match}" in lines[0], r.stderr


@pytest.mark.parametrize("arg,match", [
    ("bench_serve.clients=[4,0]", "bench_serve.clients=[4, 0] must be a non-empty list of positive integers"),
    ("bench_serve.requests=0", "bench_serve.requests=0 must be an integer >= 1; use e.g. bench_serve.requests=2"),
    ("bench_serve.max_tokens=1", "bench_serve.max_tokens=1 must be an integer >= 2"),
    ("bench_serve.shared_prefix_tokens=-1", "bench_serve.shared_prefix_tokens=-1 must be an integer >= 0"),
    ("bench_http.repeats=0", "bench_http.repeats=0 must be an integer >= 1; use e.g. bench_http.repeats=3"),
    ("bench_http.max_tokens=1", "bench_http.max_tokens=1 must be an integer >= 2"),
    ("bench_peer.gguf=/nonexistent/k26.gguf", "bench_peer.gguf=/nonexistent/k26.gguf does not exist; export one"),
    ("bench.max_new_tokens=1", "bench.max_new_tokens=1 must be an integer >= 2; use e.g. bench.max_new_tokens=96"),
    ("bench.repeats=0", "bench.repeats=0 must be an integer >= 1; use e.g. bench.repeats=3"),
])
def test_bench_options_are_checked_before_the_server_or_the_load_starts(arg, match, tmp_path):
    r = _run(f"pipeline={arg.split('.')[0]}", "backend=cpu", arg, tmp_path=tmp_path)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and match in lines[0], r.stderr


@pytest.mark.parametrize("content,match", [
    (None, "cannot read it (No such file or directory)"),
    ("def main(", "not a JSON file"),
    ('{"prompts": []}', 'has no "prompts" list with a prompt in it (got [])'),
    ('["def main("]', 'has no "prompts" list with a prompt in it (got null)'),
    ('{"prompts": ["def main(", 7]}', "prompt 1 is 7, not a non-empty string"),
    ('{"prompts": [""]}', 'prompt 0 is "", not a non-empty string'),
])
def test_a_bad_bench_prompt_file_fails_in_one_line_before_the_load(content, match, tmp_path):
    """bench.prompts names a file the bench stages read; a missing, malformed or empty one is refused at start-up
    (before a load that takes minutes at K2.6's size) naming the key, the file and the form it needs."""
    path = tmp_path / "prompts.json"
    if content is not None:
        path.write_text(content)
    r = _run("pipeline=bench", "backend=cpu", f"bench.prompts={path}", tmp_path=tmp_path)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"bench.prompts={path}: {match}" in lines[0] and '{"prompts": ["def main(", ...]}' in lines[0], lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("arg,match", [
    ("bench_forward.rows=[0]", "bench_forward.rows=[0] must be a non-empty list of positive integers"),
    ("bench_forward.rows=[]", "bench_forward.rows=[] must be a non-empty list of positive integers"),
    ("bench_forward.threads=[2,0]", "bench_forward.threads=[2, 0] must be a non-empty list of positive integers"),
    ("bench_forward.context=-1", "bench_forward.context=-1 must be an integer >= 0; use e.g. bench_forward.context=64"),
    ("bench_forward.repeats=0", "bench_forward.repeats=0 must be an integer >= 1"),
    ("bench_forward.roof_mb=0", "bench_forward.roof_mb=0 must be an integer >= 1; use e.g. bench_forward.roof_mb=1024"),
    ("bench_forward.rows=[4000]", "is 4064 positions, past max_position_embeddings=2048 of model=tiny; lower "
                                  "bench_forward.context or the rows"),
    ("backend=numpy", "bench_forward measures the native CPU forward; backend=numpy has no byte accounting"),
])
def test_bench_forward_options_are_checked_before_the_load(arg, match, tmp_path):
    """pipeline=bench_forward's options fail at start-up in one line (context=-1 used to reach the forward as a shape
    mismatch, rows past the model's positions as a prompt-length error naming other keys)."""
    r = _run("pipeline=bench_forward", "backend=cpu", arg, tmp_path=tmp_path)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and match in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_backend_cuda_without_a_device_fails_in_one_line(tmp_path):
    if not cuda_device_problem():
        pytest.skip("this machine has a CUDA device")
    r = _run("pipeline=generate", "backend=cuda", tmp_path=tmp_path)
    assert r.returncode != 0 and "backend=cuda needs a CUDA device" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cfg_job_prints_the_production_config(tmp_path):
    r = _run("--cfg", "job", "model=k26", "tp=8", "backend=cuda", "quant=int4_w4a16", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = OmegaConf.create(r.stdout)
    assert cfg.model.hidden_size == 7168 and cfg.tp.size == 8 and cfg.quant.method == "int4_w4a16"


@pytest.mark.parametrize("prompt", ["2+2=", "it's a \"test\" \\ ok", "end\\", "a\\'b", "x=[1,2]; y={a: b}", "tp=8"])
def test_prompts_reach_the_config_verbatim(prompt):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kdtree.run import quote_for_hydra

    (arg,) = quote_for_hydra([f"prompt={prompt}"])
    assert OverridesParser.create().parse_override(arg).value() == prompt


def test_numeric_group_choices_are_quoted_for_hydra():
    from kdtree.run import quote_for_hydra

    assert quote_for_hydra(["tp=8", "tp=1,8", "tree.depth=4", "model=k26"]) == \
        ["tp='8'", "tp='1','8'", "tree.depth=4", "model=k26"]


@pytest.mark.parametrize("overrides,stages,match", [
    (["sampling.temperature=-1"], ["generate"], r"^sampling.temperature=-1.0 must be >= 0"),
    (["sampling.temperature=1", "sampling.top_p=1.5"], ["generate"], r"^sampling.top_p=1.5 must be in \(0, 1\]"),
    (["sampling.temperature=1", "sampling.top_k=-3"], ["bench"], r"^sampling.top_k=-3 must be -1 or 0"),
    (["sampling.temperature=1", "sampling.repetition_penalty=3"], ["generate"],
     r"^sampling.repetition_penalty=3.0 must be in \(0, 2\]"),
    (["sampling.temperature=1", "sampling.presence_penalty=-2.5"], ["generate"],
     r"^sampling.presence_penalty=-2.5 must be in \[-2, 2\]"),
    (["sampling.logprobs=21"], ["generate"], r"^sampling.logprobs=21 must be in 0..20"),
    (["sampling.n=0", "sampling.temperature=1"], ["generate"], r"^sampling.n=0 must be in 1..128"),
    (["sampling.n=3"], ["generate"], r"^sampling.n=3 with temperature=0: greedy decoding has one answer"),
    (["sampling.top_p=0.9"], ["load", "generate"],
     r"^sampling.top_p=0.9 has no effect: .* add e.g. sampling.temperature"),
    (["sampling.seed=7"], ["load", "bench"], r"^sampling.seed=7 has no effect"),
])
def test_sampling_keys_are_checked_in_one_line(overrides, stages, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate(_compose(*overrides), stages=stages)
    assert "\n" not in str(e.value)


def test_sampling_section_types_and_defaults():
    cfg = _compose("sampling.temperature=0.8", "sampling.seed=7", "sampling.top_k=40")
    assert (cfg.sampling.temperature, cfg.sampling.seed, cfg.sampling.top_k, cfg.sampling.top_p) == (0.8, 7, 40, None)
    validate(cfg, stages=["generate"])
    validate(_compose("sampling.top_p=0.9"), stages=["load", "serve"])   # a server default: fine without T
    assert _compose().sampling.temperature is None                        # pipelines stay greedy by default
    with pytest.raises(Exception, match="sampling.temperature"):
        _compose("sampling.temperature=hot")
    with pytest.raises(Exception, match="nope"):
        _compose("sampling.nope=1")
