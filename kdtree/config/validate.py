"""Cross-field checks of a composed config, run before any work.

Each failure is one ConfigError line naming the key, the value and what would be valid, e.g.
`tp=8 does not divide num_attention_heads=4 (model=tiny); use tp=1, 2 or 4`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence
from urllib.parse import urlsplit

import yaml
from omegaconf import DictConfig, OmegaConf

from kdtree.decode.sampling import SamplingError, SamplingParams
from kdtree.config.schema import GENERATED_MODELS, is_generated
from kdtree.config.secrets import api_key
from kdtree.engines import check_engine
from kdtree.errors import ConfigError

REPO_DIR = Path(__file__).resolve().parents[2]
PIPELINES_DIR = REPO_DIR / "pipelines"
DEFAULT_PROMPTS = REPO_DIR / "kdtree" / "assets" / "bench_prompts.json"   # bench.prompts left empty
# Stages that need the model's weights (and so a checkpoint and a working backend).
MODEL_STAGES = {"load", "generate", "warmup", "serve", "bench", "bench_peer", "export_gguf", "launch"}
TREE_KINDS = ("ar", "chain", "ddtree")
BACKENDS = ("numpy", "cpu", "cuda")
QUANT_METHODS = ("fp32", "bf16", "int4_w4a16")
LOAD_STRATEGIES = ("mmap", "eager")


def check_group_overrides(argv: Sequence[str], conf_dir: Path, groups: Iterable[str]) -> None:
    """`model=nope` -> one line listing the valid choices, before Hydra prints its multi-line error."""
    groups = set(groups)
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in groups:
            continue
        choices = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
        for choice in value.split(","):  # multirun lists: tree=ar,ddtree
            if choice and choice not in choices:
                raise ConfigError(f"{key}={choice} is not a known {key} config; valid: {', '.join(choices)}"
                                  f" (files in {conf_dir / key})")


def pipeline_path(name: str) -> Path:
    """`pipeline=NAME` -> pipelines/NAME.yaml; a path to a user's YAML works too."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or "/" in name:
        return p
    return PIPELINES_DIR / f"{name}.yaml"


def pipeline_stage_names(name: str, cfg: Optional[DictConfig] = None) -> List[str]:
    """The stage names of a pipeline file; with `cfg`, only the stages whose `when:` matches it."""
    path = pipeline_path(name)
    if not path.is_file():
        known = sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml"))
        raise ConfigError(f"pipeline={name}: no such pipeline ({path}); known: {', '.join(known)}")
    spec = read_yaml(path) or {}
    stages = spec.get("stages", []) if isinstance(spec, dict) else []
    if not isinstance(stages, list):
        return []
    return [str(s.get("stage")) for s in stages if isinstance(s, dict) and (cfg is None or _when(s, cfg))]


def _when(stage: dict, cfg: DictConfig) -> bool:
    cond = stage.get("when")
    if not isinstance(cond, dict):
        return True
    return all(OmegaConf.select(cfg, str(k), default=None) in (list(v) if isinstance(v, (list, tuple)) else [v])
               for k, v in cond.items())


