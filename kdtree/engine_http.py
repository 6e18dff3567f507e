"""The benchmarks' HTTP side, for any engine's OpenAI server (kdtree, SGLang, vLLM, llama.cpp): one streamed greedy
completion with its timings, the server a run serves on, and a second server to compare against (another engine
started as this run's serve pipeline, or a URL), side by side in one table with a tokens-equal column.

    ep = endpoint(cfg, run_dir)                     # Endpoint (a str: the base URL) with the model name and the key
    r = stream(ep, "def f(", 32)                    # {"text", "tokens", "ttft", "seconds"}
    with other_server(cfg, run_dir, "llamacpp", "") as other: ...   # started, then stopped (pipeline=stop)

tokens-equal: both servers' greedy (temperature 0) answers to the same prompts are the same text; on the same
weights an exact engine gives the same tokens, so the count says how many prompts agree.
"""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from omegaconf import OmegaConf

from kdtree.config.secrets import api_key
from kdtree.errors import ConfigError, PipelineError

# overrides of this run the compared server does not inherit (it gets its own engine, port, run dir)
NOT_INHERITED = ("pipeline=", "engine=", "serve.port=", "serve.detach=", "hydra.")


class Endpoint(str):
    """A server's base URL (a str, so it goes wherever a URL went) with the model name and the API key to send."""

    def __new__(cls, url: str, model: str = "", api_key: str = "", engine: str = ""):
        self = super().__new__(cls, url.rstrip("/"))
        self.model, self.api_key, self.engine = model, api_key, engine
        return self


def _headers(url) -> Dict[str, str]:
    h = {"Content-Type": "application/json"}
    key = getattr(url, "api_key", "")
    if key:
        h["Authorization"] = f"Bearer {key}"
    return h


def stream(url, prompt: str, max_tokens: int, stop: Optional[threading.Event] = None) -> Dict[str, float]:
    """One streamed greedy completion: its text, tokens (usage; else one per content chunk, as servers without
    stream usage send them), seconds to the first token and to the end."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if getattr(url, "model", ""):
        body["model"] = url.model
    if getattr(url, "engine", "") == "llamacpp":   # llama-cpp-python's default repeat_penalty 1.1 applies even at
        body["repeat_penalty"] = 1.0               # temperature 0: greedy as the OpenAI API means it
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers=_headers(url))
    t0 = time.perf_counter()
    text, tokens, chunks, first, cached, prompt_tokens = "", 0, 0, None, 0, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise PipelineError(f"the server at {url} answered an error: {ev['error'].get('message')}")
            if ev.get("usage"):
                tokens = int(ev["usage"]["completion_tokens"])
                cached = int((ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                prompt_tokens = int(ev["usage"].get("prompt_tokens") or 0)
            piece = "".join(c.get("text") or "" for c in ev.get("choices") or [])
            if piece:
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
            text += piece
            if stop is not None and stop.is_set():      # the caller is done with it: hang up (cancels it)
                break
    end = time.perf_counter() - t0
    return {"text": text, "tokens": tokens or chunks, "ttft": first if first is not None else end, "seconds": end,
            "cached_tokens": cached, "prompt_tokens": prompt_tokens}


def _model(cfg) -> str:
    return str(cfg.serve.model_name or cfg.model.name)


def _key(cfg) -> str:
    """The key the servers check, when this side can read it (KDTREE_API_KEY, or a key file here too)."""
    try:
        return api_key(cfg.serve)
    except ConfigError:
        return ""


def endpoint(cfg, run_dir, engine: str = "") -> Endpoint:
    """The server of the serve run in run_dir: kdtree's status.json names its URL; another engine serves on
    serve.host:serve.port (0.0.0.0 reached as 127.0.0.1)."""
    status = Path(run_dir) / "status.json"
    url = json.loads(status.read_text()).get("url") if status.is_file() else None
    if not url:
        s = cfg.serve
        if not int(s.port):
            raise PipelineError(f"{status} names no server url and serve.port=0; give the server a port")
        bind = "127.0.0.1" if s.host in ("0.0.0.0", "", "::") else s.host
        url = f"http://{bind}:{int(s.port)}"
    return Endpoint(url, _model(cfg), _key(cfg), engine or str(cfg.engine.name))


def _inherited(run_dir: Path) -> List[str]:
    saved = Path(run_dir) / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(saved)] if saved.is_file() else []
    return [o for o in overrides if not o.startswith(NOT_INHERITED)]


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def other_server(cfg, run_dir, engine: str, url: str, tag: str = "against") -> Iterator[Optional[Endpoint]]:
    """The server to compare with: `url` as it is, or `engine` started as this run's serve pipeline (same
    overrides, its own port, detached, run dir <run_dir>/<tag>-<engine>) and stopped (pipeline=stop) on exit;
    None when neither is given."""
    if url:
        yield Endpoint(url, _model(cfg), _key(cfg), engine or "other")
        return
    if not engine:
        yield None
        return
    d = Path(run_dir) / f"{tag}-{engine}"
    argv = [sys.executable, "-m", "kdtree.run", "pipeline=serve", f"engine={engine}", f"serve.port={_free_port()}",
            "serve.detach=true", "serve.demo_tokens=0", f"hydra.run.dir={d}", *_inherited(Path(run_dir))]
    print(f"[compare] starting engine={engine}: {' '.join(argv[3:])}", flush=True)
    r = subprocess.run(argv, capture_output=True, text=True)
    try:
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-6:])
            raise PipelineError(f"engine={engine} to compare with did not become READY (exit {r.returncode}):\n{tail}"
                                f"\nsee {d}")
        port = int(OmegaConf.load(d / ".hydra" / "config.yaml").serve.port)
        composed = OmegaConf.merge(cfg, {"serve": {"port": port}})
        yield endpoint(composed, d, engine)
    finally:
        subprocess.run([sys.executable, "-m", "kdtree.run", "pipeline=stop", f"stop.run_dir={d}"],
                       capture_output=True, text=True)


def tokens_equal(a: Dict[str, str], b: Dict[str, str]) -> str:
    """How many prompts both servers answered with the same greedy text: 'k/n'."""
    return f"{sum(a[p] == b.get(p) for p in a)}/{len(a)}"


def table(rows: List[dict], columns: List[tuple]) -> str:
    """rows as an aligned text table; columns = [(header, key, format)]."""
    cells = [[h for h, _, _ in columns]] + [[fmt.format(r.get(k, "")) if k in r else "-" for _, k, fmt in columns]
                                            for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) for i in range(len(columns))) for c in cells)


__all__ = ["Endpoint", "endpoint", "other_server", "stream", "table", "tokens_equal"]
