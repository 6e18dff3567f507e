"""The training recipe of the committed tiny checkpoint (kdtree/assets/tiny/TRAINING.md, "Commands"): the one
definition of its hyperparameters, used by the train_tiny stage and by `python -m kdtree.train.run`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Recipe:
    target_steps: int = 1800
    drafter_steps: int = 1500
    batch: int = 16
    seq_len: int = 128                       # target training sequence length (bytes)
    target_lr: float = 4e-3
    drafter_lr: float = 3e-3
    n_prompts: int = 1536                    # greedy continuations the drafter is distilled on
    prompt_lens: Tuple[int, ...] = (16, 32, 64, 128)
    n_new: int = 96                          # tokens of each greedy continuation
    anchors: int = 16                        # drafter anchors per sequence
    decay: float = 4.0                       # drafter CE weight exp(-(j-1)/decay) at block depth j
    seed: int = 0
    threads: int = 1                         # torch threads (1 is as fast as 2 on a loaded 2-core machine)
    eval_every: int = 100


RECIPE = Recipe()