def read_yaml(path: Path):
    """yaml.safe_load of a file; a syntax error is one ConfigError line `FILE:LINE:COL: not valid YAML: problem`."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: not valid YAML: {problem}" + (f" ({' '.join(context.split())})" if context
                                                                      else "") + "; fix the pipeline file") from None


def _divisors_of_all(n_max: int, values: Sequence[int]) -> List[int]:
    return [t for t in range(1, n_max + 1) if all(v % t == 0 for v in values)]


def validate_tp(cfg: DictConfig) -> None:
    m, tp, q = cfg.model, int(cfg.tp.size), cfg.quant
    if tp < 1:
        raise ConfigError(f"tp.size={tp} must be >= 1; use tp=1, 2, 4 or 8")
    collective = str(cfg.tp.get("collective", "auto"))
    if collective not in ("auto", "host", "nccl"):
        raise ConfigError(f"tp.collective={collective} is unknown; use auto, host or nccl (backend=cuda)")
    if collective == "nccl" and cfg.backend.name != "cuda":
        raise ConfigError(f"tp.collective=nccl with backend={cfg.backend.name}: NCCL on the stream is the CUDA "
                          f"forward's; use tp.collective=auto or host")
    dims = {"num_attention_heads": m.num_attention_heads, "moe_intermediate_size": m.moe_intermediate_size,
            "intermediate_size": m.intermediate_size}
    for key, value in dims.items():
        if value % tp:
            ok = _divisors_of_all(16, list(dims.values()))
            raise ConfigError(f"tp={tp} does not divide {key}={value} (model={m.name}); "
                              f"use tp={', '.join(map(str, ok))}")
    if q.method == "int4_w4a16":
        # row-parallel down_proj of the routed experts is split on its input dim: each rank needs whole groups
        per_rank = m.moe_intermediate_size // tp
        if per_rank % q.group_size:
            raise ConfigError(f"tp={tp} splits moe_intermediate_size={m.moe_intermediate_size} into {per_rank} per rank, "
                              f"not a multiple of quant.group_size={q.group_size}; use a smaller tp or group_size")


def validate_tree(cfg: DictConfig) -> None:
    t, block = cfg.tree, int(cfg.model.drafter.block_size)
    if t.kind not in TREE_KINDS:
        raise ConfigError(f"tree.kind={t.kind} is unknown; use one of {', '.join(TREE_KINDS)}")
    if t.kind == "ar":
        return
    if not 1 <= t.depth <= block - 1:
        raise ConfigError(f"tree.depth={t.depth} is out of range for tree={t.kind}; use 1..{block - 1} "
                          f"(model.drafter.block_size={block} minus 1)")
    if t.width < 1:
        raise ConfigError(f"tree.width={t.width} must be >= 1 (top-k tokens per depth)")
    if t.budget < 1:
        raise ConfigError(f"tree.budget={t.budget} must be >= 1 (nodes per verify); use tree=ar for no drafting")
    if t.kind == "chain" and t.width != 1:
        raise ConfigError(f"tree.width={t.width} with tree=chain; a chain has width 1 (use tree=ddtree for wider trees)")


def validate_checkpoint_path(cfg: DictConfig) -> None:
    m = cfg.model
    if OmegaConf.is_missing(m, "path"):
        raise ConfigError(f"model.path is required for model={m.name}; set model.path=/path/to/checkpoint "
                          f"(a directory with config.json and model.safetensors.index.json)")
    if not m.path:
        if not is_generated(m.name):
            raise ConfigError(f"model.path is empty for model={m.name}; only model={' and model='.join(GENERATED_MODELS)} "
                              f"have a generated checkpoint")
        return
    p = Path(m.path).expanduser()
    if not p.exists():
        raise ConfigError(f"model.path={m.path} does not exist; point it at a checkpoint directory "
                          f"(config.json + model.safetensors.index.json) or leave it empty for the embedded tiny model")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path={m.path} has no config.json; it must be a HF checkpoint directory")


def validate_load(cfg: DictConfig) -> None:
    ld = cfg.load
    if ld.strategy not in LOAD_STRATEGIES:
        raise ConfigError(f"load.strategy={ld.strategy} is unknown; use load.strategy=mmap (zero-copy, the default) "
                          f"or load.strategy=eager (reads into copies)")
    if ld.threads < 1:
        raise ConfigError(f"load.threads={ld.threads} must be >= 1 (parallel reads per process; 4 is the default)")
    if ld.throttle_mb_s < 0:
        raise ConfigError(f"load.throttle_mb_s={ld.throttle_mb_s} must be >= 0 (0 = no throttle)")
    if ld.mlock and ld.strategy != "mmap":
        raise ConfigError(f"load.mlock=true with load.strategy={ld.strategy}: mlock pins the mapped shards, use "
                          f"load.strategy=mmap (eager's copies are anonymous memory, only swap evicts them)")


def validate_bench_load(cfg: DictConfig) -> None:
    b = cfg.bench_load
    for key, value, least in (("gb", b.gb, "0.01"), ("repeats", b.repeats, "1"), ("shards", b.shards, "1")):
        if not value > 0:
            raise ConfigError(f"bench_load.{key}={value} must be positive; use e.g. bench_load.{key}={least} or more")


SAMPLING_ONLY_WITH_TEMPERATURE = ("top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty")


def validate_sampling(cfg: DictConfig, stages: Sequence[str]) -> None:
    """The sampling section as kdtree.decode.sampling.SamplingParams checks it, each error as sampling.<key>."""
    s = cfg.sampling
    values = {k: v for k, v in OmegaConf.to_container(s, resolve=True).items() if v is not None}
    try:
        SamplingParams.merged(values, temperature=0.0 if s.temperature is None else 1.0)
    except SamplingError as e:
        raise ConfigError(f"sampling.{e}") from None
    if s.temperature is None and "serve" not in stages and {"generate", "bench"}.intersection(stages):
        for key in SAMPLING_ONLY_WITH_TEMPERATURE:
            if s.get(key) is not None:
                raise ConfigError(f"sampling.{key}={s.get(key)} has no effect: pipeline={cfg.pipeline} decodes "
                                  f"greedily unless sampling.temperature is set; add e.g. sampling.temperature=1.0")


def read_prompts(path: str) -> list:
    """The prompt texts of bench.prompts=`path` (a JSON file {"prompts": ["...", ...]}); the shipped set when empty."""
    p, where = (Path(path) if path else DEFAULT_PROMPTS), f"bench.prompts={path}"
    fix = ('write a JSON file {"prompts": ["def main(", ...]} (at least one non-empty string) '
           'or leave bench.prompts empty')
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e}); {fix}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not a JSON file ({e}); {fix}") from None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not prompts:
        raise ConfigError(f"{where}: has no \"prompts\" list with a prompt in it (got {json.dumps(prompts)[:80]}); "
                          f"{fix}")
    bad = next((i for i, t in enumerate(prompts) if not isinstance(t, str) or not t), None)
    if bad is not None:
        raise ConfigError(f"{where}: prompt {bad} is {json.dumps(prompts[bad])[:80]}, not a non-empty string; {fix}")
    return list(prompts)


def _positive_list(section: str, b: DictConfig, key: str, example: str) -> List[int]:
    """<section>.<key>: a non-empty list of positive integers, else one ConfigError line with `example`."""
    v = list(b[key]) if b.get(key) is not None else []
    if not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
        raise ConfigError(f"{section}.{key}={v} must be a non-empty list of positive integers; use e.g. "
                          f"'{section}.{key}={example}'")
    return v


def _at_least(section: str, b: DictConfig, specs: Sequence[tuple]) -> None:
    """<section>.<key> >= least for each (key, least, example), else one ConfigError line."""
    for key, least, example in specs:
        if not isinstance(b[key], int) or isinstance(b[key], bool) or b[key] < least:
            raise ConfigError(f"{section}.{key}={b[key]} must be an integer >= {least}; use e.g. "
                              f"{section}.{key}={example}")


def validate_bench_forward(cfg: DictConfig) -> None:
    """pipeline=bench_forward's options, before the load: every value it would otherwise meet deep in a forward."""
    if cfg.backend.name != "cpu":
        raise ConfigError(f"bench_forward measures the native CPU forward; backend={cfg.backend.name} has no byte "
                          f"accounting: run it with backend=cpu")
    b = cfg.bench_forward
    rows = _positive_list("bench_forward", b, "rows", "[1,2,5,9,17,33,65]")
    _positive_list("bench_forward", b, "threads", "[1,2]")
    _at_least("bench_forward", b, (("context", 0, 64), ("repeats", 1, 3), ("roof_mb", 1, 1024)))
    longest, limit = int(b.context) + max(rows), int(cfg.model.max_position_embeddings)
    if longest > limit:
        raise ConfigError(f"bench_forward.context={b.context} + the largest of bench_forward.rows={rows} is "
                          f"{longest} positions, past max_position_embeddings={limit} of model={cfg.model.name}; "
                          f"lower bench_forward.context or the rows")


