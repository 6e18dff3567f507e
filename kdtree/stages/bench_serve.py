"""bench_serve: the serving benchmark -- N concurrent clients against this run's real server process (issue 18).

    python -m kdtree.run pipeline=bench_serve backend=cpu            # N = 1, 4, 16, 64; bench_serve.json + .png

After health_poll says READY: every fixed prompt once alone (the solo answers), then for each N in `clients` N
client threads each send `requests` streamed completions (prompts in turn, `max_tokens` each) at once. Per N:
output tokens/s and requests/s over the wall time of the round, time to first token and time per output token
(p50/p95, per request: (end - first token) / (tokens - 1)), `exact` (every answer's text equals its solo answer);
`scaling` = tokens/s at N / tokens/s at 1. `short_latency_ratio`: a `short_tokens` request's latency while a
`long_tokens` request streams, over its latency alone (median of 3 each). `shared_prefix` (shared_prefix_tokens > 0):
a ~shared_prefix_tokens system prompt + short distinct questions, TTFT p50 (requests one at a time) and tokens/s at
N = shared_prefix_clients with the prefix cache off, then on, on the same server (POST /prefix_cache), and whether
every answer is the same both ways (`exact`, folded into the top-level `exact`). Then the engine is stopped (SIGTERM:
it drains) so the pipeline ends. Figures are ratios within one run; a shared machine varies between runs.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from kdtree import engine_http as client
from kdtree.engine_http import stream  # noqa: F401  (bench_serve.stream: one streamed completion, any engine)
from kdtree.config.validate import read_prompts
from kdtree.errors import PipelineError

SIDE = "controller"
NEEDS_ENGINE = True


@dataclass
class BenchServeConfig:
    clients: List[int] = field(default_factory=lambda: [1, 4, 16, 64])  # concurrent streaming clients per round
    requests: int = 2  # completions per client per round
    max_tokens: int = 64  # per completion
    short_tokens: int = 4  # short_latency_ratio: this request's latency beside a long_tokens one, over alone
    long_tokens: int = 1000
    shared_prefix_tokens: int = 2000  # shared-prefix workload: a system prompt of ~this many tokens (0: skip it)
    shared_prefix_clients: int = 16  # its concurrent clients (throughput with / without the prefix cache)
    shared_prefix_requests: int = 8  # its sequential requests (TTFT p50 with / without the prefix cache)
    against: str = ""  # an engine (kdtree | sglang | vllm | llamacpp) started beside this one and measured the same way
    against_url: str = ""  # or a running server's URL to measure the same way (one table, tokens-equal column)


CONFIG = BenchServeConfig  # cfg.bench_serve: this stage's options (kdtree/pipeline/registry.py)


def _pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def round_of(url: str, n: int, prompts: List[str], requests: int, max_tokens: int, solo: Dict[str, str]) -> dict:
    jobs = [prompts[(c * requests + k) % len(prompts)] for c in range(n) for k in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        out = list(pool.map(lambda p: (p, stream(url, p, max_tokens)), jobs))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for _, r in out)
    tpot = [(r["seconds"] - r["ttft"]) / (r["tokens"] - 1) for _, r in out if r["tokens"] > 1]
    ttft = [r["ttft"] for _, r in out]
    return {"clients": n, "requests": len(out), "seconds": round(wall, 3), "output_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(out) / wall, 3),
            "ttft_p50_s": round(_pct(ttft, 0.5), 4), "ttft_p95_s": round(_pct(ttft, 0.95), 4),
            "tpot_p50_s": round(_pct(tpot, 0.5), 5), "tpot_p95_s": round(_pct(tpot, 0.95), 5),
            "exact": all(r["text"] == solo[p] for p, r in out)}


def short_latency_ratio(url: str, prompt: str, short_tokens: int, long_tokens: int) -> dict:
    alone = statistics.median(stream(url, prompt, short_tokens)["seconds"] for _ in range(3))
    beside = []
    for _ in range(3):
        hang_up, started = threading.Event(), threading.Event()

        def long_request():
            try:
                stream(url, prompt, long_tokens, stop=hang_up)
            finally:
                started.set()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.3)                                  # the long request is admitted and decoding
        beside.append(stream(url, prompt, short_tokens)["seconds"])
        hang_up.set()
        t.join(600)
    return {"short_alone_s": round(alone, 4), "short_beside_long_s": round(statistics.median(beside), 4),
            "short_latency_ratio": round(statistics.median(beside) / alone, 3)}


def system_prompt(chars: int) -> str:
    """An agent's system prompt of `chars` characters (tool definitions)."""
    lines, i = ["You are a careful agent. Answer with the tool you would call and why, in one line."], 0
    while sum(len(x) + 1 for x in lines) < chars:
        lines.append(f"Tool {i}: lookup_{i}(key: str, limit: int = {i % 7 + 1}) returns the records of table t{i} "
                     f"whose key starts with `key`, newest first.")
        i += 1
    return "\n".join(lines)[:chars]


