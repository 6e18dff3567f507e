"""Scripted drafters for the speculative-decoding tests, and INT4 expert quantization of the tiny target.

`ScriptedDrafter` implements the drafter interface (block_size, target_layer_ids, new_cache, extend, draft)
from a known greedy continuation, placing the true next token at a chosen rank per depth, so trees accept
long paths, side branches and nothing, deterministically; a random DFlash drafter would accept ~nothing.
"""
from __future__ import annotations

import zlib
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from kdtree.model.names import is_moe_layer
from kdtree.quant import int4

PROMPTS = {
    "text": list(b"The quick brown fox jumps over"),
    "arith": list(b"2+2="),
    "one": [72],
    "bytes": [int(x) for x in np.random.default_rng(11).integers(0, 256, 23)],
}


def int4_weights(cfg, weights, group_size: int = 32):
    """Routed-expert Linears quantized to Int4Weight (K2's scheme); everything else stays float32."""
    out = dict(weights)
    for name, w in weights.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            layer = int(name.split(".")[2])
            assert is_moe_layer(cfg, layer)
            packed, scale, shape = int4.quantize_weight(w, group_size, name)
            out[name] = int4.Int4Weight.from_tensors(name[: -len(".weight")], packed, scale, shape, group_size)
    return out


class _Ctx:
    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0


class ScriptedDrafter:
    """Drafts from `seq` = prompt + the target's greedy continuation: after the bonus at position n, depth d
    (1-based) should be seq[n + d]; rank(n, d) puts that token at rank r of the logits (None = not in top)."""

    def __init__(self, seq: Sequence[int], vocab: int, block_size: int, target_layer_ids: Sequence[int],
                 rank: Callable[[int, int], Optional[int]] = lambda n, d: 0, seed: int = 0):
        self.seq, self.vocab, self.block_size = list(seq), vocab, block_size
        self.target_layer_ids = list(target_layer_ids)
        self.rank, self.seed = rank, seed
        self.calls = 0
        self.bonus_seen: Dict[int, int] = {}

    def new_cache(self, max_len: int, share=None) -> _Ctx:
        return _Ctx(max_len)

    def extend(self, ctx: _Ctx, hiddens) -> None:
        rows = {h.shape[0] for h in hiddens.values()}
        assert set(hiddens) == set(self.target_layer_ids) and len(rows) == 1
        ctx.length += rows.pop()
        assert ctx.length <= ctx.max_len

    def draft(self, ctx: _Ctx, bonus: int) -> np.ndarray:
        self.calls += 1
        n = ctx.length
        if n < len(self.seq):  # the loop's bonus must be the target's greedy token at position n
            assert bonus == self.seq[n], f"bonus {bonus} at position {n}, greedy AR has {self.seq[n]}"
        rng = np.random.default_rng([self.seed, n, zlib.crc32(b"draft")])
        logits = rng.standard_normal((self.block_size - 1, self.vocab)).astype(np.float32)
        for d in range(1, self.block_size):
            if n + d >= len(self.seq):
                break
            true, r = self.seq[n + d], self.rank(n, d)
            row = logits[d - 1]
            if r is None:      # make sure the true token is not drafted in any small top-k
                row[true] = row.min() - 1.0
                continue
            others = np.sort(np.delete(row, true))[::-1]
            row[true] = others[0] + 8.0 if r == 0 else 0.5 * (others[r - 1] + others[r])
        return logits


def scripted(seq, cfg, rank=lambda n, d: 0, seed=0) -> ScriptedDrafter:
    d = cfg.drafter
    return ScriptedDrafter(seq, cfg.vocab_size, int(d.block_size), list(d.target_layer_ids), rank, seed)


def noisy_rank(seed: int, p_top: float = 0.55):
    """Rank of the true token: 0 with p_top, else 1, 2, 3 or absent (deterministic in (seed, n, d))."""
    def rank(n: int, d: int) -> Optional[int]:
        u = np.random.default_rng([seed, n, d]).random()
        if u < p_top:
            return 0
        rest = (u - p_top) / (1 - p_top)
        return 1 if rest < 0.35 else 2 if rest < 0.55 else 3 if rest < 0.65 else None
    return rank