def validate_bench_serve(cfg: DictConfig) -> None:
    """pipeline=bench_serve's options, before the server starts."""
    b = cfg.bench_serve
    _positive_list("bench_serve", b, "clients", "[1,4,16]")
    _at_least("bench_serve", b, (("requests", 1, 2), ("max_tokens", 2, 64), ("short_tokens", 1, 4),
                                 ("long_tokens", 1, 1000), ("shared_prefix_tokens", 0, 2000),
                                 ("shared_prefix_clients", 1, 16), ("shared_prefix_requests", 1, 8)))


def validate_bench_http(cfg: DictConfig) -> None:
    """pipeline=bench_http's options, before the server starts."""
    _at_least("bench_http", cfg.bench_http, (("max_tokens", 2, 48), ("repeats", 1, 3)))


def peer_gguf(gguf: str) -> Path:
    """bench_peer.gguf, a GGUF file to reuse: its path, or one ConfigError line (at start-up for a local host, in the
    stage for a remote one)."""
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise ConfigError(f"bench_peer.gguf={gguf} does not exist; export one with pipeline=export_gguf "
                          f"or leave bench_peer.gguf empty to export the model")
    return path


def validate_bench_peer(cfg: DictConfig) -> None:
    b = cfg.bench_peer
    for key, value in (("threads", b.threads), ("rounds", b.rounds)):
        if not value >= 1:
            raise ConfigError(f"bench_peer.{key}={value} must be >= 1; use e.g. bench_peer.{key}=1")
    if b.get("gguf") and cfg.get("pipeline") == "bench_peer" and cfg.host.kind == "local":
        peer_gguf(str(b.gguf))
    if cfg.get("pipeline") == "bench_peer" or b.get("trees"):
        peer_tree_shapes(cfg)
    if cfg.get("bench") is not None and cfg.bench.get("trees"):
        tree_shapes(cfg, "bench")


