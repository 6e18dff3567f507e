"""The bench pipeline and its sweep report: a real Hydra multirun of real engine processes, aggregated by
kdtree.report into a table and a plot; one row rerun from its provenance reproduces its tokens exactly."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kdtree.backends import native
from tests.native_lib import needs_cpu_library

REPO = Path(__file__).resolve().parents[2]


def _kdtree(*args, cwd=REPO, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, kdtree_cache):
    d = tmp_path_factory.mktemp("sweep")
    prompts = d / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def main(", "2+2="]}))
    _kdtree("-m", "kdtree.run", "-m", "pipeline=bench", "tree.width=1,2", "tree.depth=2", "tree.budget=4",
            "bench.max_new_tokens=6", "bench.repeats=1", f"bench.prompts={prompts}", f"cache_dir={kdtree_cache}",
            f"hydra.sweep.dir={d / 'multirun'}", "load.progress=false")
    return d / "multirun"


def test_sweep_writes_one_bench_json_per_run_with_ratios_and_provenance(sweep):
    rows = sorted(sweep.glob("*/bench.json"))
    assert len(rows) == 2
    for f in rows:
        b = json.loads(f.read_text())
        for key in ("tokens_per_s", "speedup_vs_ar", "target_forwards_per_token", "mean_acceptance_length",
                    "acceptance_histogram", "stage_seconds"):
            assert key in b, key
        assert b["outputs_equal_ar"] is True
        assert b["speedup_vs_ar"] == pytest.approx(b["tokens_per_s"] / b["ar_tokens_per_s"])
        # backend=numpy (the sweep's default) runs nothing in the native library: all decode time is Python's
        assert b["python_overhead_fraction"] == 1.0 and b["ar_python_overhead_fraction"] == 1.0
        p = b["provenance"]
        assert p["git_commit"] and p["versions"]["numpy"] and p["cpu"] and p["seeds"]["model"] == 0
        assert any(o.startswith("tree.width=") for o in p["overrides"])
        assert p["config"]["tree"]["width"] == b["tree"]["width"]


def test_report_has_table_plot_best_row_and_ar_chain_ddtree_side_by_side(sweep):
    r = _kdtree("-m", "kdtree.report", str(sweep))
    assert "best:" in r.stdout
    md = (sweep / "report.md").read_text()
    assert "**best**" in md and "| ar |" in md and "| chain |" in md and "| ddtree |" in md
    with open(sweep / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["kind"] for row in table] == ["ar", "chain", "ddtree"]
    assert sum(row["best"] == "True" for row in table) == 1
    best = max(table[1:], key=lambda row: float(row["speedup_vs_ar"]))
    assert best["best"] == "True"
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_on_an_empty_dir_says_what_to_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kdtree.report", str(tmp_path)], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode != 0 and "no bench.json" in (r.stdout + r.stderr)


def test_a_row_rerun_from_its_provenance_reproduces_tokens_and_acceptance(sweep, tmp_path):
    row = json.loads(sorted(sweep.glob("*/bench.json"))[-1].read_text())
    overrides = row["provenance"]["overrides"]
    _kdtree("-m", "kdtree.run", *overrides, f"hydra.run.dir={tmp_path / 'rerun'}")
    again = json.loads((tmp_path / "rerun" / "bench.json").read_text())
    assert [p["tokens"] for p in again["result"]["per_prompt"]] == [p["tokens"] for p in row["result"]["per_prompt"]]
    assert [p["acceptance_lengths"] for p in again["result"]["per_prompt"]] == \
        [p["acceptance_lengths"] for p in row["result"]["per_prompt"]]
    assert OmegaConf.create(again["provenance"]["config"]).tree == OmegaConf.create(row["provenance"]["config"]).tree


def test_a_pruned_shape_is_its_own_line_in_the_report():
    # bench.trees may hold ddtree-b8 and ddtree-b8-prune: one line each in the table and the plot, not one mixed line
    from kdtree.report import _row
    b = {"model": "tiny_wide", "quant": "fp32", "ar_tokens_per_s": 8.0, "ar_target_forwards_per_token": 1.0}
    shape = {"kind": "ddtree", "width": 4, "depth": 7, "budget": 8, "policy": "fixed"}
    plain, pruned = _row(b, shape, "r"), _row(b, {**shape, "prune_experts": True}, "r")
    assert (plain["kind"], pruned["kind"]) == ("ddtree", "ddtree prune")


def test_runs_with_drafters_of_two_block_sizes_are_two_models_in_the_report(tmp_path):
    # model=tiny_wide with its block-16 drafter and with model.drafter.block_size=8, in one report dir: two labels,
    # two AR rows (each the median of its own runs' baselines), not one label mixing both drafters
    from kdtree.report import write_report

    shape = {"kind": "ddtree", "width": 4, "depth": 7, "budget": 8, "policy": "fixed"}
    for name, block, ar in (("b16", 16, 9.0), ("b8", 8, 8.0), ("old", None, 7.0)):
        b = {"model": "tiny_wide" if block else "tiny", "quant": "fp32", "tree": shape, "tokens_per_s": 2 * ar,
             "ar_tokens_per_s": ar, "speedup_vs_ar": 2.0, "mean_acceptance_length": 6.0,
             "target_forwards_per_token": 0.2, "ar_target_forwards_per_token": 1.0, "outputs_equal_ar": True}
        if block:
            b["drafter_block_size"] = block
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps(b))
    write_report(tmp_path)
    with open(tmp_path / "report.csv") as f:
        ar = {row["model"]: row["tokens_per_s"] for row in csv.DictReader(f) if row["kind"] == "ar"}
    assert ar == {"tiny fp32": "7.0", "tiny_wide fp32, drafter block 16": "9.0",
                  "tiny_wide fp32, drafter block 8": "8.0"}


@needs_cpu_library
def test_bench_trees_are_measured_as_named_in_one_run_and_reported(tmp_path, kdtree_cache):
    """bench.trees: more shapes in the same alternating rounds as AR and `tree`, each a row of bench.json and of
    the report; a shape runs as its spec says (`prune` or not, whatever tree.prune_experts is)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def main(", "import os\n"]}))
    run = tmp_path / "runs" / "one"
    _kdtree("-m", "kdtree.run", "pipeline=bench", "backend=cpu", "tree=ddtree", "tree.width=2", "tree.depth=3",
            "tree.budget=4", "tree.prune_experts=true", "bench.max_new_tokens=12", "bench.repeats=1",
            f"bench.prompts={prompts}", "bench.trees=[chain-d3,ddtree-w2-d3-b6-prune]", f"cache_dir={kdtree_cache}",
            f"hydra.run.dir={run}", "load.progress=false")
    b = json.loads((run / "bench.json").read_text())
    assert b["tree"]["prune_experts"] is True and b["decode_speedup_vs_ar"] > 0
    shapes = [(t["tree"]["kind"], t["tree"]["budget"], t["tree"]["prune_experts"]) for t in b["trees"]]
    assert shapes == [("chain", 3, False), ("ddtree", 6, True)]
    assert b["outputs_equal_ar"] is True and all(t["outputs_equal_ar"] for t in b["trees"])
    build = b["provenance"]["backend_build"]          # which library and kernels the figures came from
    assert "error" not in build, build
    assert build["name"] == "cpu" and build["abi"] == native.ABI_VERSION and len(build["sha256"]) == 16
    assert build["host_kernels"] in ("avx512", "avx2", "generic")
    for t in b["trees"]:
        assert t["speedup_vs_ar"] == pytest.approx(t["tokens_per_s"] / b["ar_tokens_per_s"])
    # prompt by prompt: AR's seconds over the tree's, in the prompts' order, for `tree` and every extra shape; the
    # whole set's speedup (same tokens) lies between the prompts' own
    ar_s = [p["seconds"] for p in b["ar"]["per_prompt"]]
    for row, run_pp in ((b, b["result"]["per_prompt"]), *((t, None) for t in b["trees"])):
        pp = row["per_prompt_speedup_vs_ar"]
        assert len(pp) == 2 and all(x > 0 for x in pp)
        if run_pp is not None:
            assert pp == pytest.approx([a / p["seconds"] for a, p in zip(ar_s, run_pp)])
        assert min(pp) * 0.999 <= row["speedup_vs_ar"] <= max(pp) * 1.001
    assert b["per_prompt_acceptance"] == pytest.approx(
        [sum(p["acceptance_lengths"]) / len(p["acceptance_lengths"]) for p in b["result"]["per_prompt"]])
    _kdtree("-m", "kdtree.report", str(tmp_path / "runs"))
    with open(tmp_path / "runs" / "report.csv") as f:
        kinds = [(row["kind"], row["budget"]) for row in csv.DictReader(f)]
    assert kinds == [("ar", "0"), ("chain", "3"), ("ddtree prune", "4"), ("ddtree prune", "6")]


@needs_cpu_library
def test_a_chain_is_recorded_with_the_budget_it_decodes(tmp_path, kdtree_cache):
    """tree=chain tree.depth=3: bench.json and the report say budget 3 (a chain verifies its depth), not chain.yaml's
    tree.budget=7, which a chain ignores; bench.json names the drafter's block size (which drafter drafted)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def main("]}))
    run = tmp_path / "runs" / "chain"
    _kdtree("-m", "kdtree.run", "pipeline=bench", "backend=cpu", "tree=chain", "tree.depth=3",
            "bench.max_new_tokens=8", "bench.repeats=1", f"bench.prompts={prompts}", f"cache_dir={kdtree_cache}",
            f"hydra.run.dir={run}", "load.progress=false")
    b = json.loads((run / "bench.json").read_text())
    assert (b["tree"]["kind"], b["tree"]["width"], b["tree"]["depth"], b["tree"]["budget"]) == ("chain", 1, 3, 3)
    assert b["drafter_block_size"] == 8                                   # tiny's default drafter
    _kdtree("-m", "kdtree.report", str(tmp_path / "runs"))
    with open(tmp_path / "runs" / "report.csv") as f:
        assert [(row["kind"], row["budget"]) for row in csv.DictReader(f)] == [("ar", "0"), ("chain", "3")]
