"""The engine: one loaded target (+ drafter) + tokenizer + decoder, assembled from the composed config.

    engine = Engine.from_config(cfg, status=status_file)   # resolve/generate the checkpoint, load, build
    result = engine.generate(engine.tokenizer.encode("2+2="), max_new_tokens=16)
    req = engine.submit(Request(ids, 16, sampling=params, on_tokens=send))   # the server's way in
    text = engine.tokenizer.decode(result.tokens)
    # sampling (HTTP front end): fields -> SamplingParams (one-line SamplingError naming the field, .param)
    params = SamplingParams.from_openai(body, defaults=engine.sampling_defaults())
    result = engine.generate(ids, 16, sampling=params)      # tokens, logprobs, seed, finish_reason
    results = engine.generate_n(ids, 16, sampling=params)   # params.n samples sharing one prefill

The engine owns the one Scheduler (kdtree/decode/scheduler.py) that decides every token: generate, generate_n,
the demo, warm-up, bench and the server all submit Requests to it (the server runs its thread; the others step it
until their request is done), so warm-up warms exactly the shapes the server runs.
Stages (load, generate, warmup, demo, serve, bench) share one Engine through EngineState.of(ctx).engine.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

from omegaconf import OmegaConf

from kdtree.backends import get_ops
from kdtree.backends.native import auto_threads as native_auto_threads
from kdtree.backends.native_forward import keeps_bf16
from kdtree.checkpoint.loader import check_checkpoint, load_checkpoint, load_drafter, load_options, resident_bytes
from kdtree.checkpoint.tiny import ensure_tiny_checkpoint, is_generated
from kdtree.config.paths import cache_dir
from kdtree.decode import generate_n, run_request
from kdtree.decode.prefix_cache import PrefixCache
from kdtree.decode.request import Request
from kdtree.decode.result import GenerationResult
from kdtree.decode.sampling import SamplingParams
from kdtree.decode.scheduler import Scheduler
from kdtree.errors import ConfigError
from kdtree.model.target import build_drafter, build_target
from kdtree.parallel.launch import launch_tp
from kdtree.tokenizer import load_tokenizer

AR_TREE = OmegaConf.create({"kind": "ar", "width": 1, "depth": 0, "budget": 0})  # plain greedy, no drafter
# HF generation_config.json keys that set sampling defaults (the ones vLLM's --generation-config reads)
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# sampling.* keys that shape the distribution (server defaults); seed, logprobs, echo, n are per run/request
DISTRIBUTION_KEYS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty")
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}
PENALTY_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def resolve_checkpoint(cfg) -> Path:
    """model.path, or the embedded tiny checkpoint (generated deterministically on first use)."""
    if cfg.model.path:
        return Path(cfg.model.path).expanduser()
    if not is_generated(cfg.model.name):
        raise ConfigError(f"model.path is empty for model={cfg.model.name}; set model.path=/path/to/checkpoint")
    return Path(ensure_tiny_checkpoint(cfg.model, cfg.quant, cache_dir(cfg)))


def generation_config_defaults(checkpoint: Path) -> dict:
    """The sampling defaults a checkpoint's generation_config.json sets ({} when it has none)."""
    path = Path(checkpoint) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e}); fix or remove it") from None
    return {k: data[k] for k in GENERATION_CONFIG_KEYS if data.get(k) is not None}


@dataclass
class LoadReport:
    checkpoint: str
    bytes_read: int
    seconds: float
    mb_s: float
    extra: dict = field(default_factory=dict)