def parse_tree_spec(spec: str, base: DictConfig) -> DictConfig:
    """'ddtree-w4-d7-b6' / 'chain-d7' / 'ddtree-b8-prune' -> a tree config: the kind, then any of wN (width), dN
    (depth), bN (budget), `prune` (tree.prune_experts=true, else false); the width, depth and budget not given come
    from `base` (a chain has width 1 and budget = depth)."""
    parts = str(spec).strip().lower().split("-")
    kind = parts[0]
    if kind not in ("chain", "ddtree"):
        raise ValueError(f"starts with {kind!r}; a shape starts with chain or ddtree")
    t = {"kind": kind, "width": int(base.width), "depth": int(base.depth) or 7, "budget": int(base.budget),
         "prune_experts": False}                   # a shape without `prune` does not prune, whatever `tree` says
    given = set()
    for p in parts[1:]:
        if p == "prune" and "prune" not in given:
            t["prune_experts"] = True
            given.add("prune")
            continue
        key = {"w": "width", "d": "depth", "b": "budget"}.get(p[:1])
        if key is None or not p[1:].isdigit() or key in given:
            raise ValueError(f"part {p!r} is not one of wN, dN, bN, prune (each at most once)")
        t[key] = int(p[1:])
        given.add(key)
    if kind == "chain":
        if "width" in given and t["width"] != 1:
            raise ValueError("a chain has width 1 (use ddtree for wider trees)")
        t["width"], t["budget"] = 1, t["depth"]
    return OmegaConf.create(t)


def tree_shapes(cfg: DictConfig, stage: str = "bench_peer") -> List[DictConfig]:
    """The tree shapes a bench stage measures in the same alternating rounds: `tree` (unless ar), then <stage>.trees,
    duplicates dropped; each one checked as tree.* would be, the error naming the item. An item is `tree` with the
    item's parts: what it does not name (tree.policy, ...) it inherits, in every stage alike."""
    specs = list(cfg[stage].get("trees") or [])
    if cfg.tree.kind == "ar" and specs:
        raise ConfigError(f"{stage}.trees={specs} with tree=ar: the drafter is loaded for a drafting tree only; "
                          f"set tree=ddtree (or tree=chain) as well")
    base = OmegaConf.create(OmegaConf.to_container(cfg.tree, resolve=True))
    shapes = [] if cfg.tree.kind == "ar" else [base]
    for spec in specs:
        try:
            t = OmegaConf.merge(base, parse_tree_spec(spec, cfg.tree))
            validate_tree(OmegaConf.create({"tree": t, "model": {"drafter": {
                "block_size": cfg.model.drafter.block_size}}}))
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"{stage}.trees item {spec!r}: {e}; write a shape as e.g. ddtree-w4-d7-b6 or "
                              f"chain-d7") from None
        key = ("kind", "width", "depth", "budget", "prune_experts")
        if all({k: t.get(k, False) for k in key} != {k: s.get(k, False) for k in key} for s in shapes):
            shapes.append(t)
    return shapes


