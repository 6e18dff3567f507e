"""bench_peer: kdtree next to llama.cpp (llama-cpp-python, the model exported as a deepseek2 GGUF: F32, or BF16 for
quant=bf16) on the bench prompts, same new tokens, same threads, greedy; llama.cpp, kdtree AR and kdtree's tree
alternate for `rounds` rounds and the fastest round of each is kept.

    pip install -e '.[peer]'                                  # llama-cpp-python: compiles llama.cpp, ~15 min
    python -m kdtree.run pipeline=bench_peer backend=cpu      # 1 thread; bench_peer.json in the run dir
    python -m kdtree.run pipeline=bench_peer backend=cpu bench_peer.threads=2 tree=chain tree.depth=7
    python -m kdtree.run pipeline=bench_peer backend=cpu tree.budget=8 'bench_peer.trees=[ddtree-w4-d7-b6,chain-d7]'

With bench_peer.trees, every shape (`tree` first) runs in the same alternating rounds, and the fastest is the one
reported as tree_tokens_per_s / tree_vs_peer: the best shape is chosen against the same llama.cpp figures.

The prompt is tokenized with the project's tokenizer and fed to llama.cpp as ids (the GGUF's ids are the
project's), so both engines see the same ids; tokens_equal says whether llama.cpp's greedy tokens equal
kdtree's AR tokens on every prompt (and the tree's equal AR's: the lossless invariant). Tokens/s = new tokens /
seconds of the whole call (prefill + decode), summed over the prompts, as in pipeline=bench; decode tok/s (the
*_decode_tokens_per_s fields) = the tokens after the first over the time after the first token. Both engines prefill
every prompt cold in every round: llama.cpp is reset before each prompt, and kdtree's prefix cache is off during the
timed runs (bench.cold_prefill; with it on, kdtree would prefill a prompt only in the first round).

The exports (the model's GGUF, and one per bench_peer.peer_dtypes) are written once into <cache_dir>/gguf and reused by
later runs while the checkpoint's files, the model/quant config and the GGUF writer are unchanged
(bench_peer.gguf_cache=false: into the run dir, every run, as before).

On a host with Intel AMX, llama.cpp's repacked weight buffers are off (bench_peer.repack, null = that rule): there its
AMX buffer aborts the process on a quantized deepseek2 GGUF (docs/measurements.md, 11th session).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import numpy as np
from omegaconf import OmegaConf

from kdtree.config.validate import peer_gguf, peer_tree_shapes
from kdtree.engine import AR_TREE, Engine, EngineState
from kdtree.errors import ConfigError, PipelineError
from kdtree.serve.status import make_status  # noqa: F401  (declared: the engine process's status.json)
from kdtree.stages.bench import (_faster, _run_set, _same_tokens, calibrate_policies, held_bytes, load_prompts,
                                 provenance)
from kdtree.checkpoint.to_gguf import DTYPES, file_dtype
from kdtree.stages.export_gguf import cached_export, export

SIDE = "host"
INSTALL = "pip install -e '.[peer]'"


@dataclass
class BenchPeerConfig:
    gguf: str = ""  # an exported GGUF to reuse; empty = export the model first (see gguf_cache)
    gguf_cache: bool = True  # exports kept in <cache_dir>/gguf and reused while checkpoint, config and writer hold;
                             # false = into the run dir, every run
    threads: int = 1  # llama.cpp n_threads and kdtree's OpenMP threads, the same for both
    rounds: int = 3  # llama.cpp, kdtree AR and kdtree tree alternate; the fastest round of each is kept
    # more tree shapes measured in the same alternating rounds, e.g. [ddtree-w4-d7-b6,chain-d7] (kind, then any of
    # wN dN bN; the rest from `tree`); the fastest shape (with `tree`) is reported as tree_tokens_per_s
    trees: List[str] = field(default_factory=list)
    # more llama.cpp rows on the same model exported in other GGUF types (q8_0, q4_0, bf16, f32), measured in the
    # same alternating rounds: the peer's quantized speed beside kdtree's own format (e.g. INT4 experts + BF16)
    peer_dtypes: List[str] = field(default_factory=list)
    # llama.cpp's repacked weight buffers (its model param use_extra_bufts; `--no-repack` on its command line):
    # null = auto, off on a host with Intel AMX -- there llama.cpp (0.3.36) puts quantized (Q8_0, Q4_0) weights in its
    # AMX buffer and aborts on the deepseek2 graph (GGML_ASSERT(*cur_backend_id != -1)) -- and on elsewhere, its default
    repack: Optional[bool] = None


CONFIG = BenchPeerConfig  # cfg.bench_peer: this stage's options (kdtree/pipeline/registry.py)


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(f"pipeline=bench_peer needs llama-cpp-python, which is not installed; run {INSTALL} "
                          f"(compiles llama.cpp from source, ~15 min)") from None
    return llama_cpp


def limit_threads(n: int) -> Dict[str, int]:
    """kdtree's compute threads in this process = n: OpenMP (the native library's kernels) and OpenBLAS
    (numpy's matmuls), where loaded. -> {runtime: n} for what was set."""
    done = {}
    from kdtree.backends.native import set_loaded_threads
    got = set_loaded_threads(n)                                         # backend.threads (process-wide)
    if got is not None:
        done["kdtree"] = got
    libgomp = ctypes.util.find_library("gomp")
    if libgomp:
        try:
            ctypes.CDLL(libgomp).omp_set_num_threads(ctypes.c_int(n))   # the loaded libgomp: same handle
            done["openmp"] = n
        except (OSError, AttributeError):
            pass
    try:                                                                # numpy's bundled OpenBLAS, if any
        maps = Path("/proc/self/maps").read_text().split()
    except OSError:
        maps = []
    for lib in sorted({p for p in maps if "openblas" in p.lower() and ".so" in p}):
        for fn in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            f = getattr(ctypes.CDLL(lib), fn, None)
            if f is not None:
                f(ctypes.c_int(n))
                done["openblas"] = n
                break
    return done


def _peer_set(llm, prompts_ids: List[List[int]], max_new_tokens: int, eos_id: int) -> dict:
    """llama.cpp greedy (temperature 0) on every prompt: tokens (eos not included, like kdtree) and seconds; the
    decode rate as kdtree's (bench._run_set): the tokens after the first over the time after the first token."""
    per_prompt, tokens, seconds, first_s = [], 0, 0.0, 0.0
    for ids in prompts_ids:
        llm.reset()                                           # no KV prefix reuse from the previous round
        out: List[int] = []
        t0 = time.perf_counter()
        t_first = None
        for tok in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            if t_first is None:                                # the prompt's prefill and the first token
                t_first = time.perf_counter() - t0
            if tok == eos_id:
                break
            out.append(int(tok))
            if len(out) >= max_new_tokens:
                break
        dt = time.perf_counter() - t0
        per_prompt.append({"tokens": out, "seconds": dt, "first_token_seconds": t_first or dt})
        tokens += len(out)
        seconds += dt
        first_s += t_first or dt
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
            "decode_tokens_per_s": (tokens - len(prompts_ids)) / max(seconds - first_s, 1e-9),
            "per_prompt": per_prompt}


