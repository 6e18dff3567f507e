"""Server metrics with prometheus-client, one registry per ServeApp, served at GET /metrics.

Names and buckets follow vLLM's metric set (prefix kdtree_; counters end in _total, gauges do not):
    kdtree_time_to_first_token_seconds        histogram  submit -> first token committed
    kdtree_time_per_output_token_seconds      histogram  (end - first token) / (tokens - 1), per request
    kdtree_e2e_request_latency_seconds        histogram  submit -> finished
    kdtree_request_queue_time_seconds         histogram  submit -> the engine worker took it
    kdtree_requests_total{code,endpoint}      counter    HTTP requests by status
    kdtree_prompt_tokens_total / kdtree_generation_tokens_total / kdtree_target_forwards_total / ...
    kdtree_prefix_cache_queries_total / kdtree_prefix_cache_hits_total   counters  prompt tokens looked up in / served
                                                                                   from the prefix cache (vLLM's)
    kdtree_num_requests_running / _waiting / kdtree_batch_size / kdtree_speculating / kdtree_kv_cache_usage_perc   gauges
    kdtree_prefix_cache_pages{state="used"|"cached"|"free"}   gauge  pages of the paged latent-cache pool by state (the
                                                                     names are kdtree's: vLLM exports no page gauges;
                                                                     /status batch.prefix_cache_pages_*)
    kdtree_phase{phase}, kdtree_load_bytes_done / _expected, kdtree_phase_seconds{phase}    from status.json
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from kdtree.serve.status import PHASES, StatusFile

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (seconds): first token from 1 ms (cached prefill) to 43 min (a long queue behind a cold start)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class _StatusCollector:
    """Gauges read from the engine's status (phase, load progress) and the scheduler, at scrape time."""

    def __init__(self, status: StatusFile, load: Callable[[], Dict[str, float]]):
        self.status, self.load = status, load

    def describe(self):
        return []          # collected at scrape time only; nothing to check at registration

    def collect(self):
        snap = self.status.snapshot()
        phase = GaugeMetricFamily("kdtree_phase", "1 for the engine's current phase.", labels=["phase"])
        for p in PHASES:
            phase.add_metric([p], int(snap.get("phase") == p))
        yield phase
        yield GaugeMetricFamily("kdtree_load_bytes_done", "Checkpoint bytes loaded.", value=int(snap.get("bytes_done") or 0))
        yield GaugeMetricFamily("kdtree_load_bytes_expected", "Checkpoint bytes to load.",
                                value=int(snap.get("bytes_total") or 0))
        secs = GaugeMetricFamily("kdtree_phase_seconds", "Seconds spent in each finished phase.", labels=["phase"])
        for p, v in sorted((snap.get("phases") or {}).items()):
            if "seconds" in v:
                secs.add_metric([p], float(v["seconds"]))
        yield secs
        warm = GaugeMetricFamily("kdtree_warmup_shape_seconds", "Warm-up seconds per decode shape.", labels=["shape"])
        for s, v in sorted((snap.get("warmup_seconds") or {}).items()):
            warm.add_metric([s], float(v))
        yield warm
        load = self.load()
        yield GaugeMetricFamily("kdtree_num_requests_running", "Requests the engine is generating.",
                                value=load.get("running", 0))
        yield GaugeMetricFamily("kdtree_num_requests_waiting", "Requests waiting for the engine.",
                                value=load.get("waiting", 0))
        yield GaugeMetricFamily("kdtree_kv_cache_usage_perc", "Fraction of the KV cache in use (0..1).",
                                value=load.get("kv_cache_usage", 0.0))
        yield GaugeMetricFamily("kdtree_batch_size", "Requests in the last batched target forward (continuous batching).",
                                value=load.get("batch_size", 0))
        pages = GaugeMetricFamily("kdtree_prefix_cache_pages", "Pages of the paged latent-cache pool "
                                  "(serve.kv_pool_tokens in pages of serve.prefix_cache_page tokens) by state: used (held "
                                  "by a running request: its own and the cached pages it mapped), cached (held by the "
                                  "prefix cache alone: evictable), free; they add up to the pool.", labels=["state"])
        for state, n in sorted((load.get("prefix_cache_pages") or {}).items()):
            pages.add_metric([state], n)
        yield pages
        yield GaugeMetricFamily("kdtree_speculating", "1 while the last step speculated; 0 while more requests were "
                                "decoding than serve.speculate_max_batch (they stepped as AR).",
                                value=load.get("speculating", 1.0))