def peer_tree_shapes(cfg: DictConfig) -> List[DictConfig]:
    """bench_peer's tree shapes (tree_shapes of bench_peer.trees)."""
    return tree_shapes(cfg, "bench_peer")


def check_url(key: str, url: str) -> None:
    """http(s)://host[:port][/path], the port in range: a URL curl can use, or one line saying why not."""
    fix = f"e.g. {key}=http://127.0.0.1:30001"
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:     # a port that is not a number or not in 0..65535
        raise ConfigError(f"{key}={url} has a bad port ({e}); use a port in 1..65535, {fix}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"{key}={url} is not an http(s) URL with a host; {fix}")
    if port == 0:
        raise ConfigError(f"{key}={url}: port 0 is not a port a server listens on; {fix}")
    if u.query or u.fragment or u.path.rstrip("/").endswith(("/v1", "/v1/completions")):
        raise ConfigError(f"{key}={url}: give the server's base URL (the monitor adds /v1/completions, /v1/models "
                          f"and /status); {fix}")


def validate_health(cfg: DictConfig, stages: Sequence[str] = ()) -> None:
    """Every health.* setting in range before anything starts (a negative window or a zero timeout would
    give verdicts that mean nothing)."""
    h = cfg.health
    if h.api_key:
        raise ConfigError("health.api_key is not taken: a key given as an override is visible in `ps` and kept in "
                          "shell history; export KDTREE_API_KEY=<key> or set health.api_key_file=<file with the key>")
    if h.get("api_key_file"):
        api_key(h, "health")                  # readable and not empty, before the watch starts
    for key in ("interval_s", "stall_window_s", "deadline_s", "probe_timeout_s"):
        value = h[key]
        if not value > 0:
            raise ConfigError(f"health.{key}={value} must be a positive number of seconds "
                              f"(default {HEALTH_DEFAULTS[key]:g})")
    if h.stall_window_s < h.interval_s:
        raise ConfigError(f"health.stall_window_s={h.stall_window_s:g} is shorter than health.interval_s="
                          f"{h.interval_s:g}: a stall must be seen by two samples at least; raise the window")
    if h.pid < 0:
        raise ConfigError(f"health.pid={h.pid} must be a process id (> 0), or 0 for none")
    if h.expected_bytes < 0:
        raise ConfigError(f"health.expected_bytes={h.expected_bytes} must be >= 0 (the checkpoint size in bytes; "
                          f"0 = the size of model.path)")
    if h.disk and ("/" in h.disk or not h.disk.strip() or h.disk != h.disk.strip()):
        raise ConfigError(f"health.disk={h.disk!r} must be a device name as /proc/diskstats lists it (nvme0n1, "
                          f"sda), not a path")
    if h.url:
        check_url("health.url", h.url)
    elif "watch" in stages:
        raise ConfigError("health.url is empty; give the server to watch, e.g. health.url=http://127.0.0.1:30001")


HEALTH_DEFAULTS = {"interval_s": 1.0, "stall_window_s": 30.0, "deadline_s": 600.0, "probe_timeout_s": 5.0}


def validate_serve(cfg: DictConfig) -> None:
    s = cfg.serve
    if s.api_key:
        raise ConfigError("serve.api_key is not taken: a key given as an override is visible in `ps` and kept in "
                          "shell history; export KDTREE_API_KEY=<key> or set serve.api_key_file=<file with the key>")
    for key in ("max_body_bytes", "max_header_bytes", "max_connections"):
        if int(s[key]) < 1:
            raise ConfigError(f"serve.{key}={s[key]} must be >= 1")
    if int(s.get("max_connections_per_client", 0)) < 0:
        raise ConfigError(f"serve.max_connections_per_client={s.max_connections_per_client} must be >= 0 (0 = no cap)")
    for key in ("drain_timeout_s", "keepalive_s", "request_read_timeout_s"):
        if not float(s[key]) > 0:
            raise ConfigError(f"serve.{key}={s[key]} must be > 0 seconds")
    if not 0 <= s.port <= 65535:
        raise ConfigError(f"serve.port={s.port} is not a TCP port; use 1..65535 (or 0 for any free port)")
    ipv6 = s.host.count(":") >= 2
    if not s.host or " " in s.host or "/" in s.host or (":" in s.host and not ipv6):
        raise ConfigError(f"serve.host={s.host!r} must be an address to bind (127.0.0.1, 0.0.0.0, ::), not a URL")
    if s.max_queue < 1:
        raise ConfigError(f"serve.max_queue={s.max_queue} must be >= 1 (requests waiting for the engine)")
    for key, allowed in (("tool_call_parser", ("kimi_k2", "none")), ("reasoning_parser", ("auto", "kimi_k2", "none"))):
        if s.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"serve.{key}={s.get(key)!r} is not a parser kdtree has; use one of {', '.join(allowed)}")
    if s.demo_tokens < 0:
        raise ConfigError(f"serve.demo_tokens={s.demo_tokens} must be >= 0 (0 = no demo)")
    if cfg.stop.timeout_s < 0:
        raise ConfigError(f"stop.timeout_s={cfg.stop.timeout_s} must be >= 0 (seconds between SIGTERM and SIGKILL)")


