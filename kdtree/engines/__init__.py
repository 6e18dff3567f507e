"""Other engines under the same pipelines: the command line that serves the composed config with SGLang, vLLM or
llama.cpp (llama-cpp-python's OpenAI server), and the checks that fail at compose time when a configured feature
has no flag in that engine.

    argv = command_line(cfg)            # ['python', '-m', 'sglang.launch_server', '--model-path', ..., '--port', ...]
    env = launch_env(cfg)               # the API key where the engine reads it from the environment
    check_engine(cfg)                   # ConfigError naming the engine and the feature it lacks

`pipeline=plan engine=sglang ...` prints the exact command line; the serve pipeline's `launch` stage runs it on the
host (kdtree/stages/launch.py). FLAGS is the table the README prints: what each config key becomes per engine.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Dict, List

from kdtree.errors import ConfigError

ENGINES = ("kdtree", "sglang", "vllm", "llamacpp")
FOREIGN = ENGINES[1:]
LAUNCHER = {                           # the documented entry points (engine.command overrides the prefix)
    "sglang": ["-m", "sglang.launch_server"],
    "vllm": ["-m", "vllm.entrypoints.openai.api_server"],
    "llamacpp": ["-m", "llama_cpp.server"],
}
# config key -> the flag each engine takes for it (None: the engine has no such setting)
FLAGS: Dict[str, Dict[str, object]] = {
    "model.path (checkpoint)": {"sglang": "--model-path", "vllm": "--model", "llamacpp": "--model (the GGUF file)"},
    "tp.size": {"sglang": "--tp-size", "vllm": "--tensor-parallel-size", "llamacpp": None},
    "serve.host": {"sglang": "--host", "vllm": "--host", "llamacpp": "--host"},
    "serve.port": {"sglang": "--port", "vllm": "--port", "llamacpp": "--port"},
    "serve.model_name": {"sglang": "--served-model-name", "vllm": "--served-model-name", "llamacpp": "--model_alias"},
    "model.max_position_embeddings": {"sglang": "--context-length", "vllm": "--max-model-len",
                                      "llamacpp": "--n_ctx"},
    "API key (KDTREE_API_KEY / serve.api_key_file)": {"sglang": "--api-key (argv: SGLang reads no variable)",
                                                      "vllm": "VLLM_API_KEY (environment)",
                                                      "llamacpp": "API_KEY (environment)"},
    "tree.kind=chain|ddtree": {"sglang": "--speculative-algorithm engine.speculative_algorithm",
                               "vllm": "--speculative-config {method: engine.speculative_algorithm}",
                               "llamacpp": None},
    "tree.depth": {"sglang": "--speculative-num-steps", "vllm": "--speculative-config num_speculative_tokens",
                   "llamacpp": None},
    "tree.width": {"sglang": "--speculative-eagle-topk", "vllm": None, "llamacpp": None},
    "tree.budget": {"sglang": "--speculative-num-draft-tokens (budget + 1: the verify block)", "vllm": None,
                    "llamacpp": None},
    "drafter (model.path/drafter)": {"sglang": "--speculative-draft-model-path",
                                     "vllm": "--speculative-config model", "llamacpp": None},
    "backend.threads": {"sglang": None, "vllm": None, "llamacpp": "--n_threads"},
    "engine.extra_args": {"sglang": "appended", "vllm": "appended", "llamacpp": "appended"},
}


def _name(cfg) -> str:
    name = str(cfg.engine.name)
    if name not in ENGINES:
        raise ConfigError(f"engine={name} is unknown; use engine=kdtree, sglang, vllm or llamacpp")
    return name


def check_engine(cfg) -> None:
    """Compose-time: every configured feature has a flag in the chosen engine, else one line naming both."""
    name = _name(cfg)
    if name == "kdtree":
        return
    tree, tp = cfg.tree, int(cfg.tp.size)
    if name == "llamacpp":
        if tp != 1:
            raise ConfigError(f"engine=llamacpp has no tensor parallelism (tp={tp}); use tp=1 or engine=sglang|vllm")
        if tree.kind != "ar":
            raise ConfigError(f"engine=llamacpp serves no draft model (tree={tree.kind}): llama.cpp's server has no "
                              f"DFlash/EAGLE speculation; use tree=ar with engine=llamacpp")
    if name == "vllm" and tree.kind == "ddtree" and int(tree.width) != 1:
        raise ConfigError(f"engine=vllm drafts a chain (--speculative-config num_speculative_tokens), not a tree: "
                          f"tree=ddtree tree.width={tree.width} has no vLLM flag; use tree=chain or tree.width=1")
    if cfg.serve.cors_origins and name != "vllm":
        raise ConfigError(f"engine={name} has no CORS origins flag (serve.cors_origins={list(cfg.serve.cors_origins)}); "
                          f"leave serve.cors_origins empty")


def checkpoint_of(cfg) -> str:
    """The model the engine reads: model.path (llama.cpp: engine.gguf, the exported GGUF)."""
    if _name(cfg) == "llamacpp":
        return str(cfg.engine.gguf)
    return str(cfg.model.path or "")


def _speculative(cfg, name: str) -> List[str]:
    tree = cfg.tree
    if tree.kind == "ar":
        return []
    draft = str(cfg.engine.draft_model_path or (Path(str(cfg.model.path)) / "drafter" if cfg.model.path else ""))
    algo = str(cfg.engine.speculative_algorithm)
    depth = int(tree.depth)
    width, budget = (1, depth) if tree.kind == "chain" else (int(tree.width), int(tree.budget))
    if name == "sglang":
        return ["--speculative-algorithm", algo, "--speculative-draft-model-path", draft,
                "--speculative-num-steps", str(depth), "--speculative-eagle-topk", str(width),
                "--speculative-num-draft-tokens", str(budget + 1)]
    spec = {"method": algo.lower(), "model": draft, "num_speculative_tokens": depth}
    return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]


def command_line(cfg, api_key: str = "") -> List[str]:
    """The argv that serves this config with cfg.engine.name (the key only where the engine takes it in argv)."""
    name = _name(cfg)
    if name == "kdtree":
        raise ConfigError("engine=kdtree runs in the engine process itself (load, warmup, serve stages); "
                          "command_line is for engine=sglang|vllm|llamacpp")
    check_engine(cfg)
    s, m = cfg.serve, cfg.model
    python = str(cfg.engine.python or cfg.host.python or sys.executable)   # "": the engine process's own Python
    prefix = list(cfg.engine.command) if cfg.engine.command else [python] + LAUNCHER[name]
    served = str(s.model_name or m.name)
    ctx = str(int(m.max_position_embeddings))
    if name == "sglang":
        argv = ["--model-path", checkpoint_of(cfg), "--tp-size", str(int(cfg.tp.size)), "--host", str(s.host),
                "--port", str(int(s.port)), "--served-model-name", served, "--context-length", ctx,
                "--trust-remote-code"] + _speculative(cfg, name)
        if api_key:
            argv += ["--api-key", api_key]
    elif name == "vllm":
        argv = ["--model", checkpoint_of(cfg), "--tensor-parallel-size", str(int(cfg.tp.size)), "--host",
                str(s.host), "--port", str(int(s.port)), "--served-model-name", served, "--max-model-len", ctx,
                "--trust-remote-code"] + _speculative(cfg, name)
        if s.cors_origins:
            argv += ["--allowed-origins", json.dumps(list(s.cors_origins))]
    else:
        argv = ["--model", checkpoint_of(cfg), "--host", str(s.host), "--port", str(int(s.port)),
                "--model_alias", served, "--n_ctx", ctx,
                "--interrupt_requests", "False",   # queue concurrent requests (its default cuts the running one short)
                "--type_k", "0", "--type_v", "0"]  # F32 KV cache (GGML_TYPE_F32), as kdtree's latent cache: the
        if int(cfg.backend.threads):           # default F16 cache rounds it, and greedy tokens drift from kdtree's
            argv += ["--n_threads", str(int(cfg.backend.threads))]
    return prefix + argv + [str(a) for a in cfg.engine.extra_args]


def launch_env(cfg, api_key: str) -> Dict[str, str]:
    """Variables the engine reads its API key from (vLLM, llama.cpp); {} for SGLang (argv) or no key."""
    if not api_key:
        return {}
    return {"vllm": {"VLLM_API_KEY": api_key}, "llamacpp": {"API_KEY": api_key}}.get(_name(cfg), {})


def printable(argv: List[str], api_key: str = "") -> str:
    """The command line as a shell would read it, with the key (if any) shown as <redacted>."""
    return " ".join(shlex.quote(a) if a != api_key or not api_key else "<redacted>" for a in argv)


__all__ = ["ENGINES", "FLAGS", "FOREIGN", "check_engine", "checkpoint_of", "command_line", "launch_env", "printable"]