def _first_difference(a: List[int], b: List[int]) -> int:
    """Index of the first differing token (len of the shorter when one is a prefix), -1 when equal."""
    if a == b:
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def host_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has Intel AMX (the amx_tile flag): where llama.cpp's AMX weight buffer is in play."""
    try:
        return any(line.startswith("flags") and "amx_tile" in line.split() for line in open(cpuinfo))
    except OSError:
        return False


def peer_repack(conf: "BenchPeerConfig", cpuinfo: str = "/proc/cpuinfo") -> bool:
    """bench_peer.repack resolved: the setting, or (null) off on an AMX host, on elsewhere."""
    return (not host_has_amx(cpuinfo)) if conf.repack is None else bool(conf.repack)


@contextmanager
def _extra_bufts(llama_cpp, on: bool) -> Iterator[None]:
    """Llama() below takes its model params from llama_model_default_params() and exposes no use_extra_bufts
    argument: while it loads, those defaults carry `on` (llama.cpp's default is on, so nothing changes then)."""
    mod = getattr(getattr(llama_cpp, "llama", None), "llama_cpp", None)   # what llama_cpp/llama.py calls
    default = getattr(mod, "llama_model_default_params", None)
    if on or default is None or not any(f[0] == "use_extra_bufts" for f in getattr(
            getattr(llama_cpp, "llama_model_params", None), "_fields_", [])):
        yield
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    mod.llama_model_default_params = params
    try:
        yield
    finally:
        mod.llama_model_default_params = default


