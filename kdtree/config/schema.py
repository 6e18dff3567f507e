"""Typed schemas of every config group and shared section, registered in Hydra's ConfigStore.

A YAML file in conf/<group>/ extends the schema of its group, so a wrong type or an unknown key fails at
compose time. Cross-field rules live in kdtree/config/validate.py.

Two kinds of sections:
* shared sections (load, serve, health, sampling): read by library packages (checkpoint, serve, monitor,
  decode) as well as by stages, so they live here;
* stage sections (bench, plan, stop, ...): read by one stage only, so the stage module declares the dataclass
  (`CONFIG = BenchConfig`, section = the stage's name; kdtree/pipeline/registry.py). kdtree.config cannot
  import kdtree.stages (stages import config), so the root schema takes them as an argument:
  root_schema(sections) / register(sections), called through kdtree.pipeline.registry.register_schema().
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import List, Mapping, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# model.path empty = kdtree generates the checkpoint itself (kdtree/checkpoint/tiny.py); add a name here to add one
GENERATED_MODELS = ("tiny", "k26_mini", "tiny_wide")  # k26_mini: K2.6 layer dims, 2 layers; tiny_wide: tiny widened


def is_generated(model_name: str) -> bool:
    """Models whose checkpoint kdtree generates itself when model.path is empty."""
    return model_name in GENERATED_MODELS


@dataclass
class RopeScaling:
    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass
class DrafterConfig:
    num_hidden_layers: int = 1
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 64
    block_size: int = 8
    target_layer_ids: List[int] = field(default_factory=list)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


@dataclass
class ModelConfig:
    """K2 (DeepseekV3) architecture; field names are HF config.json's."""
    name: str = MISSING
    path: str = ""
    tokenizer: str = "byte"
    init: str = "trained"  # embedded tiny only: trained (kdtree/assets/tiny) | random (seeded, generated)
    seed: int = 0
    int4_unquantized_dtype: str = "fp32"  # generated INT4 checkpoints: dtype of the unquantized tensors (bf16 = K2.6's)
    widen_from: str = ""  # generated only: "tiny" = the trained tiny widened to these widths (kdtree/checkpoint/widen.py)
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    moe_intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    n_routed_experts: int = MISSING
    num_experts_per_tok: int = MISSING
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    q_lora_rank: int = MISSING
    kv_lora_rank: int = MISSING
    qk_nope_head_dim: int = MISSING
    qk_rope_head_dim: int = MISSING
    v_head_dim: int = MISSING
    max_position_embeddings: int = MISSING
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int = MISSING
    eos_token_id: int = MISSING
    mask_token_id: int = MISSING
    pad_token_id: int = MISSING
    drafter: DrafterConfig = field(default_factory=DrafterConfig)


@dataclass
class QuantConfig:
    method: str = "fp32"  # fp32 | bf16 (unquantized, BF16 on disk) | int4_w4a16
    group_size: int = 32
    symmetric: bool = True
    num_bits: int = 4
    targets: List[str] = field(default_factory=lambda: ["Linear"])
    ignore: List[str] = field(default_factory=list)


@dataclass
class TPConfig:
    size: int = 1
    dist_backend: str = "auto"
    collective: str = "auto"  # backend=cuda: nccl (on the forward's stream) | host (through Python) | auto
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 300.0  # a collective that waits longer fails (a dead or hung rank), instead of hanging


@dataclass
class BackendConfig:
    name: str = "numpy"  # numpy | cpu | cuda
    library: str = ""
    device: str = "cpu"
    threads: int = 0     # cpu: OpenMP threads of the native forward (0 = every core; serve keeps one for HTTP)
    drafter_forward: str = "native"  # cpu|cuda: native (kd_drafter_*, one call per extend / draft) | per_op


@dataclass
class TreeConfig:
    kind: str = "ddtree"  # ar | chain | ddtree
    width: int = 4
    depth: int = 7
    budget: int = 32
    policy: str = "fixed"  # fixed: verify the whole budget | cost: the prefix with the most expected tokens/s (lossless)
    # backend=cpu: a verify drops the draft rows whose own MoE experts cost more bytes than their subtree is expected to
    # commit (lossless: a pruned draft is a rejected one); pays where decoding is memory-bound (tiny_wide, K2.6)
    prune_experts: bool = False


