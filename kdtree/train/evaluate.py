"""Acceptance of a trained tiny checkpoint on held-out prompts with the numpy engine.

For each prompt (line starts of held-out stdlib files, never trained on): greedy AR, then chain/DDTree
for each tree shape; checks DDTree tokens == AR tokens and reports the mean acceptance length
(tokens committed per verify forward, i.e. per target forward after the prefill).

    python -m kdtree.train.evaluate --ckpt kdtree/assets/tiny [--prompts 8 --new 96]
    python -m kdtree.train.evaluate --drafter-block 16      # the shipped target + kdtree/assets/tiny/drafter_b16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Sequence, Tuple

import numpy as np

from kdtree.backends.numpy_ops import NumpyOps
from kdtree.checkpoint.loader import load_checkpoint, load_drafter
from kdtree.config.schema import group_config
from kdtree.decode import generate
from kdtree.model.drafter import DFlashDrafter
from kdtree.model.k2 import K2Model
from kdtree.train.data import Corpus

SHAPES: Sequence[Tuple[str, int, int, int]] = (   # (kind, width, depth, budget)
    ("chain", 1, 7, 7),
    ("ddtree", 2, 7, 16),
    ("ddtree", 4, 7, 32),
    ("ddtree", 4, 7, 64),
    ("ddtree", 8, 7, 64),
)


def shapes_for(block_size: int) -> Sequence[Tuple[str, int, int, int]]:
    """SHAPES, and for a deeper drafter the same kinds at its full depth (block_size - 1)."""
    d = block_size - 1
    if d <= 7:
        return SHAPES
    return (*SHAPES, ("chain", 1, d, d), ("ddtree", 2, d, 16), ("ddtree", 4, d, 32), ("ddtree", 4, d, 64))


def load_engine(ckpt: Path, cfg):
    tw, _ = load_checkpoint(ckpt, cfg, None)
    dw, _ = load_drafter(ckpt, cfg, None)
    model = K2Model(cfg, tw, NumpyOps())
    return model, DFlashDrafter.from_target(model, dw)


AR = SimpleNamespace(kind="ar", width=1, depth=0, budget=0)


def heldout_prompts(n: int, length: int, seed: int = 0) -> List[List[int]]:
    return [list(map(int, p)) for p in Corpus().prompts(np.random.default_rng(seed), n, length, "heldout")]


def evaluate(model, drafter, prompts: List[List[int]], max_new: int, shapes=SHAPES, eos_id=None, log=print) -> Dict:
    ar = []
    t0 = time.perf_counter()
    for p in prompts:
        ar.append(generate(model, None, AR, p, max_new, eos_id=eos_id))
    ar_s = time.perf_counter() - t0
    rows = []
    for kind, width, depth, budget in shapes:
        tc = SimpleNamespace(kind=kind, width=width, depth=depth, budget=budget)
        acc: List[int] = []
        same, new, fwd = True, 0, 0
        t0 = time.perf_counter()
        for p, ref in zip(prompts, ar):
            r = generate(model, drafter, tc, p, max_new, eos_id=eos_id)
            same &= r.tokens == ref.tokens
            acc += r.acceptance_lengths
            new += len(r.tokens)
            fwd += r.target_forwards - 1
        row = {"kind": kind, "width": width, "depth": depth, "budget": budget,
               "mean_acceptance": round(float(np.mean(acc)), 3), "tokens_per_verify": round(new / max(fwd, 1), 3),
               "rounds": len(acc), "equal_to_ar": bool(same), "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        log(json.dumps(row))
    return {"n_prompts": len(prompts), "prompt_len": len(prompts[0]), "max_new_tokens": max_new,
            "ar_seconds": round(ar_s, 1), "ar_samples": [bytes(t for t in r.tokens if t < 256).decode("utf-8", "replace")
                                                       for r in ar[:3]], "shapes": rows}


def table(ev: Dict) -> str:
    lines = ["| tree | width | depth | budget | mean acceptance | tokens / verify | == AR |",
             "|---|---|---|---|---|---|---|"]
    for r in ev["shapes"]:
        lines.append(f"| {r['kind']} | {r['width']} | {r['depth']} | {r['budget']} | {r['mean_acceptance']} | "
                     f"{r['tokens_per_verify']} | {r['equal_to_ar']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree.train.evaluate")
    ap.add_argument("--ckpt", default="", help="default: the model's checkpoint (kdtree/assets/tiny with the shipped "
                                              "drafter of --drafter-block)")
    ap.add_argument("--model", default="tiny", help="conf/model/<name>.yaml, or a YAML path")
    ap.add_argument("--drafter-block", type=int, default=None, help="model.drafter.block_size (default: the model's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    cfg = group_config("model", a.model)
    if a.drafter_block is not None:
        cfg.drafter.block_size = a.drafter_block
    if not a.ckpt:
        from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
        a.ckpt = str(ensure_tiny_checkpoint(cfg, None))
    model, drafter = load_engine(Path(a.ckpt), cfg)
    ev = evaluate(model, drafter, heldout_prompts(a.prompts, a.prompt_len, a.seed), a.new,
                  shapes=shapes_for(int(cfg.drafter.block_size)))
    ev["command"] = "python -m kdtree.train.evaluate " + " ".join(argv if argv is not None else sys.argv[1:])
    print(table(ev))
    if a.out:
        Path(a.out).write_text(json.dumps(ev, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
