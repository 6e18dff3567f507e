"""Command line of the tiny-model training, in phases that each save their output to --work:

  python -m kdtree.train.run target  --work DIR [--steps N ...]   -> DIR/target.safetensors, target.json
  python -m kdtree.train.run greedy  --work DIR [...]              -> DIR/greedy.pt (+ heldout)
  python -m kdtree.train.run drafter --work DIR [--steps N ...]   -> DIR/drafter.safetensors, drafter.json
  python -m kdtree.train.run export  --work DIR --out kdtree/assets/tiny

The stage kdtree/stages/train_tiny.py runs all four in one process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


def model_cfg(path: str = "conf/model/tiny.yaml"):
    from omegaconf import OmegaConf

    from kdtree.config.schema import ModelConfig
    root = Path(__file__).resolve().parents[2]
    p = Path(path) if Path(path).is_absolute() else root / path
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(p))


def save_tensors(path: Path, tensors) -> None:
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


def load_tensors(path: Path):
    from safetensors.numpy import load_file
    return dict(load_file(str(path)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree.train.run")
    ap.add_argument("phase", choices=["target", "greedy", "drafter", "export"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="conf/model/tiny.yaml")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (schedule of --steps)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--n-prompts", type=int, default=768)
    ap.add_argument("--prompt-lens", default="16,32,64,128")
    ap.add_argument("--n-new", type=int, default=96)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--decay", type=float, default=4.0)
    ap.add_argument("--out", default="kdtree/assets/tiny")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = model_cfg(a.model)
    from kdtree.train import loop
    from kdtree.train.data import Corpus
    from kdtree.train.k2_torch import K2Torch

    def log(msg):
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    if a.phase == "target":
        corpus = Corpus()
        r = loop.train_target(cfg, corpus, a.steps, a.batch, a.seq_len, a.lr, seed=a.seed, log=log,
                              eval_every=a.eval_every, time_limit_s=a.time_limit, stop_after=a.stop_after)
        save_tensors(work / "target.safetensors", r["model"].export())
        (work / "target.json").write_text(json.dumps({
            "args": vars(a), "steps_done": r["steps"], "seconds": round(r["seconds"], 1), "history": r["history"],
            "last_expert_load": r["last_expert_load"], "corpus": corpus.provenance()}, indent=1))
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
        r = loop.train_drafter(cfg, target, g["train"], a.steps, a.batch, a.anchors, a.lr, seed=a.seed, log=log,
                               decay=a.decay, eval_sets=g["heldout"], eval_every=a.eval_every,
                               time_limit_s=a.time_limit)
        save_tensors(work / "drafter.safetensors", r["model"].export())
        (work / "drafter.json").write_text(json.dumps({
            "args": vars(a), "greedy_args": g["args"], "steps_done": r["steps"], "seconds": round(r["seconds"], 1),
            "history": r["history"]}, indent=1))
    elif a.phase == "export":
        from kdtree.train.export import export_assets
        export_assets(cfg, work, Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