@dataclass
class EngineConfig:
    """The server the serve pipeline runs (kdtree/engines): kdtree's own engine, or SGLang / vLLM / llama.cpp's
    OpenAI server launched with a command line built from the same config (kdtree/stages/launch.py)."""
    name: str = "kdtree"  # kdtree | sglang | vllm | llamacpp
    python: str = ""  # the engine's Python on the host (its own venv); "" = host.python, else kdtree's own
    command: List[str] = field(default_factory=list)  # replaces `python -m <module>` (a wrapper, a stand-in, a binary)
    extra_args: List[str] = field(default_factory=list)  # appended to the command line verbatim
    speculative_algorithm: str = "EAGLE3"  # sglang --speculative-algorithm / vllm speculative-config method
    draft_model_path: str = ""  # empty = <model.path>/drafter
    gguf: str = ""  # llamacpp: the GGUF to serve; empty = export the model into the run dir first (export_gguf)
    ready_timeout_s: float = 0.0  # 0 = none; the launch stage itself never decides readiness (health_poll does)


@dataclass
class HostConfig:
    name: str = "local"
    kind: str = "local"  # local | ssh
    address: str = ""
    user: str = ""
    port: int = 22
    key_file: str = ""
    known_hosts: str = ""
    workdir: str = ""
    python: str = ""
    supervisor: str = "nohup"  # nohup | systemd
    connect_timeout_s: float = 10.0
    command_timeout_s: float = 60.0


@dataclass
class LoadConfig:
    strategy: str = "mmap"  # mmap (zero-copy page-cache views, made resident by parallel reads) | eager (copies)
    threads: int = 4
    throttle_mb_s: float = 0.0  # 0 = no throttle; for tests and demos of slow disks
    mlock: bool = False  # mmap: lock the weights in RAM (needs ulimit -l unlimited) so pressure cannot evict them
    progress: bool = True


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 30001
    api_key: str = ""  # refused (a key on a command line is in `ps` and the run dir): use KDTREE_API_KEY or api_key_file
    api_key_file: str = ""  # a file holding the /v1 Bearer key (on the engine's host); KDTREE_API_KEY wins
    cors_origins: List[str] = field(default_factory=list)  # browser origins allowed (CORS); empty = CORS off
    drain_timeout_s: float = 600.0  # SIGTERM: finish accepted requests this long (a full 2k-token request fits)
    max_body_bytes: int = 8388608  # 8 MiB request body; more is a 413
    max_header_bytes: int = 16384  # request line + headers; more is a 431
    max_connections: int = 1024  # open sockets; more are answered 503 and closed
    keepalive_s: float = 5.0  # idle connections (also ones that never send a request) are closed after this
    max_connections_per_client: int = 256  # open sockets of one client address; more get 503 (0 = no cap)
    request_read_timeout_s: float = 10.0  # a request head must arrive whole in this; a body may not pause longer (408)
    model_name: str = ""  # empty = model.name
    detach: bool = False
    max_queue: int = 256
    demo_prompt: str = "def __init__(self, "  # the demo stage's completion (tree vs AR) before serving
    demo_tokens: int = 48  # 0 = no demo
    # continuous batching (kdtree/decode/scheduler.py): every running request is decoded in one target forward a step
    max_batch_tokens: int = 512  # rows per step: every running request's verify block, then prefill chunks
    kv_pool_tokens: int = 16384  # latent-cache tokens of all running requests (prompt + max_tokens + tree each); more wait
    request_timeout_s: float = 0.0  # wall-clock limit of a request, queueing included (0 = none)
    speculate_max_batch: int = 4  # more decoding requests than this step as AR (exact either way); 0 = always speculate
    # exact prefix cache (kdtree/decode/prefix_cache.py): a prompt extending a finished request's prompt + answer copies
    # their latent rows (whole pages) and prefills only the rest; the same tokens with and without it
    prefix_cache: bool = True
    prefix_cache_tokens: int = 8192  # tokens held (LRU-evicted past it); K2.6 fp32 latent: 61 x 576 x 4 B = 141 KB/token
    prefix_cache_page: int = 16  # tokens per page (a prefix matches whole pages)
    # chat output parsers (vLLM's --tool-call-parser / --reasoning-parser): K2's tool-call markers -> tool_calls
    tool_call_parser: str = "kimi_k2"  # kimi_k2 | none (markers stay text)
    # <think>...</think> -> reasoning_content: kimi_k2 (thinking on unless chat_template_kwargs.thinking=false) |
    # none | auto = kimi_k2, thinking on by default when <think> is a special token of the tokenizer (k26), off
    # otherwise (tiny: chat_template_kwargs {"thinking": true} opens <think> and splits)
    reasoning_parser: str = "auto"


