"""The prompt's prefill, done once and shared by the n samples of one request.

The first sample runs the prefill forward and keeps its latent cache (and the drafter's context); every later
sample truncates both back to the prompt's rows and starts from the kept last logits row, so the prompt is
never recomputed and no cache row is copied (truncate keeps rows [0, P) in place, on every TP rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

from kdtree.decode.sampling import prompt_logprobs


@dataclass
class SharedPrefill:
    prompt_len: int = 0
    cache: Any = None                     # the target's latent cache (LatentCache | TPCache)
    dcache: Any = None                    # the drafter's context cache (chain/ddtree), None for ar
    last_logits: Optional[np.ndarray] = None   # f32[V] the prefill's last row: the first generated token's
    prompt_logprobs: Optional[List] = None     # echo: logprobs of prompt tokens 1..P-1 (computed once)

    @property
    def done(self) -> bool:
        return self.cache is not None

    def rewind(self) -> None:
        """Back to just after the prefill: drop every generated row of the previous sample."""
        self.cache.truncate(self.prompt_len)
        if self.dcache is not None:
            self.dcache.truncate(self.prompt_len)


def prefill_forward(model, prompt: np.ndarray, cache_len: int, shared: Optional[SharedPrefill], res,
                    sampling=None, hidden_layers=()):
    """The prompt's forward, or the shared one rewound. Returns (cache, last logits f32[V], hiddens | None);
    hiddens is None when the prefill was reused (the drafter's context is then already in shared.dcache).
    Counts the forward in res.target_forwards and fills res.prompt_logprobs when sampling asks for echo."""
    want_echo = sampling is not None and sampling.echo and sampling.logprobs is not None
    if shared is not None and shared.done:
        if shared.cache.max_len < cache_len:
            raise ValueError(f"shared prefill cache of {shared.cache.max_len} rows < {cache_len} needed")
        shared.rewind()
        if want_echo:
            res.prompt_logprobs = shared.prompt_logprobs
        return shared.cache, shared.last_logits, None
    cache = model.new_cache(cache_len)
    logits, hid = model.forward(prompt, np.arange(len(prompt), dtype=np.int32), cache, hidden_layers=hidden_layers)
    res.target_forwards += 1
    if want_echo:
        res.prompt_logprobs = prompt_logprobs(prompt, logits, int(sampling.logprobs))
    last = np.array(logits[-1])
    if shared is not None:
        shared.prompt_len, shared.cache, shared.last_logits = len(prompt), cache, last
        shared.prompt_logprobs = res.prompt_logprobs
    return cache, last, hid
