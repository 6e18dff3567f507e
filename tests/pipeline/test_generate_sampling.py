"""Sampling in the generate and bench pipelines, as a user runs them: the issue's exact command with tree=ddtree
and tree=ar writes identical result.json tokens; bench under sampling stays lossless and reports the acceptance
length next to greedy's; a checkpoint's generation_config.json gives the defaults.

Run: .venv/bin/python -m pytest -q tests/pipeline/test_generate_sampling.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kdtree.engine import Engine, generation_config_defaults

REPO = Path(__file__).resolve().parents[2]


def _kdtree(*args, runs: Path, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, KDTREE_RUNS=str(runs), KDTREE_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-m", "kdtree.run", *args], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


def _result(runs: Path, name: str) -> dict:
    (path,) = runs.glob(f"**/{name}")
    return json.loads(path.read_text())


def test_the_issue_command_gives_identical_tokens_for_ddtree_and_ar(tmp_path, kdtree_cache):
    out = {}
    for tree in ("ddtree", "ar"):
        _kdtree("pipeline=generate", "sampling.temperature=0.8", "sampling.seed=7", f"tree={tree}",
                runs=tmp_path / tree, cache=kdtree_cache)
        out[tree] = _result(tmp_path / tree, "result.json")
    assert out["ddtree"]["tokens"] == out["ar"]["tokens"]
    assert len(out["ar"]["tokens"]) == 16 and out["ddtree"]["seed"] == 7
    assert out["ddtree"]["sampling"]["temperature"] == 0.8 and out["ddtree"]["sampling"]["top_p"] == 1.0
    assert out["ddtree"]["target_forwards"] < out["ar"]["target_forwards"]
    # the acceptance length under sampling next to greedy's
    assert 1.0 <= out["ddtree"]["mean_acceptance_length"] and out["ddtree"]["greedy_mean_acceptance_length"] > 1.0
    greedy = tmp_path / "greedy"
    _kdtree("pipeline=generate", "tree=ddtree", runs=greedy, cache=kdtree_cache)
    g = _result(greedy, "result.json")
    assert g["seed"] is None and g["tokens"] != out["ddtree"]["tokens"]   # default stays greedy, sampling differs
    assert g["mean_acceptance_length"] == out["ddtree"]["greedy_mean_acceptance_length"]


def test_generate_with_n_and_logprobs(tmp_path, kdtree_cache):
    r = _kdtree("pipeline=generate", "sampling.temperature=1.0", "sampling.n=2", "sampling.logprobs=2",
                "max_new_tokens=6", runs=tmp_path, cache=kdtree_cache)
    res = _result(tmp_path, "result.json")
    seed = res["seed"]
    assert isinstance(seed, int) and f"seed={seed}" in r.stdout           # no seed given: a random one, reported
    assert len(res["samples"]) == 2 and res["samples"][0]["tokens"] == res["tokens"]
    assert all(len(s["logprobs"]) == len(s["tokens"]) for s in res["samples"])
    assert res["samples"][1]["target_forwards"] == len(res["samples"][1]["acceptance_lengths"])  # shared prefill


def test_bench_under_sampling_is_lossless_and_reports_greedy_acceptance(tmp_path, kdtree_cache):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def main(", "import "]}))
    _kdtree("pipeline=bench", "sampling.temperature=1.0", "bench.max_new_tokens=8", "bench.repeats=1",
            f"bench.prompts={prompts}", "load.progress=false", runs=tmp_path / "runs", cache=kdtree_cache)
    b = _result(tmp_path / "runs", "bench.json")
    assert b["outputs_equal_ar"] is True and b["temperature"] == 1.0
    seeds = [p["seed"] for p in b["result"]["per_prompt"]]
    assert seeds == [p["seed"] for p in b["ar"]["per_prompt"]] and len(set(seeds)) == 2
    assert b["greedy_mean_acceptance_length"] > 1.0 and b["mean_acceptance_length"] >= 1.0
    assert f"sampling.seed={b['sampling']['seed']}" in b["provenance"]["rerun"]   # the rerun replays the draw


def test_generation_config_json_sets_the_defaults(tmp_path, kdtree_cache):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REPO / "kdtree" / "assets" / "tiny", ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "do_sample": True, "eos_token_id": 257}))
    assert generation_config_defaults(ckpt) == {"temperature": 0.6, "top_p": 0.95}
    from hydra import compose, initialize_config_dir
    from kdtree.pipeline.registry import register_schema as register
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", f"model.path={ckpt}", "tree=ar",
                                                       "sampling.top_k=40", "load.progress=false"])
    eng = Engine.from_config(cfg)
    # OpenAI's (temperature 1) < generation_config.json < the operator's sampling.* keys
    assert eng.sampling_defaults() == {"temperature": 0.6, "top_p": 0.95, "top_k": 40}
    assert eng.pipeline_sampling().greedy                                   # no sampling.temperature: greedy
    (ckpt / "generation_config.json").write_text("{not json")
    with pytest.raises(Exception, match="generation_config.json: not readable JSON"):
        eng.sampling_defaults()
    (ckpt / "generation_config.json").unlink()
    assert eng.sampling_defaults() == {"temperature": 1.0, "top_p": 1.0, "top_k": 40}


def test_sweep_over_temperature_and_its_report(tmp_path, kdtree_cache):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def main("]}))
    sweep = tmp_path / "multirun"
    _kdtree("-m", "pipeline=bench", "sampling.temperature=0,1.5", "sampling.seed=3", "bench.max_new_tokens=8",
            "bench.repeats=1", f"bench.prompts={prompts}", "load.progress=false", f"hydra.sweep.dir={sweep}",
            runs=tmp_path / "runs", cache=kdtree_cache)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "kdtree.report", str(sweep)], check=True, cwd=REPO, env=env, timeout=120,
                   capture_output=True)
    import csv
    with open(sweep / "report.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] != "ar"]
    assert sorted(float(r["temperature"]) for r in rows) == [0.0, 1.5]
    assert all(r["outputs_equal_ar"] == "True" for r in rows)
    greedy = {float(r["temperature"]): float(r["greedy_mean_acceptance_length"]) for r in rows}
    assert greedy[0.0] == greedy[1.5]                   # the greedy acceptance is reported next to the sampled one
    assert "| temperature |" in (sweep / "report.md").read_text()


@pytest.mark.parametrize("grammar", ["kdtree/assets/grammars/tool_call.lark",
                                     "kdtree/assets/grammars/file_entry.schema.json"])
def test_bench_under_a_grammar_is_lossless_and_every_output_follows_it(tmp_path, kdtree_cache, grammar):
    import jsonschema
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def main(", "import os\n"]}))
    _kdtree("pipeline=bench", f"bench.grammar={REPO / grammar}", "bench.max_new_tokens=240", "bench.repeats=1",
            f"bench.prompts={prompts}", "load.progress=false", runs=tmp_path / "runs", cache=kdtree_cache)
    b = _result(tmp_path / "runs", "bench.json")
    assert b["outputs_equal_ar"] is True and b["grammar"].endswith(Path(grammar).name)
    assert b["grammar_seconds_per_token"] > 0
    from kdtree.tokenizer import ByteTokenizer
    for p in b["result"]["per_prompt"]:
        text = ByteTokenizer().decode(p["tokens"])
        if grammar.endswith(".lark"):          # markers (all forced) + arguments: the tree is verified whole
            args = text.split("<|tool_call_argument_begin|>")[1].split("<|tool_call_end|>")[0]
            assert text.endswith("<|tool_call_end|><|tool_calls_section_end|>")
            jsonschema.validate(json.loads(args), {"type": "object", "required": ["path", "kind", "depth"]})
        else:
            jsonschema.validate(json.loads(text), json.loads((REPO / grammar).read_text()))
    if grammar.endswith(".lark"):
        assert b["mean_acceptance_length"] > 8


def test_bench_reports_the_moe_tax(tmp_path, kdtree_cache):
    """bench.json's expert-union columns: a 33-row verify routes to (nearly) every expert of a MoE layer where an AR
    step reads top-2 of 8; the target bytes streamed per committed token still fall (~6 tokens per verify)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def main(", "import os\n"]}))
    _kdtree("pipeline=bench", "backend=cpu", "bench.max_new_tokens=24", "bench.repeats=1", f"bench.prompts={prompts}",
            "load.progress=false", runs=tmp_path / "runs", cache=kdtree_cache)
    b = _result(tmp_path / "runs", "bench.json")
    tree, ar = b["moe"], b["ar_moe"]
    assert set(tree["experts_per_forward"]) == set(ar["experts_per_forward"]) == {"1", "2", "3"}   # tiny's MoE layers
    assert 2.0 <= ar["mean_experts_per_forward"] < 3.0 < tree["mean_experts_per_forward"] <= 8.0
    assert 0 < tree["bytes_per_token"] < ar["bytes_per_token"]
    assert 0 < tree["expert_bytes_per_token"] < tree["bytes_per_token"]
    # the drafter's matrices, once per round, and the bound they and the verify's bytes put on any engine
    assert ar["draft_bytes_per_token"] == 0 and 0 < tree["draft_bytes_per_token"] < tree["bytes_per_token"]
    assert b["bytes_bound_speedup"] == pytest.approx(
        ar["bytes_per_token"] / (tree["bytes_per_token"] + tree["draft_bytes_per_token"]))
    assert 1 < b["bytes_bound_speedup"] < ar["bytes_per_token"] / tree["bytes_per_token"]
