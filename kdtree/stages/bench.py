"""bench: the fixed prompt set with tree=ar as the baseline and the composed tree, in one process.

Writes bench.json: tokens/s (prefill included; decode_tokens_per_s: the tokens after the first over the time after
the prefill; every prompt is prefilled cold in every round, the prefix cache off during the timed runs), speedup vs
AR, target forwards per token, mean acceptance length and its histogram, per-stage seconds, the speedup and acceptance
prompt by prompt (per_prompt_speedup_vs_ar, per_prompt_acceptance), per-prompt outputs (for exact reproduction),
whether the tree output equals AR token for token, and the provenance needed to rerun the row (overrides, commit,
seeds, versions, CPU/GPU, native library build). With sampling.temperature > 0 both AR and the
tree sample (prompt i with the seed sampling.for_sample(i), the same for both, so outputs_equal_ar still holds) and
bench.json reports the acceptance length under sampling next to greedy's (one greedy tree pass).
"""
from __future__ import annotations

import collections
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from omegaconf import OmegaConf

from kdtree.backends import native
from kdtree.config.validate import read_prompts, tree_shapes
from kdtree.backends.native_forward import LIBRARY_CLOCK
from kdtree.decode.result import STAGES
from kdtree.decode.state import tree_shape
from kdtree.engine import AR_TREE, Engine, EngineState
from kdtree.errors import PipelineError
from kdtree.serve.status import make_status  # noqa: F401  (declared: the engine process's status.json)

SIDE = "host"


@dataclass
class BenchConfig:
    prompts: str = ""  # a JSON file {"prompts": [...]}; empty = kdtree/assets/bench_prompts.json
    max_new_tokens: int = 48  # per prompt
    repeats: int = 3  # AR and tree runs alternate; the fastest of the repeats is kept
    # structured output on every prompt: "" none | json (any JSON object) | a .json schema file | a .lark grammar file
    grammar: str = ""
    # more tree shapes measured in the same alternating rounds, e.g. [chain-d7,ddtree-w4-d7-b8,ddtree-b8-prune] (kind,
    # then any of wN/dN/bN/prune; the rest from tree.*): tokens/s, speedup, acceptance, MoE columns in "trees"
    trees: List[str] = field(default_factory=list)


CONFIG = BenchConfig  # cfg.bench: this stage's options (kdtree/pipeline/registry.py)


def _shape(tree_cfg, block_size: int) -> dict:
    """tree.* as decoded (decode.state.tree_shape): a chain's width is 1 and its budget its depth, whatever
    tree.budget says (chain.yaml's 7)."""
    t = OmegaConf.to_container(tree_cfg, resolve=True)
    if t.get("kind") != "ar":
        t["width"], t["depth"], t["budget"] = tree_shape(tree_cfg, block_size)
    return t


load_prompts = read_prompts   # the prompt texts of bench.prompts (the bench stages' and tools' name for it)


