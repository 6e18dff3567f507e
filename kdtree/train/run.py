"""Command line of the tiny-model training, in phases that each save their output to --work:

  python -m kdtree.train.run target  --work DIR [--steps N ...]   -> DIR/target.safetensors, target.json
  python -m kdtree.train.run greedy  --work DIR [...]              -> DIR/greedy.pt (+ heldout)
  python -m kdtree.train.run drafter --work DIR [--steps N ...]   -> DIR/drafter.safetensors, drafter.json
  python -m kdtree.train.run export  --work DIR --out kdtree/assets/tiny
  python -m kdtree.train.run export-drafter --work DIR --drafter-block 16   -> kdtree/assets/tiny/drafter_b16

--drafter-block B trains (and exports) a drafter of block size B (B - 1 drafted tokens, tree.depth <= B - 1) for
the same target: kdtree/assets/tiny/drafter_b16 was made so (its TRAINING.md).

The stage kdtree/stages/train_tiny.py runs all four in one process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kdtree.config.schema import group_config
from kdtree.train import loop
from kdtree.train.data import Corpus
from kdtree.train.export import export_assets, export_drafter, load_tensors, save_tensors
from kdtree.train.k2_torch import K2Torch
from kdtree.train.recipe import RECIPE


def main(argv=None) -> int:
    r = RECIPE
    ap = argparse.ArgumentParser(prog="python -m kdtree.train.run", description="defaults: kdtree/train/recipe.py")
    ap.add_argument("phase", choices=["target", "greedy", "drafter", "export", "export-drafter"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="tiny", help="conf/model/<name>.yaml, or a YAML path")
    ap.add_argument("--steps", type=int, default=None, help=f"default {r.target_steps} (target), "
                                                            f"{r.drafter_steps} (drafter)")
    ap.add_argument("--batch", type=int, default=r.batch)
    ap.add_argument("--seq-len", type=int, default=r.seq_len)
    ap.add_argument("--lr", type=float, default=None, help=f"default {r.target_lr:g} (target), {r.drafter_lr:g} "
                                                           f"(drafter)")
    ap.add_argument("--seed", type=int, default=r.seed)
    ap.add_argument("--threads", type=int, default=r.threads)
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (schedule of --steps)")
    ap.add_argument("--eval-every", type=int, default=r.eval_every)
    ap.add_argument("--n-prompts", type=int, default=r.n_prompts)
    ap.add_argument("--prompt-lens", default=",".join(map(str, r.prompt_lens)))
    ap.add_argument("--n-new", type=int, default=r.n_new)
    ap.add_argument("--anchors", type=int, default=r.anchors)
    ap.add_argument("--decay", type=float, default=r.decay)
    ap.add_argument("--drafter-block", type=int, default=None, help="model.drafter.block_size (default: the model's)")
    ap.add_argument("--out", default="kdtree/assets/tiny")
    a = ap.parse_args(argv)
    if a.steps is None:
        a.steps = r.drafter_steps if a.phase == "drafter" else r.target_steps
    if a.lr is None:
        a.lr = r.drafter_lr if a.phase == "drafter" else r.target_lr
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = group_config("model", a.model)
    if a.drafter_block is not None:
        cfg.drafter.block_size = a.drafter_block

    def log(msg):
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    if a.phase == "target":
        corpus = Corpus()
        res = loop.train_target(cfg, corpus, a.steps, a.batch, a.seq_len, a.lr, seed=a.seed, log=log,
                              eval_every=a.eval_every, time_limit_s=a.time_limit, stop_after=a.stop_after)
        save_tensors(work / "target.safetensors", res["model"].export())
        (work / "target.json").write_text(json.dumps({
            "args": vars(a), "steps_done": res["steps"], "seconds": round(res["seconds"], 1),
            "history": res["history"], "last_expert_load": res["last_expert_load"], "corpus": corpus.provenance()},
            indent=1))
    elif a.phase == "greedy":
        corpus = Corpus()
        target = K2Torch(cfg, load_tensors(work / "target.safetensors"))
        lens = [int(x) for x in a.prompt_lens.split(",")]
        tr = loop.greedy_set(target, corpus, a.n_prompts, lens, a.n_new, a.seed, "train", log=log)
        ho = loop.greedy_set(target, corpus, 64, [32, 96], a.n_new, a.seed + 1, "heldout", log=log)
        torch.save({"train": tr, "heldout": ho, "args": vars(a)}, work / "greedy.pt")
    elif a.phase == "drafter":
        target = K2Torch(cfg, load_tensors(work / "target.safetensors"))
        g = torch.load(work / "greedy.pt")
        res = loop.train_drafter(cfg, target, g["train"], a.steps, a.batch, a.anchors, a.lr, seed=a.seed, log=log,
                               decay=a.decay, eval_sets=g["heldout"], eval_every=a.eval_every,
                               time_limit_s=a.time_limit)
        save_tensors(work / "drafter.safetensors", res["model"].export())
        (work / "drafter.json").write_text(json.dumps({
            "args": vars(a), "greedy_args": g["args"], "steps_done": res["steps"], "seconds": round(res["seconds"], 1),
            "history": res["history"]}, indent=1))
    elif a.phase == "export":
        export_assets(cfg, work, Path(a.out))
    elif a.phase == "export-drafter":
        print(export_drafter(cfg, work, Path(a.out) / f"drafter_b{int(cfg.drafter.block_size)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