def open_peer(path: str, threads: int, n_ctx: int, n_batch: int, logits_all: bool = False, repack: bool = True):
    """llama.cpp on the GGUF: CPU, F32 KV cache (the weights are F32 too), no flash attention, n threads;
    repack=False: no repacked weight buffers (see BenchPeerConfig.repack)."""
    llama_cpp = _llama_cpp()
    f32 = int(getattr(llama_cpp, "GGML_TYPE_F32", 0))
    with _extra_bufts(llama_cpp, repack):
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                               n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, type_k=f32, type_v=f32,
                               flash_attn=False, logits_all=logits_all, seed=0, verbose=False)


def prompt_logits_difference(path: str, model, ids: List[int], threads: int, repack: bool = True) -> float:
    """max |llama.cpp logits - kdtree logits| over the prefill rows of one prompt (parity, not speed)."""
    llm = open_peer(path, threads, n_ctx=len(ids) + 8, n_batch=max(len(ids), 32), logits_all=True,
                    repack=repack)
    llm.reset()
    llm.eval(list(ids))
    peer = np.asarray(llm.scores[:len(ids)], np.float32)                           # [T, V]
    ours, _ = model.forward(np.asarray(ids, np.int32), np.arange(len(ids), dtype=np.int32),
                            model.new_cache(len(ids)))
    return float(np.abs(peer - ours).max())


def gguf_step_bytes(path: str, top_k: int, n_experts: int) -> int:
    """Bytes one decode step (one row) of llama.cpp reads from this GGUF: every tensor but the token embedding (one
    row of it), each layer's packed routed experts (blk.L.ffn_*_exps) at top_k of n_experts."""
    from gguf import GGUFReader
    total = 0.0
    for t in GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            continue
        total += int(t.n_bytes) * (top_k / n_experts if "_exps." in t.name and n_experts else 1)
    return int(total)


def kdtree_step_bytes(engine) -> Optional[int]:
    """Bytes one decode step (one row) of kdtree streams, as its library holds them: every linear but the routed
    experts, and top_k experts of each MoE layer (bench.held_bytes); None where the backend does not say."""
    split = held_bytes(engine)
    if split is None:
        return None
    dense, per_expert = split
    return int(dense + int(engine.cfg.model.num_experts_per_tok or 1) * sum(per_expert.values()))


def _shape_name(t) -> str:
    if t.kind == "ar":
        return "ar"
    extra = (f" {t.policy}" if t.get("policy", "fixed") != "fixed" else "") + (" prune" if t.get("prune_experts") else "")
    return f"{t.kind} w{t.width} d{t.depth} b{t.budget}{extra}"


