"""pipeline=bench_peer: without llama-cpp-python, one line naming the install; with it (the `peer` extra, not part
of CI's install), a short real run where llama.cpp's F32 greedy tokens equal kdtree's on the tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args, pythonpath=()):
    env = dict(os.environ, KDTREE_RUNS=str(tmp_path / "runs"), KDTREE_CACHE=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kdtree.run", "pipeline=bench_peer", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)


def test_without_llama_cpp_one_line_names_the_install(tmp_path):
    # an installed llama-cpp-python is hidden by a package of the same name that fails to import, as a missing one does
    hide = tmp_path / "hide" / "llama_cpp"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError(\"No module named 'llama_cpp'\")\n")
    r = _run(tmp_path, "backend=cpu", pythonpath=[hide.parent])
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "needs llama-cpp-python" in lines[0] and "pip install -e '.[peer]'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not list((tmp_path / "runs").rglob("*.gguf"))                   # failed before any work


def test_llama_cpp_greedy_equals_kdtree_on_the_tiny_model(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install -e '.[peer]')")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def __init__(self, ", "import os\nimport sys\n\n"]}))
    r = _run(tmp_path, "backend=cpu", "tree=chain", "tree.depth=7", f"bench.prompts={prompts}",
             "bench.max_new_tokens=24", "bench_peer.rounds=2", "bench_peer.trees=[ddtree-w2-d7-b5]",
             "bench_peer.peer_dtypes=[q8_0]")
    assert r.returncode == 0, r.stderr[-2000:]
    (out,) = list((tmp_path / "runs").rglob("bench_peer.json"))
    res = json.loads(out.read_text())
    assert res["tokens_equal"] is True and res["first_difference"] == [-1, -1]
    assert res["outputs_equal_ar"] is True and res["threads"] == 1
    from kdtree.stages.bench_peer import host_has_amx
    assert res["peer_repack"] is (not host_has_amx())      # auto: an AMX host's llama.cpp aborts on Q8_0 otherwise
    assert 0 < res["prompt_logits_max_abs_diff"] < 1e-4                    # llama.cpp's logits are kdtree's
    assert [len(p["tokens"]) for p in res["peer_result"]["per_prompt"]] == [24, 24]
    for key in ("peer_ar_tokens_per_s", "ar_tokens_per_s", "tree_tokens_per_s"):
        assert res[key] > 0
    assert res["ar_vs_peer"] == pytest.approx(res["ar_tokens_per_s"] / res["peer_ar_tokens_per_s"])
    # decode alone (the tokens after the first over the time after it), for both engines: above the whole-call rate
    for who, res_of in (("peer", res["peer_result"]), ("ar", res["ar"])):
        assert res[f"{who}_decode_tokens_per_s"] == res_of["decode_tokens_per_s"] > res_of["tokens_per_s"]
    assert res["decode_ar_vs_peer"] == pytest.approx(res["ar_decode_tokens_per_s"] / res["peer_decode_tokens_per_s"])
    assert all(0 < p["first_token_seconds"] < p["seconds"] for p in res["peer_result"]["per_prompt"])
    assert "| llama.cpp F32 AR" in r.stdout and "tokens_equal=True" in r.stdout and "decode tok/s" in r.stdout
    (q8,) = res["peers"]                                  # an extra llama.cpp row on a Q8_0 export, same rounds
    assert q8["dtype"] == "Q8_0" and q8["tokens_per_s"] > 0 and q8["bytes"] < 0.4 * Path(res["gguf"]).stat().st_size
    assert q8["decode_tokens_per_s"] > q8["tokens_per_s"] and q8["decode_ar_vs_it"] > 0
    # what one decode step reads: kdtree's fp32 linears are the F32 GGUF's tensors (less the embedding, top-2 of 8
    # experts each), Q8_0 is 34 bytes per 32 weights; GB/s = those bytes x decode tok/s
    sb = res["step_bytes"]
    assert sb["kdtree AR"] == pytest.approx(sb["llama.cpp F32"], rel=0.02)
    assert sb["llama.cpp Q8_0"] == pytest.approx(sb["llama.cpp F32"] * 34 / 128, rel=0.05)
    assert res["decode_gb_s"]["kdtree AR"] == pytest.approx(sb["kdtree AR"] * res["ar_decode_tokens_per_s"] / 1e9)
    assert "MB/step" in r.stdout
    assert "| llama.cpp Q8_0 AR" in r.stdout
    # both shapes ran in the same rounds; the fastest is the one reported as the tree
    shapes = [(t["tree"]["kind"], t["tree"]["width"], t["tree"]["budget"]) for t in res["trees"]]
    assert shapes == [("chain", 1, 7), ("ddtree", 2, 5)] and all(t["outputs_equal_ar"] for t in res["trees"])
    assert res["tree_tokens_per_s"] == max(t["tokens_per_s"] for t in res["trees"])
    assert "ddtree w2 d7 b5" in r.stdout and "(fastest)" in r.stdout
    # every round's figures, the best-of figures among them; the paired per-round ratio printed under the table
    rounds = res["rounds_tokens_per_s"]
    assert len(rounds) == 2 and all(set(x) == {"peer", "ar", "peer Q8_0", "chain w1 d7 b7", "ddtree w2 d7 b5"}
                                    for x in rounds)
    assert res["peer_ar_tokens_per_s"] == max(x["peer"] for x in rounds)
    assert res["tree_tokens_per_s"] == max(max(x["chain w1 d7 b7"], x["ddtree w2 d7 b5"]) for x in rounds)
    assert res["rounds_tree_vs_peer"] == [pytest.approx(max(x["chain w1 d7 b7"], x["ddtree w2 d7 b5"]) / x["peer"])
                                          for x in rounds]
    assert "per round, the fastest kdtree row vs llama.cpp's in the same round: " in r.stdout


def test_threads_are_limited_for_kdtree_openmp(tmp_path):
    # in a fresh process: the native library's OpenMP runtime then reports the limit bench_peer set
    code = ("import ctypes, ctypes.util\n"
            "from kdtree.backends.native import load_library\n"
            "lib = load_library('cpu')\n"
            "lib.set_threads(2)\n"                                      # an engine's backend.threads
            "from kdtree.stages.bench_peer import limit_threads\n"
            "gomp = ctypes.CDLL(ctypes.util.find_library('gomp'))\n"
            "for n in (1, 3):\n"
            "    done = limit_threads(n)\n"
            "    assert done['openmp'] == n and done['kdtree'] == n, done\n"
            "    print(gomp.omp_get_max_threads(), lib.threads)\n")
    if not (REPO / "native" / "build" / "libkdtree_cpu.so").exists():
        pytest.skip("native library not built (make native)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1", "3", "3"]        # OpenMP's and the library's own (kd_threads)


def test_llama_cpp_on_the_bf16_export(tmp_path):
    """quant=bf16: llama.cpp reads the BF16 GGUF (the same BF16 weights as kdtree). Its CPU BF16 matmul rounds the
    activations to BF16 too, kdtree keeps them f32 (W16A32): logits close, greedy tokens not promised equal."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install -e '.[peer]')")
    r = _run(tmp_path, "backend=cpu", "quant=bf16", "tree=chain", "tree.depth=7", "bench.max_new_tokens=16",
             "bench_peer.rounds=1")
    assert r.returncode == 0, r.stderr[-2000:]
    (out,) = list((tmp_path / "runs").rglob("bench_peer.json"))
    res = json.loads(out.read_text())
    assert res["gguf_dtype"] == "BF16" and res["gguf"].endswith("-bf16.gguf") and "| llama.cpp BF16 AR" in r.stdout
    assert res["outputs_equal_ar"] is True and 0 < res["prompt_logits_max_abs_diff"] < 0.2
    # the export sits in the cache, not in the run dir, and the next run reuses it
    assert Path(res["gguf"]).parent == tmp_path / "cache" / "gguf" and not list((tmp_path / "runs").rglob("*.gguf"))
    r = _run(tmp_path, "backend=cpu", "quant=bf16", "tree=ar", "bench.max_new_tokens=4", "bench_peer.rounds=1")
    assert r.returncode == 0 and f"reusing {res['gguf']}" in r.stdout, r.stderr[-2000:]
    assert len(list((tmp_path / "cache" / "gguf").glob("*.gguf"))) == 1