class Engine:
    def __init__(self, cfg, tokenizer, model, drafter, checkpoint: Path, load_report: LoadReport):
        self.cfg, self.tokenizer, self.model, self.drafter = cfg, tokenizer, model, drafter
        self.checkpoint, self.load_report = checkpoint, load_report
        self.eos_id = int(cfg.model.eos_token_id)
        self.max_context = int(cfg.model.max_position_embeddings)
        self.model_name = cfg.serve.get("model_name", "") or cfg.model.name
        self._scheduler: Optional[Scheduler] = None

    @classmethod
    def from_config(cls, cfg, status: Any = None,
                    progress: Optional[Callable[[int, int, int, int], None]] = None) -> "Engine":
        t0 = time.perf_counter()
        if status is not None:
            status.update(phase="loading", model=cfg.model.name, quant=cfg.quant.method)
        ckpt = resolve_checkpoint(cfg)
        # every check that needs no weights (config.json of target and drafter, tensor layout, tokenizer
        # files) before the first weight byte: on K2.6 the load takes 10+ minutes
        check_checkpoint(ckpt, cfg.model, cfg.quant, drafter=cfg.tree.kind != "ar")
        tokenizer = load_tokenizer(cfg.model, ckpt)
        ops = get_ops(cfg.backend)
        if hasattr(ops, "lib"):   # native: this process's share of the cores (tp ranks share the host)
            ops.lib.set_threads(native_auto_threads(cfg.backend, int(cfg.tp.size)))
        if int(cfg.tp.size) > 1:  # ranks 1..N-1 as child processes; model = rank 0's TPModel proxy
            model, stats = launch_tp(cfg, ckpt, ops, progress=progress)
            resident = list(model.resident_bytes_per_rank)
        else:
            rss0 = resident_bytes()
            weights, stats = load_checkpoint(ckpt, cfg.model, cfg.quant, progress=progress,
                                             bf16=keeps_bf16(ops), **load_options(cfg.load))
            model = build_target(cfg.model, weights, ops)
            del weights
            resident = [resident_bytes() - rss0]
        try:
            drafter = None
            if cfg.tree.kind != "ar":
                rss0 = resident_bytes()
                dweights, dstats = load_drafter(ckpt, cfg.model, cfg.quant, bf16=keeps_bf16(ops),
                                                **load_options(cfg.load, throttle=False))
                stats.bytes_read += dstats.bytes_read
                drafter = build_drafter(cfg.model, dweights, model)
                del dweights
                resident[0] += resident_bytes() - rss0     # rank 0 holds the whole drafter
        except BaseException:
            model.close()
            raise
        seconds = time.perf_counter() - t0
        report = LoadReport(str(ckpt), int(stats.bytes_read), seconds,
                            stats.bytes_read / 1e6 / max(seconds, 1e-9))
        report.extra["resident_bytes_per_rank"] = resident   # RSS growth of each rank over its load (plan's check)
        if hasattr(model, "bytes_read_per_rank"):
            report.extra["tp_bytes_read_per_rank"] = list(model.bytes_read_per_rank)
        return cls(cfg, tokenizer, model, drafter, ckpt, report)

    def graph_rows(self, rows: Sequence[int]) -> bool:
        """backend=cuda with the native forward: target forwards of exactly these row counts are captured as CUDA
        graphs on first use and replayed after (kd_model_set_graph_rows); False (nothing to capture) elsewhere."""
        return self.model.graph_rows(rows)

    def graph_stats(self) -> dict:
        """{graphs, replays, eager, buckets, capture_s} of the native forward (zeros where nothing is captured)."""
        return self.model.graph_stats()

    def close(self) -> None:
        """Stop the scheduler's thread and the tensor-parallel workers (tp > 1). Idempotent."""
        if self._scheduler is not None:
            self._scheduler.stop()
        self.model.close()

    def sampling_defaults(self) -> dict:
        """Defaults of an HTTP request's omitted sampling fields: OpenAI's (temperature 1), overridden by the
        checkpoint's generation_config.json, overridden by the operator's sampling.* config keys
        (the distribution's keys only: seed, logprobs, echo and n stay per request)."""
        out = dict(OPENAI_DEFAULTS)
        out.update(generation_config_defaults(self.checkpoint))
        conf = self.cfg.get("sampling") or {}
        out.update({k: conf.get(k) for k in DISTRIBUTION_KEYS if conf.get(k) is not None})
        return out

    def pipeline_sampling(self) -> SamplingParams:
        """The generate/bench pipelines' sampling: greedy unless sampling.temperature is set (so their results
        stay the greedy ones by default); with it, unset fields as sampling_defaults(). Seed resolved."""
        conf = self.cfg.get("sampling") or {}
        run = {k: conf.get(k) for k in ("seed", "logprobs", "echo", "n") + PENALTY_KEYS}
        if conf.get("temperature") is None:
            return SamplingParams.merged(run, temperature=0.0)
        return SamplingParams.merged(self.sampling_defaults(), run).resolved()

    @property
    def scheduler(self) -> Scheduler:
        """The one scheduler of this engine (built on first use: it reserves the paged latent-cache pool,
        serve.kv_pool_tokens rows in pages of serve.prefix_cache_page, with the continuous-batching knobs
        serve.max_batch_tokens / request_timeout_s / speculate_max_batch, and the prefix cache over the pool's pages:
        serve.prefix_cache / prefix_cache_tokens)."""
        if self._scheduler is None:
            s = self.cfg.serve
            page = int(s.get("prefix_cache_page", 16))
            prefix = None
            if bool(s.get("prefix_cache", True)) and int(s.get("prefix_cache_tokens", 8192)) > 0:
                prefix = PrefixCache(page_tokens=page, max_tokens=int(s.get("prefix_cache_tokens", 8192)))
            self._scheduler = Scheduler(self.model, self.drafter, self.cfg.tree, self.eos_id, self.max_context,
                                        max_batch_tokens=int(s.max_batch_tokens), pool_tokens=int(s.kv_pool_tokens),
                                        request_timeout_s=float(s.request_timeout_s),
                                        speculate_max_batch=int(s.speculate_max_batch), prefix_cache=prefix,
                                        page_tokens=page)
        return self._scheduler

    def submit(self, req: Request) -> Request:
        """Queue a request (any thread); it is decoded by whoever steps the scheduler (the server's engine thread,
        or drive(req)). Shape errors (empty prompt, context, an unloaded drafter) raise here."""
        return self.scheduler.submit(req)

    def drive(self, req: Request) -> GenerationResult:
        """Until `req` is done (stepping the scheduler here unless its thread runs); its result or its error."""
        self.scheduler.drive(req)
        if req.error is not None:
            raise req.error
        return req.result

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 on_tokens: Optional[Callable[[List[int]], None]] = None, tree: Any = None,
                 sampling: Optional[SamplingParams] = None, grammar: Any = None) -> GenerationResult:
        """One completion with the configured tree (ar | chain | ddtree), or `tree` (a tree config, e.g.
        AR_TREE) instead; output is identical for all. sampling None / temperature 0: greedy; else sampled
        (result.seed = the seed used, result.logprobs when sampling.logprobs is set). on_tokens(new_ids) is
        called after each commit with the tokens it added (the server's live stream). grammar: a GrammarSpec
        (kdtree/decode/grammar.py, self.grammars()) every token must follow. n > 1: use generate_n."""
        if sampling is not None and sampling.n != 1:
            raise ConfigError(f"n={sampling.n}: Engine.generate returns one completion; use Engine.generate_n")
        req = Request(list(prompt_ids), int(max_new_tokens), sampling=sampling, tree=tree, stop_ids=tuple(stop_ids),
                      on_tokens=on_tokens, grammar=None if grammar is None else grammar.start())
        return run_request(self.scheduler, req)

    def generate_n(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                   stop_ids: Sequence[int] = (), on_tokens: Optional[Callable[[int, List[int]], None]] = None,
                   tree: Any = None) -> List[GenerationResult]:
        """sampling.n samples of one prompt sharing its prefill; sample i's seed = sampling.for_sample(i).seed
        (sample 0: the request's seed). on_tokens(i, new_ids) streams sample i."""
        tree = self.cfg.tree if tree is None else tree
        return generate_n(self.model, self.drafter, tree, list(prompt_ids), int(max_new_tokens), sampling,
                          eos_id=self.eos_id, stop_ids=tuple(stop_ids), on_tokens=on_tokens, scheduler=self.scheduler)

    def grammars(self):
        """The grammar compiler of this engine's tokenizer and vocabulary (built once: ~1-8 s for tiktoken)."""
        from kdtree.decode.grammar import Grammars
        return Grammars.for_tokenizer(self.tokenizer, int(self.cfg.model.vocab_size))

    def complete(self, prompt: str, max_new_tokens: int) -> tuple:
        """Text in, (text out, GenerationResult)."""
        ids = self.tokenizer.encode(prompt)
        result = self.generate(ids, max_new_tokens)
        return self.tokenizer.decode(result.tokens), result


@dataclass
class EngineState:
    """What the host stages of one engine process share (StageContext.shared): the loaded engine and the HTTP
    server. The engine process closes it when it exits (tensor-parallel ranks end with it)."""
    engine: Optional[Engine] = None
    server: Optional[Any] = None        # the serve stage's server (kdtree.serve.app.ServeApp), port open

    @classmethod
    def of(cls, ctx) -> "EngineState":
        """This process's state (created on first use)."""
        if ctx.shared is None:
            ctx.shared = cls()
        return ctx.shared

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
