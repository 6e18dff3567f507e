"""bench_http: `pipeline=bench`'s twin over HTTP -- single-stream speed of any engine's server (kdtree, SGLang, vLLM,
llama.cpp) on bench's fixed prompts: per prompt the fastest of `repeats` streamed greedy completions of
`max_tokens`; tokens/s (output tokens over the request's seconds), TTFT (to the first token) and TPOT ((end - first
token) / (tokens - 1)). With `against=ENGINE` (started beside this run's server, as its serve pipeline) or
`against_url=URL` the same prompts are measured on that server too: one table, and a tokens-equal column (how many
prompts both answer with the same greedy text: on the same weights an exact engine gives the same tokens).
Writes bench_http.json in the run dir, then stops this run's server.

    python -m kdtree.run pipeline=bench_http                                     # kdtree's own server
    python -m kdtree.run pipeline=bench_http engine=llamacpp tree=ar bench_http.against=kdtree serve.port=30002
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from kdtree import engine_http as client
from kdtree.config.validate import read_prompts

SIDE = "controller"
NEEDS_ENGINE = True


@dataclass
class BenchHttpConfig:
    max_tokens: int = 48  # per completion (bench.max_new_tokens' default)
    repeats: int = 3  # per prompt; the fastest is kept
    against: str = ""  # an engine (kdtree | sglang | vllm | llamacpp) started beside this one and measured the same way
    against_url: str = ""  # or a running server's URL


CONFIG = BenchHttpConfig  # cfg.bench_http


def measure(url, prompts: List[str], max_tokens: int, repeats: int) -> dict:
    """Every prompt `repeats` times (the fastest kept): per-prompt figures, their sums and medians."""
    per = []
    for p in prompts:
        best = min((client.stream(url, p, max_tokens) for _ in range(repeats)), key=lambda r: r["seconds"])
        tpot = (best["seconds"] - best["ttft"]) / (best["tokens"] - 1) if best["tokens"] > 1 else 0.0
        per.append({"prompt": p, "text": best["text"], "tokens": best["tokens"], "seconds": round(best["seconds"], 4),
                    "ttft_s": round(best["ttft"], 4), "tpot_s": round(tpot, 5)})
    tokens, seconds = sum(r["tokens"] for r in per), sum(r["seconds"] for r in per)
    return {"engine": getattr(url, "engine", ""), "url": str(url), "prompts": per, "output_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "ttft_p50_s": round(statistics.median(r["ttft_s"] for r in per), 4),
            "tpot_p50_s": round(statistics.median(r["tpot_s"] for r in per), 5)}


def texts(m: dict) -> Dict[str, str]:
    return {r["prompt"]: r["text"] for r in m["prompts"]}


COLUMNS = [("engine", "engine", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"), ("TTFT p50 s", "ttft_p50_s", "{:.4f}"),
           ("TPOT p50 s", "tpot_p50_s", "{:.5f}"), ("tokens", "output_tokens", "{}"),
           ("tokens-equal", "tokens_equal", "{}")]


def run(ctx, conf: BenchHttpConfig) -> dict:
    # the options and the prompt file: kdtree.config.validate (validate_bench_http, read_prompts), at start-up
    prompts = read_prompts(str(ctx.cfg.bench.prompts or ""))   # bench's set
    engine = ctx.engine_process
    url = client.endpoint(ctx.cfg, engine.run_dir if engine is not None else ctx.run_dir)
    try:
        rows = [measure(url, prompts, conf.max_tokens, conf.repeats)]
        with client.other_server(ctx.cfg, ctx.run_dir, conf.against, conf.against_url) as other:
            if other is not None:
                rows.append(measure(other, prompts, conf.max_tokens, conf.repeats))
    finally:
        if engine is not None:                            # the pipeline ends with the bench: stop the server
            from kdtree.pipeline.engine_process import stop_engine
            stop_engine(engine.host, engine.pid, grace_s=float(ctx.cfg.stop.timeout_s) + 30.0)
    if len(rows) > 1:
        rows[1]["tokens_equal"] = rows[0]["tokens_equal"] = client.tokens_equal(texts(rows[0]), texts(rows[1]))
    out = {"max_tokens": conf.max_tokens, "repeats": conf.repeats, "rows": rows,
           "tree": {k: ctx.cfg.tree[k] for k in ("kind", "width", "depth", "budget")}}
    run_dir = Path(ctx.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "bench_http.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"[bench_http] single stream, {len(prompts)} prompts x {conf.max_tokens} tokens (fastest of "
          f"{conf.repeats}):\n{client.table(rows, COLUMNS)}\n[bench_http] {run_dir / 'bench_http.json'}", flush=True)
    return {"rows": [{k: r[k] for k in ("engine", "tokens_per_s", "ttft_p50_s", "tpot_p50_s") if k in r}
                     for r in rows]} | ({"tokens_equal": rows[0]["tokens_equal"]} if len(rows) > 1 else {})