def _git_commit() -> str:
    repo = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return r.stdout.strip() + ("-dirty" if dirty else "") if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _gpu_model() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("numpy", "torch", "hydra-core", "safetensors", "cffi", "kdtree"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _backend_build(cfg) -> dict:
    if cfg.backend.name == "numpy":
        return {"name": "numpy"}
    try:
        return {"name": cfg.backend.name, **native.library_info(cfg.backend.name)}
    except Exception as e:  # provenance must never fail the benchmark
        return {"name": cfg.backend.name, "error": f"{type(e).__name__}: {e}"}


def provenance(ctx, sampling=None) -> dict:
    # Hydra writes the command-line overrides of every run (and of every multirun job) next to it.
    saved = Path(ctx.run_dir) / ".hydra" / "overrides.yaml"
    overrides = list(OmegaConf.load(saved)) if saved.is_file() else []
    cfg = ctx.cfg
    rerun = list(overrides)
    if sampling is not None and not sampling.greedy and not any(o.startswith("sampling.seed=") for o in rerun):
        rerun.append(f"sampling.seed={sampling.seed}")  # the random seed this run drew: the rerun replays it
    return {
        "overrides": overrides,
        "rerun": "python -m kdtree.run " + " ".join(f"'{o}'" for o in rerun),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "git_commit": _git_commit(),
        "seeds": {"model": int(cfg.model.seed),
                  "sampling": None if sampling is None or sampling.greedy else sampling.seed},
        "versions": _versions(),
        "cpu": _cpu_model(), "cores": os.cpu_count(), "gpu": _gpu_model(),
        "backend_build": _backend_build(cfg),
        "host": platform.node(),
    }


def load_grammar(engine, spec: str):
    """bench.grammar -> a GrammarSpec (None for "")."""
    if not spec:
        return None
    g = engine.grammars()
    if spec == "json":
        return g.json_schema({"type": "object"}, param="bench.grammar")
    p = Path(spec).expanduser()
    if not p.is_file():
        raise PipelineError(f"bench.grammar={spec!r}: no such file; use json, a .json schema file or a .lark file")
    if p.suffix == ".lark":
        return g.lark(p.read_text(), param="bench.grammar")
    try:
        schema = json.loads(p.read_text())
    except ValueError as e:
        raise PipelineError(f"bench.grammar={spec!r}: not JSON ({e}); give a JSON schema or a .lark file") from None
    return g.json_schema(schema, param="bench.grammar")


def held_bytes(engine) -> Optional[Tuple[float, Dict[int, float]]]:
    """What the target's library holds (NativeTarget.weight_bytes), split: (bytes of every linear but the routed
    experts, {MoE layer: one routed expert's bytes}); None where the backend does not say."""
    held = getattr(engine.model, "weight_bytes", None)
    if held is None:
        return None
    E = int(engine.cfg.model.n_routed_experts or 1)
    dense, per_expert = 0.0, {}
    for name, (b, _n) in held().items():
        if ".mlp.experts." in name:                   # model.layers.L.mlp.experts.e.*
            layer = int(name.split(".")[2])
            per_expert[layer] = per_expert.get(layer, 0.0) + b / E
        else:
            dense += b
    return dense, per_expert


def moe_columns(engine, stats: dict, forwards: int, tokens: int, drafts: int = 0) -> dict:
    """The MoE tax of a run: per MoE layer the mean distinct routed experts per target forward (a forward streams
    the union of its rows' experts), and where the backend says what it holds (NativeTarget.weight_bytes) the target
    bytes streamed per committed token (dense matrices every forward + each forward's expert union; prefill
    included), and the drafter's: each of its matrices once per draft round (NativeDrafter.weight_bytes; a lower
    bound of what extend + draft read). {} where the target does not count (CUDA, tp)."""
    if not stats:
        return {}
    per_layer = {str(i): st["experts"] / max(st["forwards"], 1) for i, st in stats.items()}
    out = {"experts_per_forward": per_layer,
           "mean_experts_per_forward": sum(per_layer.values()) / len(per_layer),
           "rows_per_forward": sum(st["rows"] for st in stats.values()) / max(sum(st["forwards"] for st in stats.values()), 1)}
    split = held_bytes(engine)
    if split is None:
        return out
    dense, per_expert = split
    routed = sum(per_expert.get(i, 0.0) * st["experts"] for i, st in stats.items())
    out["bytes_per_token"] = (forwards * dense + routed) / max(tokens, 1)
    out["expert_bytes_per_token"] = routed / max(tokens, 1)
    dheld = getattr(engine.drafter, "weight_bytes", None) if drafts else None
    out["draft_bytes_per_token"] = drafts * sum(b for b, _n in dheld().values()) / max(tokens, 1) if dheld else 0.0
    return out


def bytes_bound(ar_moe: dict, moe: dict) -> Optional[float]:
    """The speedup over AR a perfectly streaming engine could reach on this run's tokens: AR's bytes per token over
    the tree's (target + drafter). Where decoding is memory-bound no kernel beats it; None without byte counts."""
    need = moe.get("bytes_per_token", 0.0) + moe.get("draft_bytes_per_token", 0.0)
    return ar_moe["bytes_per_token"] / need if ar_moe.get("bytes_per_token") and need else None


@contextmanager
def cold_prefill(engine) -> Iterator[None]:
    """The engine's prefix cache off meanwhile (neither looked up nor filled), then as it was: a bench repeats its
    prompts round after round and runs every shape on the same ones, so with the cache on only the first run of a
    prompt would prefill it (and llama.cpp in bench_peer, reset before each prompt, prefills every time: on
    k26_mini the cached prefills had made kdtree's tokens/s 1.22x its cold figure)."""
    sched = engine.scheduler
    if sched.prefix_cache is None:
        yield
        return
    was = sched.prefix_enabled
    sched.set_prefix_cache(False)
    try:
        yield
    finally:
        sched.set_prefix_cache(was)


def _run_set(engine, prompts_ids, max_new_tokens, tree_cfg, sampling=None, grammar=None) -> dict:
    """sampling None/greedy: argmax; else prompt i samples with sampling.for_sample(i). grammar: a GrammarSpec.
    Every prompt prefilled cold (cold_prefill)."""
    with cold_prefill(engine):
        return _run_set_cold(engine, prompts_ids, max_new_tokens, tree_cfg, sampling, grammar)


def _mean_acceptance(lengths) -> float:
    """tokens committed per verify round (1.0 where there was none: plain steps)"""
    return sum(lengths) / len(lengths) if lengths else 1.0


def _run_set_cold(engine, prompts_ids, max_new_tokens, tree_cfg, sampling, grammar) -> dict:
    per_prompt, hist = [], collections.Counter()
    stage_s = {s: 0.0 for s in STAGES}
    tokens = forwards = drafts = 0
    seconds = 0.0
    lib0, coll0 = LIBRARY_CLOCK.seconds, LIBRARY_CLOCK.collective_seconds
    cpu0 = time.process_time()   # this process's CPU seconds: steadier than wall time on a shared machine
    counts = getattr(engine.model, "moe_stats", None)
    if counts is not None:
        counts(reset=True)
    for i, ids in enumerate(prompts_ids):
        sp = None if sampling is None or sampling.greedy else sampling.for_sample(i)
        r = engine.generate(ids, max_new_tokens, tree=tree_cfg, sampling=sp, grammar=grammar)
        per_prompt.append({"tokens": r.tokens, "acceptance_lengths": r.acceptance_lengths,
                           "target_forwards": r.target_forwards, "seconds": r.seconds, "seed": r.seed})
        hist.update(r.acceptance_lengths)
        for k, v in r.stage_seconds.items():
            stage_s[k] = stage_s.get(k, 0.0) + v
        tokens += len(r.tokens)
        forwards += r.target_forwards
        drafts += r.draft_forwards
        seconds += r.seconds
    acc = [a for p in per_prompt for a in p["acceptance_lengths"]]
    cpu_s = time.process_time() - cpu0
    collective_s = LIBRARY_CLOCK.collective_seconds - coll0
    library_s = LIBRARY_CLOCK.seconds - lib0 - collective_s
    decode_s = seconds - stage_s.get("prefill", 0.0)
    return {
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
        # the first token comes from the prefill: the decode rate is the other tokens over the time after it
        "decode_tokens_per_s": (tokens - len(prompts_ids)) / max(decode_s, 1e-9),
        "cpu_seconds": cpu_s, "tokens_per_cpu_s": tokens / max(cpu_s, 1e-9),
        # share of decode wall time outside the native forward / draft / tree calls (timed around each call; the
        # tp > 1 all-reduce callbacks count as outside); 1.0 on backend=numpy, where nothing runs in the library
        "library_seconds": library_s, "collective_seconds": collective_s,
        "python_overhead_fraction": max(0.0, 1.0 - library_s / max(seconds, 1e-9)),
        "target_forwards": forwards, "draft_forwards": drafts,
        "target_forwards_per_token": forwards / max(tokens, 1),
        "mean_acceptance_length": _mean_acceptance(acc),
        "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
        "stage_seconds": stage_s, "per_prompt": per_prompt,
        "moe": moe_columns(engine, counts(reset=True) if counts is not None else {}, forwards, tokens, drafts),
    }


def _bound_text(bound: Optional[float]) -> str:
    return f", bytes bound {bound:.2f}x" if bound else ""


def _faster(best, run):
    """The faster of the best run so far (None at first) and this one: the best of the alternating repeats."""
    return run if best is None or run["seconds"] < best["seconds"] else best


def _per_prompt(ar, run) -> List[float]:
    """Each prompt's AR seconds over `run`'s (the speedup prompt by prompt; both runs commit the same tokens, so the
    whole set's speedup is the sum of AR's seconds over the sum of the run's, between the smallest and the largest)."""
    return [p["seconds"] / max(q["seconds"], 1e-9) for p, q in zip(ar["per_prompt"], run["per_prompt"])]


def _same_tokens(ar, run) -> bool:
    """Every prompt's tokens of `run` equal AR's (the lossless property the bench reports)."""
    return all(p["tokens"] == q["tokens"] for p, q in zip(ar["per_prompt"], run["per_prompt"]))


def calibrate_policies(engine, prompt_ids, shapes) -> None:
    """tree.policy=cost measures the target's forward seconds by rows (ForwardCosts.calibrate, seconds at K2.6
    widths) when a request first uses it, and the engine's scheduler keeps them: one short generation here, untimed,
    with the largest budget of the shapes that use it, so that no timed round pays for it."""
    cost = [t for t in shapes if str(t.get("policy", "fixed")) == "cost"]
    if cost:
        engine.generate(prompt_ids, 2, tree=max(cost, key=lambda t: int(t.budget)))


def run(ctx, conf: BenchConfig) -> dict:
    prompts, max_new_tokens, repeats = conf.prompts, conf.max_new_tokens, conf.repeats
    cfg = ctx.cfg
    texts = load_prompts(prompts)                  # checked at start-up on a local host (kdtree.config.validate)
    state = EngineState.of(ctx)
    if state.engine is None:
        state.engine = Engine.from_config(cfg, status=ctx.status)
    engine = state.engine
    prompts_ids = [engine.tokenizer.encode(t) for t in texts]
    sampling = engine.pipeline_sampling()
    grammar = load_grammar(engine, conf.grammar)
    policy = str(cfg.tree.get("policy", "fixed"))
    fixed_tree = OmegaConf.merge(cfg.tree, {"policy": "fixed"}) if policy == "cost" else None
    fixed = None
    shapes = tree_shapes(cfg, "bench")             # `tree` (none for ar), then bench.trees, each inheriting tree.*
    calibrate_policies(engine, prompts_ids[0], shapes)
    extra = shapes[1:]                             # bench.trees: `tree` itself runs as `tree` below
    best_extra = [None] * len(extra)
    # Alternate AR and tree runs so drift of the machine's speed hits both alike; keep the best of repeats.
    ar = tree = None
    for _ in range(max(1, repeats)):
        a = _run_set(engine, prompts_ids, max_new_tokens, AR_TREE, sampling, grammar)
        t = _run_set(engine, prompts_ids, max_new_tokens, cfg.tree, sampling, grammar) if cfg.tree.kind != "ar" else a
        ar, tree = _faster(ar, a), _faster(tree, t)
        if fixed_tree is not None:                 # the same tree with the whole budget every round
            fixed = _faster(fixed, _run_set(engine, prompts_ids, max_new_tokens, fixed_tree, sampling, grammar))
        for i, shape in enumerate(extra):
            best_extra[i] = _faster(best_extra[i], _run_set(engine, prompts_ids, max_new_tokens, shape, sampling,
                                                            grammar))
    runs = [tree] + ([fixed] if fixed is not None else []) + best_extra
    lossless = all(_same_tokens(ar, r) for r in runs)
    greedy_acc = tree["mean_acceptance_length"]
    if not sampling.greedy and cfg.tree.kind != "ar":
        greedy_acc = _run_set(engine, prompts_ids, max_new_tokens, cfg.tree, None, grammar)["mean_acceptance_length"]
    out = {
        "tree": _shape(cfg.tree, int(cfg.model.drafter.block_size)),
        "drafter_block_size": int(cfg.model.drafter.block_size),
        "backend": cfg.backend.name, "quant": cfg.quant.method, "model": cfg.model.name, "tp": int(cfg.tp.size),
        "prompts": texts, "max_new_tokens": max_new_tokens, "repeats": repeats,
        "tokens_per_s": tree["tokens_per_s"],
        "ar_tokens_per_s": ar["tokens_per_s"],
        "speedup_vs_ar": tree["tokens_per_s"] / max(ar["tokens_per_s"], 1e-9),
        "decode_tokens_per_s": tree["decode_tokens_per_s"], "ar_decode_tokens_per_s": ar["decode_tokens_per_s"],
        "decode_speedup_vs_ar": tree["decode_tokens_per_s"] / max(ar["decode_tokens_per_s"], 1e-9),
        "cpu_speedup_vs_ar": tree["tokens_per_cpu_s"] / max(ar["tokens_per_cpu_s"], 1e-9),
        "python_overhead_fraction": tree["python_overhead_fraction"],
        "ar_python_overhead_fraction": ar["python_overhead_fraction"],
        "target_forwards_per_token": tree["target_forwards_per_token"],
        "ar_target_forwards_per_token": ar["target_forwards_per_token"],
        "mean_acceptance_length": tree["mean_acceptance_length"],
        "greedy_mean_acceptance_length": greedy_acc,
        "temperature": sampling.temperature if not sampling.greedy else 0.0,
        "sampling": sampling.to_dict(),
        "acceptance_histogram": tree["acceptance_histogram"],
        # prompt by prompt (the bench's prompts in order): where the tree pays and where the drafter misses
        "per_prompt_speedup_vs_ar": _per_prompt(ar, tree),
        "per_prompt_acceptance": [_mean_acceptance(p["acceptance_lengths"]) for p in tree["per_prompt"]],
        "stage_seconds": tree["stage_seconds"],
        "outputs_equal_ar": lossless,
        "moe": tree["moe"], "ar_moe": ar["moe"],
        "bytes_bound_speedup": bytes_bound(ar["moe"], tree["moe"]),
        "policy": policy,
        "fixed_policy": None if fixed is None else {
            "tokens_per_s": fixed["tokens_per_s"], "mean_acceptance_length": fixed["mean_acceptance_length"],
            "target_forwards_per_token": fixed["target_forwards_per_token"], "moe": fixed["moe"],
            "policy_speedup": tree["tokens_per_s"] / max(fixed["tokens_per_s"], 1e-9)},
        "trees": [{"tree": OmegaConf.to_container(shape, resolve=True), "tokens_per_s": r["tokens_per_s"],
                   "speedup_vs_ar": r["tokens_per_s"] / max(ar["tokens_per_s"], 1e-9),
                   "decode_speedup_vs_ar": r["decode_tokens_per_s"] / max(ar["decode_tokens_per_s"], 1e-9),
                   "mean_acceptance_length": r["mean_acceptance_length"],
                   "per_prompt_speedup_vs_ar": _per_prompt(ar, r),
                   "target_forwards_per_token": r["target_forwards_per_token"], "moe": r["moe"],
                   "bytes_bound_speedup": bytes_bound(ar["moe"], r["moe"]),
                   "outputs_equal_ar": _same_tokens(ar, r)}
                  for shape, r in zip(extra, best_extra)],
        "grammar": conf.grammar,
        "grammar_seconds_per_token": tree["stage_seconds"].get("grammar", 0.0) / max(tree["tokens"], 1),
        "ar": ar, "result": tree,
        "provenance": provenance(ctx, sampling),
    }
    (ctx.run_dir / "bench.json").write_text(json.dumps(out, indent=2))
    t = OmegaConf.create(out["tree"])
    how = "greedy" if sampling.greedy else f"T={sampling.temperature} seed={sampling.seed}"
    how += f" grammar={conf.grammar}" if conf.grammar else ""
    prune = " prune_experts" if t.get("prune_experts") else ""
    print(f"bench {t.kind} w={t.width} d={t.depth} b={t.budget}{prune} {how}: {out['tokens_per_s']:.1f} tok/s vs AR "
          f"{out['ar_tokens_per_s']:.1f} tok/s -> speedup {out['speedup_vs_ar']:.2f}x (decode alone "
          f"{out['decode_speedup_vs_ar']:.2f}x, CPU time "
          f"{out['cpu_speedup_vs_ar']:.2f}x), acceptance "
          f"{out['mean_acceptance_length']:.2f} (greedy {greedy_acc:.2f}){_bound_text(out['bytes_bound_speedup'])}, "
          f"target forwards/token "
          f"{out['target_forwards_per_token']:.3f}, "
          f"python overhead {out['python_overhead_fraction']:.2f} (AR {out['ar_python_overhead_fraction']:.2f}), "
          f"lossless={lossless} -> {ctx.run_dir / 'bench.json'}")
    if cfg.tree.kind != "ar":
        pp, acc = out["per_prompt_speedup_vs_ar"], out["per_prompt_acceptance"]
        worst = min(range(len(pp)), key=pp.__getitem__)
        print("bench per prompt (AR seconds / tree seconds, acceptance): "
              + ", ".join(f"{x:.2f}x ({a:.1f})" for x, a in zip(pp, acc))
              + f"; slowest: prompt {worst} {texts[worst][:40]!r}")
    if fixed is not None:
        print(f"bench tree.policy=cost: {out['tokens_per_s']:.1f} tok/s vs the whole budget every round "
              f"{fixed['tokens_per_s']:.1f} tok/s -> {out['fixed_policy']['policy_speedup']:.2f}x (acceptance "
              f"{out['mean_acceptance_length']:.2f} vs {fixed['mean_acceptance_length']:.2f})")
    for row in out["trees"]:
        t2 = row["tree"]
        print(f"bench {t2['kind']} w={t2['width']} d={t2['depth']} b={t2['budget']} policy={t2.get('policy', 'fixed')}"
              f"{' prune_experts' if t2.get('prune_experts') else ''}: "
              f"{row['tokens_per_s']:.1f} tok/s -> speedup {row['speedup_vs_ar']:.2f}x (decode alone "
              f"{row['decode_speedup_vs_ar']:.2f}x), acceptance "
              f"{row['mean_acceptance_length']:.2f}{_bound_text(row['bytes_bound_speedup'])}, "
              f"lossless={row['outputs_equal_ar']}")
    if tree["moe"].get("bytes_per_token") and ar["moe"].get("bytes_per_token"):
        print(f"bench MoE tax: {tree['moe']['mean_experts_per_forward']:.2f} experts per MoE layer per forward vs AR "
              f"{ar['moe']['mean_experts_per_forward']:.2f}; {tree['moe']['bytes_per_token'] / 1e6:.1f} MB streamed "
              f"per token (+ drafter {tree['moe']['draft_bytes_per_token'] / 1e6:.1f} MB) vs AR "
              f"{ar['moe']['bytes_per_token'] / 1e6:.1f} MB: no engine streaming these bytes passes "
              f"{out['bytes_bound_speedup']:.2f}x AR")
    if not lossless:
        raise PipelineError(f"tree={t.kind} output differs from AR on the bench prompts: the lossless invariant is "
                            f"broken (see {ctx.run_dir / 'bench.json'}); report this as a bug")
    return {k: out[k] for k in ("tokens_per_s", "speedup_vs_ar", "mean_acceptance_length")}
