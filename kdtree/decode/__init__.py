"""Decoding loops: greedy AR (kdtree/decode/ar.py) and chain/DDTree speculative (kdtree/decode/ddtree.py).

`generate(...)` picks the loop from tree.kind; every kind returns the same tokens (the lossless invariant).
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence

from kdtree.decode.ar import generate_ar
from kdtree.decode.ddtree import generate_ddtree
from kdtree.decode.result import GenerationResult
from kdtree.errors import ConfigError


def generate(model, drafter, tree_cfg, prompt_ids: Sequence[int], max_new_tokens: int,
             eos_id: Optional[int] = None, stop_ids: Iterable[int] = (),
             on_tokens: Optional[Callable[[List[int]], None]] = None) -> GenerationResult:
    """Greedy generation with tree_cfg.kind = ar | chain | ddtree (drafter unused, may be None, for ar).
    on_tokens(new_ids): called after each commit with the tokens it added (live streaming); see the loops."""
    kind = str(tree_cfg.kind)
    if kind == "ar":
        return generate_ar(model, prompt_ids, max_new_tokens, eos_id=eos_id, stop_ids=stop_ids, on_tokens=on_tokens)
    if kind in ("chain", "ddtree"):
        if drafter is None:
            raise ConfigError(f"tree.kind={kind} needs the DFlash drafter but none is loaded; "
                              f"add <checkpoint>/drafter/ or use tree=ar")
        return generate_ddtree(model, drafter, tree_cfg, prompt_ids, max_new_tokens, eos_id=eos_id, stop_ids=stop_ids,
                               on_tokens=on_tokens)
    raise ConfigError(f"tree.kind={kind} is unknown; use tree=ar, tree=chain or tree=ddtree")


__all__ = ["GenerationResult", "generate"]