def loads_model(cfg: DictConfig, stages: Sequence[str] = None) -> bool:
    """True when the pipeline (or `stages`) loads the model's weights: it needs a checkpoint and a device."""
    return bool(MODEL_STAGES.intersection(pipeline_stage_names(cfg.pipeline, cfg) if stages is None else stages))


def validate(cfg: DictConfig, stages: Sequence[str] = None) -> None:
    """All cross-field checks; the checkpoint check only when the pipeline loads the model. The backend's
    device check is kdtree.backends.check_device (config does not import the backends)."""
    if cfg.quant.method not in QUANT_METHODS:
        raise ConfigError(f"quant.method={cfg.quant.method} is unknown; use quant=fp32, quant=bf16 or quant=int4_w4a16")
    if cfg.quant.group_size <= 0 or cfg.quant.group_size % 8:
        raise ConfigError(f"quant.group_size={cfg.quant.group_size} must be a positive multiple of 8 (32 for K2)")
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")
    if cfg.host.kind not in ("local", "ssh"):
        raise ConfigError(f"host.kind={cfg.host.kind} is unknown; use local or ssh")
    if cfg.host.supervisor not in ("nohup", "systemd"):
        raise ConfigError(f"host.supervisor={cfg.host.supervisor} is unknown; use nohup or systemd")
    if cfg.backend.name not in BACKENDS:
        raise ConfigError(f"backend.name={cfg.backend.name} is unknown; use backend=numpy, cpu or cuda")
    drafter_forward = cfg.backend.get("drafter_forward", "native")
    if drafter_forward not in ("native", "per_op"):
        raise ConfigError(f"backend.drafter_forward={drafter_forward} is unknown; use native (one library call per "
                          f"drafter extend / draft) or per_op")
    validate_load(cfg)
    validate_serve(cfg)
    validate_bench_load(cfg)
    validate_bench_peer(cfg)
    validate_tp(cfg)
    validate_tree(cfg)
    check_engine(cfg)
    if stages is None:
        stages = pipeline_stage_names(cfg.pipeline, cfg)
    validate_sampling(cfg, stages)
    if {"bench", "bench_peer"}.intersection(stages) and cfg.get("bench") is not None:   # a decode rate needs 2 tokens
        _at_least("bench", cfg.bench, (("max_new_tokens", 2, 96), ("repeats", 1, 3)))
    if "bench_forward" in stages:
        validate_bench_forward(cfg)
    if "bench_serve" in stages:
        validate_bench_serve(cfg)
    if "bench_http" in stages:
        validate_bench_http(cfg)
    # the prompt file, before the load: bench_serve and bench_http read it here (on the controller), bench and
    # bench_peer where they run (a remote host reads its own path)
    if cfg.get("bench") is not None and ({"bench_serve", "bench_http"}.intersection(stages) or (
            cfg.host.kind == "local" and {"bench", "bench_peer"}.intersection(stages))):
        read_prompts(str(cfg.bench.get("prompts") or ""))
    validate_health(cfg, stages)
    if loads_model(cfg, stages):
        validate_checkpoint_path(cfg)
