"""Server counters in Prometheus text format (exposition 0.0.4), no client library needed.

    kdtree_requests_total{endpoint="/v1/completions",code="200"} 12
    kdtree_generated_tokens_total 96
    kdtree_acceptance_length_sum / _count     (tokens committed per verify round)
    kdtree_stage_seconds_total{stage="verify"} 1.93
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Dict, Optional

from kdtree.serve.status import PHASES


def _labels(**kv: Any) -> str:
    if not kv:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in kv.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(esc.items())) + "}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Dict[tuple, int] = defaultdict(int)      # (endpoint, code) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.completions = 0
        self.target_forwards = 0
        self.draft_forwards = 0
        self.acceptance_sum = 0
        self.acceptance_count = 0
        self.stage_seconds: Dict[str, float] = defaultdict(float)
        self.generation_seconds = 0.0
        self.queue_wait_seconds = 0.0

    def request(self, endpoint: str, code: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(code))] += 1

    def generation(self, result: Any, prompt_tokens: int, queue_wait_s: float = 0.0) -> None:
        """Count one finished GenerationResult."""
        with self._lock:
            self.completions += 1
            self.prompt_tokens += int(prompt_tokens)
            self.generated_tokens += len(result.tokens)
            self.target_forwards += int(result.target_forwards)
            self.draft_forwards += int(result.draft_forwards)
            self.acceptance_sum += int(sum(result.acceptance_lengths))
            self.acceptance_count += len(result.acceptance_lengths)
            for stage, s in result.stage_seconds.items():
                self.stage_seconds[stage] += float(s)
            self.generation_seconds += float(result.seconds)
            self.queue_wait_seconds += float(queue_wait_s)

    def render(self, status: Optional[Dict[str, Any]] = None, queue_depth: int = 0, in_flight: int = 0) -> str:
        out = []

        def metric(name: str, kind: str, help_: str, samples, suffixes=None) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for i, (labels, value) in enumerate(samples):
                full = name + (suffixes[i] if suffixes else "")
                out.append(f"{full}{_labels(**labels)} {value:g}" if isinstance(value, float)
                           else f"{full}{_labels(**labels)} {value}")

        with self._lock:
            metric("kdtree_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [({"endpoint": e, "code": c}, n) for (e, c), n in sorted(self.requests.items())])
            metric("kdtree_completions_total", "counter", "Finished generations.", [({}, self.completions)])
            metric("kdtree_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                   [({}, self.prompt_tokens)])
            metric("kdtree_generated_tokens_total", "counter", "Tokens generated.", [({}, self.generated_tokens)])
            metric("kdtree_target_forwards_total", "counter", "Target model forwards (prefill counts as one).",
                   [({}, self.target_forwards)])
            metric("kdtree_draft_forwards_total", "counter", "Drafter forwards.", [({}, self.draft_forwards)])
            metric("kdtree_acceptance_length", "summary", "Tokens committed per verify round.",
                   [({}, self.acceptance_sum), ({}, self.acceptance_count)], suffixes=("_sum", "_count"))
            metric("kdtree_stage_seconds_total", "counter", "Decode seconds by stage.",
                   [({"stage": s}, float(v)) for s, v in sorted(self.stage_seconds.items())])
            metric("kdtree_generation_seconds_total", "counter", "Wall seconds inside engine.generate.",
                   [({}, float(self.generation_seconds))])
            metric("kdtree_queue_wait_seconds_total", "counter", "Seconds requests waited for the engine worker.",
                   [({}, float(self.queue_wait_seconds))])
        metric("kdtree_queue_depth", "gauge", "Requests waiting for the engine worker.", [({}, queue_depth)])
        metric("kdtree_in_flight", "gauge", "Requests the engine worker is running (0 or 1).", [({}, in_flight)])
        if status is not None:
            metric("kdtree_phase", "gauge", "1 for the engine's current phase.",
                   [({"phase": p}, int(status.get("phase") == p)) for p in PHASES])
            metric("kdtree_load_bytes", "gauge", "Checkpoint bytes loaded.", [({}, int(status.get("bytes_done") or 0))])
            metric("kdtree_load_bytes_total", "gauge", "Checkpoint bytes to load.",
                   [({}, int(status.get("bytes_total") or 0))])
            metric("kdtree_phase_seconds", "gauge", "Seconds spent in each finished phase.",
                   [({"phase": p}, float(v["seconds"])) for p, v in sorted((status.get("phases") or {}).items())
                    if "seconds" in v])
            metric("kdtree_warmup_shape_seconds", "gauge", "Warm-up seconds per decode shape.",
                   [({"shape": s}, float(v)) for s, v in sorted((status.get("warmup_seconds") or {}).items())])
        return "\n".join(out) + "\n"
