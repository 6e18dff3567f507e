"""The prompt's prefill, done once and shared by the n samples of one generate_n call.

The first sample's DecodeState computes the prefill and keeps its latent cache (and the drafter's context) here;
every later sample rewinds both to the prompt's rows and starts from the kept last logits row, so the prompt is
never recomputed and no cache row is copied (truncate keeps rows [0, P) in their pages, on every TP rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np


@dataclass
class SharedPrefill:
    prompt_len: int = 0
    cache: Any = None                     # the target's latent cache (any Target's cache type)
    dcache: Any = None                    # the drafter's context cache (chain/ddtree), None for ar
    last_logits: Optional[np.ndarray] = None   # f32[V] the prefill's last row: the first generated token's
    prompt_logprobs: Optional[List] = None     # echo: logprobs of prompt tokens 1..P-1 (computed once)

    @property
    def done(self) -> bool:
        return self.cache is not None

    def keep(self, prompt_len: int, cache: Any, dcache: Any, last_logits: np.ndarray,
             prompt_logprobs: Optional[List]) -> None:
        """The first sample's prefill: its caches stay alive (owned here) for the later samples."""
        self.prompt_len, self.cache, self.dcache = int(prompt_len), cache, dcache
        self.last_logits, self.prompt_logprobs = np.array(last_logits), prompt_logprobs

    def rewind(self) -> None:
        """Back to just after the prefill: drop every generated row of the previous sample."""
        self.cache.truncate(self.prompt_len)
        if self.dcache is not None:
            self.dcache.truncate(self.prompt_len)

    def close(self) -> None:
        """Give the pages back (every sample is done)."""
        for c in (self.cache, self.dcache):
            if c is not None and hasattr(c, "release"):
                c.release()
        self.cache = self.dcache = None