class Metrics:
    def __init__(self, status: StatusFile, load: Callable[[], Dict[str, float]] = dict):
        self.registry = r = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self.completions = 0                 # finished generations (also reported by the serve stage)
        self.generated_tokens = 0
        self.requests = Counter("kdtree_requests", "HTTP requests by endpoint and status code.",
                                ["code", "endpoint"], registry=r)
        self.ttft = Histogram("kdtree_time_to_first_token_seconds", "Submit to the first token committed.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kdtree_time_per_output_token_seconds", "Seconds per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kdtree_e2e_request_latency_seconds", "Submit to finished.", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram("kdtree_request_queue_time_seconds", "Submit to the engine worker taking it.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.connections_closed = Counter("kdtree_connections_closed", "Connections the server answered and closed before a "
                               "request was read: 503 at serve.max_connections or max_connections_per_client, "
                               "503 closed to make room, 408 at serve.request_read_timeout_s.", ["reason"], registry=r)
        self.prompt_tok = Counter("kdtree_prompt_tokens", "Prompt tokens of finished generations.", registry=r)
        self.gen_tok = Counter("kdtree_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("kdtree_request_success", "Finished generations by finish reason.",
                                ["finished_reason"], registry=r)
        self.target_fw = Counter("kdtree_target_forwards", "Target model forwards (prefill counts as one).",
                                 registry=r)
        self.draft_fw = Counter("kdtree_draft_forwards", "Drafter forwards.", registry=r)
        self.prefix_queries = Counter("kdtree_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("kdtree_prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                   registry=r)
        self.accept = Histogram("kdtree_acceptance_length", "Tokens committed per verify round.",
                                buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16), registry=r)
        self.stage = Counter("kdtree_stage_seconds", "Decode seconds by stage.", ["stage"], registry=r)
        r.register(_StatusCollector(status, load))

    def request(self, endpoint: str, code: int) -> None:
        self.requests.labels(code=str(int(code)), endpoint=endpoint).inc()

    def generation(self, req: Any) -> None:
        """Count one finished Request (its GenerationResult and its timestamps, time.monotonic seconds)."""
        result = req.result
        n = len(result.tokens)
        with self._lock:
            self.completions += 1
            self.generated_tokens += n
        self.prompt_tok.inc(len(req.prompt_ids))
        self.gen_tok.inc(n)
        self.finished.labels(finished_reason="stop" if result.finish_reason in ("stop", "eos") else "length").inc()
        self.target_fw.inc(int(result.target_forwards))
        self.draft_fw.inc(int(result.draft_forwards))
        self.prefix_queries.inc(int(getattr(result, "prefix_queried_tokens", 0)))
        self.prefix_hits.inc(int(getattr(result, "cached_tokens", 0)))
        for a in result.acceptance_lengths:
            self.accept.observe(a)
        for stage, s in result.stage_seconds.items():
            self.stage.labels(stage=stage).inc(float(s))
        joined = req.admitted_at or req.finished_at    # queue time ends when it joins the batch
        self.queue.observe(max(0.0, joined - req.submitted_at))
        self.e2e.observe(max(0.0, req.finished_at - req.submitted_at))
        if req.first_token_at:
            self.ttft.observe(max(0.0, req.first_token_at - req.submitted_at))
            if n > 1:
                self.tpot.observe(max(0.0, req.finished_at - req.first_token_at) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
