"""What every decoding loop (AR, chain, DDTree) returns, with the counters users compare."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional

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
    cached_tokens: int = 0                 # prompt tokens served from the prefix cache (not prefilled)
    prefilled_tokens: int = 0              # prompt rows this request computed (prefill forwards)
    prefix_queried_tokens: int = 0         # prompt tokens looked up in the prefix cache (0: not looked up)
    pruned_drafts: int = 0                 # tree.prune_experts: draft rows the verify forwards pruned

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_acceptance_length"] = self.mean_acceptance_length
        return d


def commit_tokens(res: GenerationResult, tokens: Iterable[int], max_new_tokens: int, eos_id: Optional[int],
                  stop_ids: Iterable[int]) -> bool:
    """Append committed tokens to res.tokens with AR's stop rules (eos and stop ids are not kept; at most
    max_new_tokens); sets res.finish_reason and returns True when generation is over."""
    stops = stop_ids if isinstance(stop_ids, (set, frozenset)) else set(int(s) for s in stop_ids)
    for t in tokens:
        t = int(t)
        if eos_id is not None and t == eos_id:
            res.finish_reason = "eos"
            return True
        if t in stops:
            res.finish_reason = "stop"
            return True
        res.tokens.append(t)
        if len(res.tokens) >= max_new_tokens:
            res.finish_reason = "length"
            return True
    return False