def set_prefix_cache(url: str, enabled: bool) -> dict:
    req = urllib.request.Request(url + "/prefix_cache", data=json.dumps({"enabled": enabled}).encode(),
                                 method="POST", headers=client._headers(url))
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def shared_prefix(url: str, conf: "BenchServeConfig", tokens: int, tokenizer_chars: float) -> dict:
    """A ~`tokens`-token system prompt + short distinct questions: TTFT p50 of shared_prefix_requests requests
    one at a time, and tokens/s of shared_prefix_clients clients (other questions), with the prefix cache off, then
    on (one server, POST /prefix_cache); `exact`: every answer the same both ways. tokenizer_chars: characters per
    token (the byte tokenizer: 1; ~4 for K2's BPE on this English text)."""
    system = system_prompt(int(tokens * tokenizer_chars))
    n, k = int(conf.shared_prefix_clients), int(conf.shared_prefix_requests)
    questions = [f"{system}\nUser {i}: which tool lists table t{(7 * i) % 50}, at most {i % 5 + 1} rows?\nAgent:"
                 for i in range(k + n)]
    out, answers = {}, {}
    for mode in ("off", "on"):
        set_prefix_cache(url, mode == "on")
        if mode == "on":
            stream(url, system, 2)                       # one earlier request: the system prompt is cached
        seq = [stream(url, q, conf.max_tokens) for q in questions[:k]]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            par = list(pool.map(lambda q: stream(url, q, conf.max_tokens), questions[k:]))
        wall = time.perf_counter() - t0
        answers[mode] = [r["text"] for r in seq + par]
        out[mode] = {"ttft_p50_s": round(_pct([r["ttft"] for r in seq], 0.5), 4),
                     "prompt_tokens_p50": int(_pct([r["prompt_tokens"] for r in seq], 0.5)),
                     "cached_tokens_p50": int(_pct([r["cached_tokens"] for r in seq], 0.5)),
                     "tokens_per_s": round(sum(r["tokens"] for r in par) / wall, 2),     # at N = clients
                     "ttft_p50_s_concurrent": round(_pct([r["ttft"] for r in par], 0.5), 4)}
    set_prefix_cache(url, True)
    return {"shared_prefix_chars": len(system), "clients": n, "requests": k, **out,
            "ttft_speedup": round(out["off"]["ttft_p50_s"] / max(out["on"]["ttft_p50_s"], 1e-9), 2),
            "exact": answers["off"] == answers["on"]}