def test_an_unknown_peer_dtype_names_the_key(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install -e '.[peer]')")
    r = _run(tmp_path, "backend=cpu", "tree=ar", "bench_peer.rounds=1", "bench_peer.peer_dtypes=[q3_k]")
    assert r.returncode != 0 and "bench_peer.peer_dtypes has 'q3_k'" in r.stderr and "q8_0" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not list((tmp_path / "runs").rglob("*.gguf"))


def test_every_measured_shape_has_its_own_row():
    # the rows are keyed by these names: a pruned and a plain chain of one depth once shared a row (and a figure)
    from omegaconf import OmegaConf

    from kdtree.config.validate import tree_shapes
    from kdtree.stages.bench_peer import _shape_name
    cfg = OmegaConf.create({"tree": {"kind": "chain", "width": 1, "depth": 7, "budget": 7, "policy": "fixed",
                                     "prune_experts": True},
                            "model": {"drafter": {"block_size": 8}},
                            "bench_peer": {"trees": ["chain-d7", "ddtree-w4-d7-b8", "ddtree-w4-d7-b8-prune"]}})
    shapes = tree_shapes(cfg, "bench_peer")
    names = [_shape_name(t) for t in shapes]
    assert names == ["chain w1 d7 b7 prune", "chain w1 d7 b7", "ddtree w4 d7 b8", "ddtree w4 d7 b8 prune"]
    # and each runs as named: a shape without `prune` does not inherit tree.prune_experts=true (the shapes are
    # `tree` with the item's parts; an item once inherited it, so 'chain-d7' beside a pruned tree measured a pruned
    # chain)
    assert [bool(t.prune_experts) for t in shapes] == [True, False, False, True]


