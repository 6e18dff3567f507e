"""train_tiny: train the tiny K2 target on stdlib text and distil its DFlash drafter (torch, CPU).

    python -m kdtree.run pipeline=train_tiny                     # writes <run_dir>/tiny
    python -m kdtree.train.run target|greedy|drafter|export ...  # the same, phase by phase

Phases: target byte LM -> the target's greedy continuations of train prompts -> drafter distillation
-> HF-layout checkpoint (+ drafter/, training.json, TRAINING.md) in `out` (empty = <run_dir>/tiny)
-> optional numpy-engine acceptance on held-out prompts (eval_prompts > 0). The committed
kdtree/assets/tiny was made by this code (its TRAINING.md has the exact commands).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from kdtree.train.data import Corpus
from kdtree.train.evaluate import evaluate, heldout_prompts, load_engine
from kdtree.train.export import training_md, write_assets
from kdtree.train.recipe import RECIPE as R

SIDE = "controller"


@dataclass
class TrainTinyConfig:
    """Training defaults: the recipe of the committed checkpoint (kdtree/train/recipe.py). threads: torch threads;
    1 is as fast as 2 on a loaded 2-core machine at a third of the CPU time (small ops spin on OpenMP barriers),
    and 4x faster for the token-by-token greedy generation."""
    target_steps: int = R.target_steps
    drafter_steps: int = R.drafter_steps
    batch: int = R.batch
    seq_len: int = R.seq_len
    target_lr: float = R.target_lr
    drafter_lr: float = R.drafter_lr
    n_prompts: int = R.n_prompts
    n_new: int = R.n_new
    seed: int = R.seed
    threads: int = R.threads
    out: str = ""  # empty = <run_dir>/tiny
    eval_prompts: int = 8  # held-out prompts of the numpy-engine acceptance check (0 = none)
    eval_new: int = 96  # new tokens per held-out prompt


CONFIG = TrainTinyConfig  # cfg.train_tiny: this stage's options (kdtree/pipeline/registry.py)


def run(ctx, conf: TrainTinyConfig) -> dict:
    target_steps, drafter_steps, batch, seq_len = conf.target_steps, conf.drafter_steps, conf.batch, conf.seq_len
    target_lr, drafter_lr, n_prompts, n_new = conf.target_lr, conf.drafter_lr, conf.n_prompts, conf.n_new
    seed, threads, out, eval_prompts, eval_new = conf.seed, conf.threads, conf.out, conf.eval_prompts, conf.eval_new
    import torch  # optional heavy dependency: only this stage needs it

    from kdtree.train import loop  # torch

    torch.set_num_threads(threads)
    cfg = ctx.cfg.model
    out_dir = Path(out).expanduser() if out else Path(ctx.run_dir) / "tiny"

    def log(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    corpus = Corpus()
    t = loop.train_target(cfg, corpus, target_steps, batch, seq_len, target_lr, seed=seed, log=log,
                          eval_every=max(1, target_steps // 10))
    ctx.emit("target_trained", steps=t["steps"], heldout_loss=t["history"][-1]["heldout_loss"])
    lens = list(R.prompt_lens)
    tr = loop.greedy_set(t["model"], corpus, n_prompts, lens, n_new, seed, "train", log=log)
    ho = loop.greedy_set(t["model"], corpus, min(64, max(2, n_prompts // 8)), [32, 96], n_new, seed + 1, "heldout",
                         log=log)
    d = loop.train_drafter(cfg, t["model"], tr, drafter_steps, min(batch, min(s["tokens"].shape[0] for s in tr)),
                           anchors_per_seq=R.anchors, lr=drafter_lr, decay=R.decay, seed=seed, log=log, eval_sets=ho,
                           eval_every=max(1, drafter_steps // 10))
    info = {"target": {"steps_done": t["steps"], "history": t["history"], "last_expert_load": t["last_expert_load"],
                       "corpus": corpus.provenance()},
            "drafter": {"steps_done": d["steps"], "history": d["history"]},
            "params": dict(target_steps=target_steps, drafter_steps=drafter_steps, batch=batch, seq_len=seq_len,
                           target_lr=target_lr, drafter_lr=drafter_lr, n_prompts=n_prompts, n_new=n_new, seed=seed)}
    write_assets(cfg, t["model"].export(), d["model"].export(), out_dir, info)
    summary = {"out": str(out_dir), "target_heldout_loss": t["history"][-1]["heldout_loss"],
               "drafter_chain_acceptance": d["history"][-1].get("chain_acceptance")}
    if eval_prompts > 0:
        model, drafter = load_engine(out_dir, cfg)
        ev = evaluate(model, drafter, heldout_prompts(eval_prompts, 64, seed), eval_new, log=log)
        info["eval"] = ev
        summary["acceptance"] = {f"{r['kind']}-w{r['width']}-b{r['budget']}": r["mean_acceptance"] for r in ev["shapes"]}
        summary["equal_to_ar"] = all(r["equal_to_ar"] for r in ev["shapes"])
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    (out_dir / "TRAINING.md").write_text(training_md(info, "python -m kdtree.run pipeline=train_tiny"))
    ctx.emit("train_tiny_done", **{k: v for k, v in summary.items() if not isinstance(v, dict)})
    return summary