@dataclass
class HealthConfig:
    url: str = ""  # empty = the engine of this run
    interval_s: float = 1.0
    stall_window_s: float = 30.0
    deadline_s: float = 600.0
    probe_timeout_s: float = 5.0
    unit: str = ""  # systemd unit for journalctl log silence
    log: str = ""  # engine log file for log silence
    pid: int = 0
    pid_ran: bool = False  # the pid is known to have run (a fleet replica's record): gone = CRASHED, not a typo
    unit_user: bool = False  # health.unit is a user unit (systemctl --user / journalctl --user)
    model: str = ""  # model name for the completion probe; empty = serve.model_name/model.name, or GET /v1/models
    api_key: str = ""  # refused (a key on a command line is in `ps`): KDTREE_API_KEY or health.api_key_file
    api_key_file: str = ""  # a file holding health.url's Bearer key (on the controller); KDTREE_API_KEY wins
    status_path: str = ""  # a kdtree status.json on the host to read when /status does not answer
    disk: str = ""  # block device holding the weights (nvme0n1, as in /proc/diskstats): its reads count as progress
    expected_bytes: int = 0  # checkpoint size in bytes for the ETA of servers that report nothing; 0 = model.path's size


@dataclass
class SamplingConfig:
    """Sampling of the generate/bench pipelines and the server's defaults (kdtree/decode/sampling.py).
    Unset (null) fields: the pipelines decode greedily unless temperature is set, then take the others from
    the checkpoint's generation_config.json, else OpenAI's; the server's requests fall back the same way."""
    temperature: Optional[float] = None  # >= 0; 0 = greedy argmax; null = pipelines greedy, server 1 (OpenAI)
    top_p: Optional[float] = None  # (0, 1]
    top_k: Optional[int] = None  # -1/0 = all tokens
    seed: Optional[int] = None  # null = a random seed per run, written to result.json/bench.json
    presence_penalty: Optional[float] = None  # [-2, 2]
    frequency_penalty: Optional[float] = None  # [-2, 2]
    repetition_penalty: Optional[float] = None  # (0, 2]
    logprobs: Optional[int] = None  # top logprobs per generated token (0..20) in result.json
    echo: bool = False  # with logprobs: also the prompt tokens' logprobs
    n: int = 1  # samples of the prompt (generate pipeline), sharing one prefill


@dataclass
@dataclass
class FleetConfig:
    """N replicas of this config (one per host) behind sglang-router (kdtree/fleet.py): fleet_serve / fleet_stop /
    fleet_restart. Replica i serves on serve.port + i."""
    hosts: List[str] = field(default_factory=lambda: ["local"])  # host config names (conf/host/NAME.yaml), one per replica
    router_port: int = 30000  # sglang-router's port on the controller
    router_policy: str = "round_robin"  # round_robin | cache_aware | power_of_two | random
    health_interval_s: float = 1.0  # the router's health-check interval (a dead replica leaves within it)


@dataclass
class RootConfig:
    model: ModelConfig = MISSING
    quant: QuantConfig = MISSING
    tp: TPConfig = MISSING
    backend: BackendConfig = MISSING
    tree: TreeConfig = MISSING
    host: HostConfig = MISSING
    engine: EngineConfig = MISSING
    pipeline: str = "serve"  # pipelines/NAME.yaml, or a path to a pipeline YAML
    prompt: str = "2+2="
    max_new_tokens: int = 16
    cache_dir: str = ""  # empty = $KDTREE_CACHE or ~/.cache/kdtree
    load: LoadConfig = field(default_factory=LoadConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)  # the fleet_* stages share it
    # + one section per stage that declares CONFIG (bench, plan, stop, ...): added by root_schema()


GROUPS = {
    "model": ModelConfig,
    "quant": QuantConfig,
    "tp": TPConfig,
    "backend": BackendConfig,
    "tree": TreeConfig,
    "host": HostConfig,
    "engine": EngineConfig,
}


def root_schema(sections: Mapping[str, type]) -> type:
    """RootConfig plus one field per stage section (name -> the stage's dataclass, its defaults the dataclass's)."""
    core = {f.name for f in fields(RootConfig)}
    clash = sorted(set(sections) & core)
    if clash:
        raise ValueError(f"stage section(s) {', '.join(clash)} clash with a shared section of RootConfig "
                         f"(kdtree/config/schema.py); rename the stage or drop its CONFIG")
    return make_dataclass("RootConfig", [(name, cls, field(default_factory=cls)) for name, cls in sorted(sections.items())],
                          bases=(RootConfig,))


def register(sections: Mapping[str, type]) -> None:
    """Register the root schema (with the stage sections) and one base schema per group (YAML files extend
    `base_<group>`). Callers: kdtree.pipeline.registry.register_schema(), which collects the stage sections."""
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=root_schema(sections))
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)


def group_config(group: str, name: str) -> DictConfig:
    """conf/<group>/<name>.yaml on its group's schema, without Hydra composition (training, tools, tests);
    `name` may also be a path to a YAML file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else CONF_DIR / group / f"{name}.yaml"
    if not path.is_absolute() and not path.exists():
        path = CONF_DIR.parent / path           # relative to the repository root
    return OmegaConf.merge(OmegaConf.structured(GROUPS[group]), OmegaConf.load(path))