def shared_prefix_round(ctx, url: str, conf: BenchServeConfig) -> dict:
    """shared_prefix() with a system prompt that fits the server's context (max_model_len) beside the question, the
    answer and the tree's verify block; printed."""
    byte_tok = str(ctx.cfg.model.get("tokenizer", "")) == "byte"
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        max_len = int(json.loads(r.read())["data"][0].get("max_model_len") or 0)
    tree = ctx.cfg.tree
    room = max_len - conf.max_tokens - (int(tree.budget) + 1 if str(tree.kind) != "ar" else 0) - 80   # 80: question
    n_prefix = int(conf.shared_prefix_tokens)
    if 0 < room < n_prefix:                         # the tiny's 2048-token context: what fits beside the rest
        print(f"[bench_serve] shared prefix: {room} tokens instead of {n_prefix} (the context is {max_len} "
              f"tokens)", flush=True)
        n_prefix = room
    try:
        shared = shared_prefix(url, conf, n_prefix, 1.0 if byte_tok else 4.0)
    except urllib.error.HTTPError as e:              # 409: the server runs without a prefix cache
        raise PipelineError(f"bench_serve: shared-prefix workload: POST /prefix_cache answered {e.code} "
                            f"({e.read().decode(errors='replace')[:200]}); serve with serve.prefix_cache=true "
                            f"or set bench_serve.shared_prefix_tokens=0") from None
    print(f"[bench_serve] shared prefix ({shared['shared_prefix_chars']} chars): TTFT p50 "
          f"{shared['off']['ttft_p50_s']:.3f} s without the prefix cache, {shared['on']['ttft_p50_s']:.3f} s "
          f"with ({shared['ttft_speedup']:.1f}x, {shared['on']['cached_tokens_p50']} tokens cached); "
          f"N={shared['clients']}: {shared['off']['tokens_per_s']:.1f} -> {shared['on']['tokens_per_s']:.1f} tok/s; "
          f"exact {shared['exact']}",
          flush=True)
    return shared


def plot(rounds: List[dict], path: Path, others: Optional[Dict[str, List[dict]]] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rs in {"": rounds, **(others or {})}.items():   # the other engine's curves beside this one's
        ns, tag = [r["clients"] for r in rs], f"{name} " if name else ""
        a.plot(ns, [r["tokens_per_s"] for r in rs], "o-", label=name or "this run")
        for key, style in (("ttft_p50_s", "o-"), ("ttft_p95_s", "o--"), ("tpot_p50_s", "s-"), ("tpot_p95_s", "s--")):
            b.plot(ns, [r[key] for r in rs], style, label=tag + key.replace("_s", ""))
    a.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    if others:
        a.legend()
    b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="seconds", title="latency")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _engine_url(ctx) -> client.Endpoint:
    engine = ctx.engine_process
    return client.endpoint(ctx.cfg, engine.run_dir if engine is not None else ctx.run_dir)


def _compare(ctx, conf: BenchServeConfig, texts: List[str], clients: List[int], solo: Dict[str, str]) -> Optional[dict]:
    """The same solo answers and rounds against bench_serve.against (started) or .against_url; None without."""
    with client.other_server(ctx.cfg, ctx.run_dir, conf.against, conf.against_url) as other:
        if other is None:
            return None
        theirs = {p: stream(other, p, conf.max_tokens)["text"] for p in texts}
        rounds = [round_of(other, n, texts, conf.requests, conf.max_tokens, theirs) for n in clients]
        return {"engine": other.engine, "url": str(other), "rounds": rounds, "solo": theirs,
                "tokens_equal": client.tokens_equal(solo, theirs)}


