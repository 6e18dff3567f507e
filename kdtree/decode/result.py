"""What every decoding loop (AR, chain, DDTree) returns, with the counters users compare."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

STAGES = ("prefill", "draft", "tree_build", "verify", "accept", "commit")


@dataclass
class GenerationResult:
    tokens: List[int]                      # generated ids, prompt excluded, stop/eos handling applied
    finish_reason: str = "length"          # length | eos | stop
    target_forwards: int = 0               # prefill counts as one
    draft_forwards: int = 0
    acceptance_lengths: List[int] = field(default_factory=list)  # tokens committed per verify round
    stage_seconds: Dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    seconds: float = 0.0                   # wall time of the whole generation
    seed: Optional[int] = None             # the sampling seed used (None = greedy); replays the run
    logprobs: Optional[List[dict]] = None  # per token {"token", "logprob", "top": [[id, logprob], ...]} if asked
    prompt_logprobs: Optional[List[Optional[dict]]] = None  # echo: prompt tokens 1..P-1 (token 0: None)

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_acceptance_length"] = self.mean_acceptance_length
        return d