def test_repack_auto_is_off_exactly_on_an_amx_host(tmp_path):
    # llama.cpp 0.3.36 built on an AMX host puts Q8_0 / Q4_0 weights in its AMX buffer and aborts on the deepseek2
    # graph (GGML_ASSERT(*cur_backend_id != -1)): bench_peer.repack=null turns its repacked buffers off there only
    from kdtree.stages.bench_peer import BenchPeerConfig, host_has_amx, peer_repack
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert host_has_amx(str(amx)) is True and host_has_amx(str(plain)) is False
    assert host_has_amx(str(tmp_path / "missing")) is False
    auto = BenchPeerConfig()
    assert peer_repack(auto, str(amx)) is False and peer_repack(auto, str(plain)) is True
    assert peer_repack(BenchPeerConfig(repack=True), str(amx)) is True               # an explicit setting wins
    assert peer_repack(BenchPeerConfig(repack=False), str(plain)) is False


def test_repack_off_reaches_llama_cpps_model_params():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install -e '.[peer]')")
    from kdtree.stages.bench_peer import _extra_bufts
    defaults = llama_cpp.llama.llama_cpp.llama_model_default_params        # what Llama() loads its params from
    assert defaults().use_extra_bufts is True                                # llama.cpp's default: on
    with _extra_bufts(llama_cpp, False):
        assert llama_cpp.llama.llama_cpp.llama_model_default_params().use_extra_bufts is False
    assert llama_cpp.llama.llama_cpp.llama_model_default_params is defaults  # restored
    with _extra_bufts(llama_cpp, True):
        assert llama_cpp.llama.llama_cpp.llama_model_default_params is defaults