def run(ctx, conf: BenchPeerConfig) -> dict:
    prompts, max_new_tokens = ctx.cfg.bench.prompts, int(ctx.cfg.bench.max_new_tokens)  # bench's prompt set
    rounds, threads, gguf, trees = conf.rounds, conf.threads, conf.gguf, conf.trees

    def exported(dtype: str = "") -> dict:                      # the model as a GGUF of this type
        if conf.gguf_cache:
            return cached_export(ctx, dtype)
        return export(ctx, str(Path(ctx.run_dir) / f"{ctx.cfg.model.name}-{dtype}.gguf") if dtype else "",
                      dtype=dtype)
    _llama_cpp()                                                # before any work: the one-line install hint
    for d in conf.peer_dtypes:                                  # before any work too: the key that is wrong
        if str(d).lower() not in DTYPES:
            raise ConfigError(f"bench_peer.peer_dtypes has {d!r}, not a GGUF type the export writes; use any of "
                              f"{', '.join(DTYPES)}")
    cfg = ctx.cfg
    if cfg.backend.name == "cuda" or int(cfg.tp.size) != 1:
        raise ConfigError(f"pipeline=bench_peer compares CPU engines at tp=1; got backend={cfg.backend.name} "
                          f"tp={cfg.tp.size}: use backend=cpu (or numpy) tp=1")
    texts = load_prompts(prompts)           # checked at start-up on a local host; a remote one's before the load
    set_threads = limit_threads(threads)
    state = EngineState.of(ctx)
    if state.engine is None:
        state.engine = Engine.from_config(cfg, status=ctx.status)
    engine = state.engine
    path = peer_gguf(gguf) if gguf else Path(exported()["path"])
    dtype = file_dtype(path).upper()
    prompts_ids = [list(map(int, engine.tokenizer.encode(t))) for t in texts]
    longest = max(len(p) for p in prompts_ids)
    repack = peer_repack(conf)
    llm = open_peer(str(path), threads, n_ctx=longest + max_new_tokens + 16, n_batch=max(longest, 32), repack=repack)
    extra = {}                                                  # peer dtype -> (GGUF summary, llama.cpp)
    for d in dict.fromkeys(str(x).lower() for x in conf.peer_dtypes):
        if d == dtype.lower():
            continue
        summary = exported(d)
        extra[d.upper()] = (summary, open_peer(summary["path"], threads, n_ctx=longest + max_new_tokens + 16,
                                               n_batch=max(longest, 32), repack=repack))
    shapes = peer_tree_shapes(OmegaConf.merge(cfg, {"bench_peer": {"trees": list(trees)}}))
    names = [_shape_name(t) for t in shapes]
    calibrate_policies(engine, prompts_ids[0], shapes)          # tree.policy=cost's forward costs: before any round
    best: Dict[str, dict] = {}
    per_round: List[Dict[str, float]] = []                      # every round's tokens/s, by engine / shape
    load_before = os.getloadavg()                               # a busy machine stalls multi-thread barriers
    for _ in range(max(1, rounds)):                             # alternate: machine drift hits every engine alike
        runs = {"peer": _peer_set(llm, prompts_ids, max_new_tokens, engine.eos_id),
                "ar": _run_set(engine, prompts_ids, max_new_tokens, AR_TREE)}
        for d, (_, other) in extra.items():
            runs[f"peer {d}"] = _peer_set(other, prompts_ids, max_new_tokens, engine.eos_id)
        for name, t in zip(names, shapes):
            runs[name] = _run_set(engine, prompts_ids, max_new_tokens, t)
        for k, r in runs.items():
            best[k] = _faster(best.get(k), r)
        per_round.append({k: r["tokens_per_s"] for k, r in runs.items()})
    peer, ar = best["peer"], best["ar"]
    fastest = max(range(len(names)), key=lambda i: best[names[i]]["tokens_per_s"]) if names else None
    tree = ar if fastest is None else best[names[fastest]]
    has_tree = fastest is not None
    logits_diff = prompt_logits_difference(str(path), engine.model, prompts_ids[0], threads, repack)
    first_diff = [_first_difference(p["tokens"], a["tokens"]) for p, a in zip(peer["per_prompt"], ar["per_prompt"])]
    tokens_equal = all(d < 0 for d in first_diff)
    lossless_by = {n: _same_tokens(ar, best[n]) for n in names}
    lossless = all(lossless_by.values())
    E, k = int(cfg.model.n_routed_experts or 1), int(cfg.model.num_experts_per_tok or 1)
    step_bytes = {"kdtree AR": kdtree_step_bytes(engine), f"llama.cpp {dtype}": gguf_step_bytes(path, k, E),
                  **{f"llama.cpp {d}": gguf_step_bytes(summary["path"], k, E) for d, (summary, _) in extra.items()}}
    decode_rate = {"kdtree AR": ar["decode_tokens_per_s"], f"llama.cpp {dtype}": peer["decode_tokens_per_s"],
                   **{f"llama.cpp {d}": best[f"peer {d}"]["decode_tokens_per_s"] for d in extra}}
    out = {
        "peer": f"llama.cpp (llama-cpp-python {_version('llama_cpp_python')}) deepseek2 {dtype} GGUF, greedy",
        "gguf_dtype": dtype,
        "gguf": str(path), "backend": cfg.backend.name, "model": cfg.model.name, "quant": cfg.quant.method,
        "tree": OmegaConf.to_container(shapes[fastest] if has_tree else AR_TREE, resolve=True),
        "threads": threads, "threads_set": set_threads, "peer_repack": repack,
        "prompts": texts, "max_new_tokens": max_new_tokens, "rounds": rounds,
        "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],   # before, after the rounds
        "peer_ar_tokens_per_s": peer["tokens_per_s"],
        "ar_tokens_per_s": ar["tokens_per_s"],
        "tree_tokens_per_s": tree["tokens_per_s"],
        "ar_vs_peer": ar["tokens_per_s"] / max(peer["tokens_per_s"], 1e-9),
        "tree_vs_peer": tree["tokens_per_s"] / max(peer["tokens_per_s"], 1e-9),
        "tree_vs_ar": tree["tokens_per_s"] / max(ar["tokens_per_s"], 1e-9),
        # the same without each prompt's prefill and first token (both engines prefill cold, every round)
        "peer_decode_tokens_per_s": peer["decode_tokens_per_s"],
        "ar_decode_tokens_per_s": ar["decode_tokens_per_s"],
        "tree_decode_tokens_per_s": tree["decode_tokens_per_s"],
        "decode_ar_vs_peer": ar["decode_tokens_per_s"] / max(peer["decode_tokens_per_s"], 1e-9),
        "decode_tree_vs_peer": tree["decode_tokens_per_s"] / max(peer["decode_tokens_per_s"], 1e-9),
        # what one AR decode step reads (top_k experts per MoE layer) and the rate it streams that at while decoding
        "step_bytes": step_bytes,
        "decode_gb_s": {n: b * decode_rate[n] / 1e9 for n, b in step_bytes.items() if b is not None},
        "tokens_equal": tokens_equal,
        "first_difference": first_diff,                     # per prompt: first token where llama.cpp != kdtree AR
        "prompt_logits_max_abs_diff": logits_diff,          # llama.cpp vs kdtree, prefill of the first prompt
        "outputs_equal_ar": lossless,
        "mean_acceptance_length": tree["mean_acceptance_length"],
        "trees": [{"tree": OmegaConf.to_container(t, resolve=True), "tokens_per_s": best[n]["tokens_per_s"],
                   "vs_peer": best[n]["tokens_per_s"] / max(peer["tokens_per_s"], 1e-9),
                   "vs_ar": best[n]["tokens_per_s"] / max(ar["tokens_per_s"], 1e-9),
                   "decode_tokens_per_s": best[n]["decode_tokens_per_s"],
                   "decode_vs_peer": best[n]["decode_tokens_per_s"] / max(peer["decode_tokens_per_s"], 1e-9),
                   "mean_acceptance_length": best[n]["mean_acceptance_length"], "outputs_equal_ar": lossless_by[n]}
                  for n, t in zip(names, shapes)],
        "peers": [{"dtype": d, "gguf": summary["path"], "bytes": summary["bytes"],
                   "tokens_per_s": best[f"peer {d}"]["tokens_per_s"],
                   "ar_vs_it": ar["tokens_per_s"] / max(best[f"peer {d}"]["tokens_per_s"], 1e-9),
                   "tree_vs_it": tree["tokens_per_s"] / max(best[f"peer {d}"]["tokens_per_s"], 1e-9),
                   "decode_tokens_per_s": best[f"peer {d}"]["decode_tokens_per_s"],
                   "decode_ar_vs_it": ar["decode_tokens_per_s"] / max(best[f"peer {d}"]["decode_tokens_per_s"], 1e-9),
                   "tokens_equal_ar": [p["tokens"] for p in best[f"peer {d}"]["per_prompt"]]
                   == [a["tokens"] for a in ar["per_prompt"]]}
                  for d, (summary, _) in extra.items()],
        # each round's tokens/s by engine ("peer", "ar", "peer Q8_0", the shapes' names) and, paired within the
        # round, the fastest shape's (else AR's) over llama.cpp's: the spread a shared host puts on the best-of figures
        "rounds_tokens_per_s": per_round,
        "rounds_tree_vs_peer": [max([r[n] for n in names] or [r["ar"]]) / max(r["peer"], 1e-9) for r in per_round],
        "peer_result": peer, "ar": ar, "result": tree,
        "provenance": provenance(ctx),
    }
    (Path(ctx.run_dir) / "bench_peer.json").write_text(json.dumps(out, indent=2))
    pd = max(peer["decode_tokens_per_s"], 1e-9)
    rows = [(f"llama.cpp {dtype} AR", peer, 1.0, f"llama.cpp {dtype}"),
            *((f"llama.cpp {p['dtype']} AR ({p['bytes'] / 1e6:.0f} MB file)", p,
               p["tokens_per_s"] / max(peer["tokens_per_s"], 1e-9), f"llama.cpp {p['dtype']}") for p in out["peers"]),
            (f"kdtree backend={cfg.backend.name} AR", ar, out["ar_vs_peer"], "kdtree AR")]
    for i, (n, t) in enumerate(zip(names, out["trees"])):
        rows.append((f"kdtree backend={cfg.backend.name} {n}" + (" (fastest)" if i == fastest and len(names) > 1
                                                                  else ""), t, t["vs_peer"], ""))
    print(f"bench_peer: {len(texts)} prompts x {max_new_tokens} new tokens, {threads} thread(s), best of {rounds} "
          f"alternating rounds, model={cfg.model.name}, load average {load_before[0]:.1f} on {os.cpu_count()} cores")
    print(f"| {'engine':<50} | {'tokens/s':>9} | {'vs llama.cpp':>12} | {'decode tok/s':>12} | {'vs llama.cpp':>12} "
          f"| {'MB/step':>8} | {'GB/s':>5} |")
    print(f"|{'-' * 52}|{'-' * 11}|{'-' * 14}|{'-' * 14}|{'-' * 14}|{'-' * 10}|{'-' * 7}|")
    for label, r, ratio, key in rows:
        b = step_bytes.get(key)
        mb, gbs = (f"{b / 1e6:8.0f}", f"{out['decode_gb_s'][key]:5.1f}") if b is not None else (f"{'-':>8}", f"{'-':>5}")
        print(f"| {label:<50} | {r['tokens_per_s']:>9.1f} | {ratio:>12.2f} | {r['decode_tokens_per_s']:>12.1f} | "
              f"{r['decode_tokens_per_s'] / pd:>12.2f} | {mb} | {gbs} |")
    if len(per_round) > 1:
        print("per round, the fastest kdtree row vs llama.cpp's in the same round: "
              + " / ".join(f"{v:.2f}x" for v in out["rounds_tree_vs_peer"]))
    diff = "" if tokens_equal else ", first difference (prompt, token): " + ", ".join(
        f"({i}, {d})" for i, d in enumerate(first_diff) if d >= 0)
    print(f"tokens_equal={tokens_equal} (llama.cpp greedy == kdtree AR{diff}), logits max |diff| {logits_diff:.2e} "
          f"(first prompt), tree lossless={lossless} "
          f"-> {Path(ctx.run_dir) / 'bench_peer.json'}")
    if not lossless:
        broken = ", ".join(n for n, ok in lossless_by.items() if not ok)
        raise PipelineError(f"tree {broken}: output differs from AR on the bench prompts: the lossless invariant is "
                            f"broken (see {Path(ctx.run_dir) / 'bench_peer.json'}); report this as a bug")
    return {k: out[k] for k in ("peer_ar_tokens_per_s", "ar_tokens_per_s", "tree_tokens_per_s", "ar_vs_peer",
                                "tree_vs_peer", "tokens_equal")}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"