def side_by_side(mine: str, rounds: List[dict], other: dict) -> str:
    """One table: both engines' rounds, and how many prompts they answer with the same greedy tokens."""
    rows = [{"engine": e, **r, "tokens_equal": other["tokens_equal"]}
            for e, rs in ((mine, rounds), (other["engine"], other["rounds"])) for r in rs]
    return client.table(rows, [("engine", "engine", "{}"), ("N", "clients", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"),
                               ("req/s", "requests_per_s", "{:.2f}"), ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
                               ("TPOT p50 s", "tpot_p50_s", "{:.4f}"), ("exact", "exact", "{}"),
                               ("tokens-equal", "tokens_equal", "{}")])


def run(ctx, conf: BenchServeConfig) -> dict:
    requests, max_tokens, short_tokens, long_tokens = conf.requests, conf.max_tokens, conf.short_tokens, conf.long_tokens
    prompts = ctx.cfg.bench.prompts  # bench's prompt set
    clients = [int(n) for n in conf.clients]   # the options: kdtree.config.validate.validate_bench_serve
    texts = read_prompts(prompts)
    url = _engine_url(ctx)
    try:
        solo = {p: stream(url, p, max_tokens)["text"] for p in texts}
        rounds = [round_of(url, n, texts, requests, max_tokens, solo) for n in sorted(set([1] + clients))]
        base = rounds[0]["tokens_per_s"]
        for r in rounds:
            r["scaling"] = round(r["tokens_per_s"] / base, 3)
            print(f"[bench_serve] N={r['clients']:>3}: {r['tokens_per_s']:8.1f} tok/s ({r['scaling']:.2f}x) "
                  f"{r['requests_per_s']:6.2f} req/s  TTFT p50/p95 {r['ttft_p50_s']:.3f}/{r['ttft_p95_s']:.3f} s  "
                  f"TPOT p50/p95 {r['tpot_p50_s'] * 1e3:.1f}/{r['tpot_p95_s'] * 1e3:.1f} ms  exact {r['exact']}",
                  flush=True)
        short = short_latency_ratio(url, texts[0], short_tokens, long_tokens)
        shared = None
        if conf.shared_prefix_tokens > 0 and url.engine != "kdtree":   # off/on needs kdtree's POST /prefix_cache
            print(f"[bench_serve] shared prefix: skipped for engine={url.engine} (its prefix cache cannot be turned "
                  f"off and on through kdtree's POST /prefix_cache)", flush=True)
        elif conf.shared_prefix_tokens > 0:
            shared = shared_prefix_round(ctx, url, conf)
        compare = _compare(ctx, conf, texts, sorted(set([1] + clients)), solo)
    finally:
        engine = ctx.engine_process                      # the pipeline ends with the bench: stop the server
        if engine is not None:
            from kdtree.pipeline.engine_process import stop_engine
            stop_engine(engine.host, engine.pid, grace_s=float(ctx.cfg.stop.timeout_s) + 30.0)
    out = {"url": url, "max_tokens": max_tokens, "requests_per_client": requests, "rounds": rounds,
           "scaling": {str(r["clients"]): r["scaling"] for r in rounds},
           "exact": all(r["exact"] for r in rounds) and (shared is None or shared["exact"]), **short,
           "shared_prefix": shared, "engine": url.engine, "solo": solo,
           **({"compare": compare} if compare else {}),
           "backend": str(ctx.cfg.backend.name) if "name" in ctx.cfg.backend else "",
           "tree": {k: ctx.cfg.tree[k] for k in ("kind", "width", "depth", "budget")},
           "serve": {k: ctx.cfg.serve[k] for k in ("max_batch_tokens", "kv_pool_tokens", "speculate_max_batch",
                                                    "prefix_cache_tokens", "prefix_cache_page")}}
    run_dir = Path(ctx.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "bench_serve.json").write_text(json.dumps(out, indent=2) + "\n")
    others = {f"{compare['engine']} (against)": compare["rounds"]} if compare else None
    plot(rounds, run_dir / "bench_serve.png", others)
    if compare:
        print(f"[bench_serve] side by side (greedy, the same prompts):\n{side_by_side(url.engine, rounds, compare)}",
              flush=True)
    print(f"[bench_serve] short_latency_ratio {out['short_latency_ratio']:.2f} "
          f"({out['short_alone_s']:.3f} s alone, {out['short_beside_long_s']:.3f} s beside a {long_tokens}-token "
          f"request); exact {out['exact']}; {run_dir / 'bench_serve.json'}", flush=True)
    return {k: out[k] for k in ("scaling", "exact", "short_latency_ratio")} | \
        ({"shared_prefix_ttft_speedup": shared["ttft_speedup"]} if shared else {}) | \
        ({"tokens_equal": compare["tokens_equal"]} if compare else {})
