"""Training loops of the tiny model: the target byte LM, then its DFlash drafter distilled on the
target's own greedy continuations. Seeded; sized for minutes on 2 CPU cores.

target:  next-byte cross-entropy on random windows of the corpus, AdamW + warmup/cosine, grad clip;
         router bias updated by DeepSeek-V3 aux-loss-free balancing (sign of load imbalance).
drafter: prompts (line starts of the train split) -> the target's greedy continuation (KV-cached);
         for anchors a inside the continuation, the block [tok[a], MASK x (B-1)] over the context
         hiddens of rows < a must predict tok[a+1..a+B-1] (= the target's argmax there). Loss = CE with
         a per-depth weight exp(-(j-1)/decay) (depth-1 errors cost every deeper token of the round).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from kdtree.model.names import drafter_tensor_shapes, init_weights, target_tensor_shapes
from kdtree.train.data import Corpus
from kdtree.train.drafter_torch import DrafterTorch
from kdtree.train.k2_torch import K2Torch
from kdtree.train.recipe import RECIPE as R

Log = Callable[[str], None]


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def init_target(cfg, seed: int) -> Dict[str, np.ndarray]:
    """names.init_weights, with the residual-output projections scaled by 1/sqrt(2 * layers)."""
    w = init_weights(target_tensor_shapes(cfg), seed)
    s = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    for k in w:
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            w[k] = (w[k] * s).astype(np.float32)
        if k.endswith("e_score_correction_bias"):
            w[k] = np.zeros_like(w[k])
    return w


@torch.no_grad()
def eval_target(model: K2Torch, corpus: Corpus, n: int = 16, seq_len: int = 128, seed: int = 1234) -> float:
    """Mean next-token CE (nats) on held-out windows."""
    model.eval()
    x = torch.from_numpy(corpus.batch(np.random.default_rng(seed), n, seq_len, "heldout"))
    logits, _, _ = model(x[:, :-1])
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))


def train_target(cfg, corpus: Corpus, steps: int, batch: int = R.batch, seq_len: int = R.seq_len,
                 lr: float = R.target_lr, warmup: int = 50, weight_decay: float = 0.01, bias_gamma: float = 1e-3,
                 seed: int = R.seed, log: Log = print, eval_every: int = R.eval_every, time_limit_s: Optional[float] = None,
                 init: Optional[Dict[str, np.ndarray]] = None, stop_after: Optional[int] = None) -> Dict:
    torch.manual_seed(seed)
    model = K2Torch(cfg, init if init is not None else init_target(cfg, seed))
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(seed)
    history: List[Dict] = []
    t0 = time.perf_counter()
    ema = None
    step = 0
    for step in range(steps):
        model.train()
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup)
        x = torch.from_numpy(corpus.batch(rng, batch, seq_len))
        logits, _, _ = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if bias_gamma:
            model.update_router_bias(bias_gamma)
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        last = step + 1 == steps or (time_limit_s is not None and time.perf_counter() - t0 > time_limit_s) \
            or (stop_after is not None and step + 1 >= stop_after)
        if (step + 1) % eval_every == 0 or last or step == 0:
            ev = eval_target(model, corpus, seq_len=min(seq_len, 128))
            rec = {"step": step + 1, "train_loss": round(lv, 4), "train_loss_ema": round(ema, 4),
                   "heldout_loss": round(ev, 4), "seconds": round(time.perf_counter() - t0, 1)}
            history.append(rec)
            log(f"target {rec}")
        if last:
            break
    loads = {i: model.last_load[i].tolist() for i in model.last_load}
    return {"model": model, "history": history, "steps": step + 1, "last_expert_load": loads,
            "seconds": time.perf_counter() - t0}


@torch.no_grad()
def greedy_set(model: K2Torch, corpus: Corpus, n_prompts: int, prompt_lens: List[int], n_new: int, seed: int,
               split: str = "train", chunk: int = 64, log: Log = print) -> List[Dict]:
    """[{prompt_len, tokens i64[n, P + n_new]}] — prompts and the target's greedy continuations."""
    model.eval()
    rng = np.random.default_rng(seed)
    out = []
    per = max(1, n_prompts // len(prompt_lens))
    t0 = time.perf_counter()
    for P in prompt_lens:
        pr = torch.from_numpy(corpus.prompts(rng, per, P, split))
        parts = [torch.cat([c, model.greedy(c, n_new)], 1) for c in pr.split(chunk)]
        out.append({"prompt_len": P, "tokens": torch.cat(parts)})
        log(f"greedy set: {per} prompts of {P} tokens + {n_new} new ({time.perf_counter() - t0:.0f}s)")
    return out


def _depth_weights(B: int, decay: float) -> torch.Tensor:
    return torch.exp(-torch.arange(B - 1, dtype=torch.float32) / decay) if decay > 0 else torch.ones(B - 1)


def _anchors(rng: np.random.Generator, n: int, lo: int, hi: int, A: int) -> torch.Tensor:
    """n rows of A distinct anchors in [lo, hi]."""
    return torch.from_numpy(np.stack([np.sort(rng.choice(np.arange(lo, hi + 1), A, replace=False)) for _ in range(n)]))


@torch.no_grad()
def eval_drafter(target: K2Torch, drafter: DrafterTorch, sets: List[Dict], max_seqs: int = 64) -> Dict:
    """Per-depth top-1 accuracy and expected chain acceptance (1 + sum_j prod_{i<=j} hit_i) over all
    anchors of the continuations."""
    drafter.eval()
    B = drafter.B
    hits_all = []
    for s in sets:
        tok, P = s["tokens"][:max_seqs], s["prompt_len"]
        L = tok.shape[1]
        _, hid, _ = target(tok, hidden_layers=drafter.layer_ids, want_logits=False)
        anchors = torch.arange(P, L - B + 1).expand(tok.shape[0], -1)
        for a in anchors.split(32, 1):
            logits = drafter(hid, tok, a)                                       # [N, A, B-1, V]
            lab = tok.gather(1, (a[:, :, None] + torch.arange(1, B)).reshape(tok.shape[0], -1)).view_as(logits[..., 0])
            hits_all.append((logits.argmax(-1) == lab).reshape(-1, B - 1))
    hits = torch.cat(hits_all).float()
    chain = 1 + hits.cumprod(1).sum(1)
    return {"acc_per_depth": [round(float(v), 4) for v in hits.mean(0)], "chain_acceptance": round(float(chain.mean()), 4),
            "n_blocks": int(hits.shape[0])}


def train_drafter(cfg, target: K2Torch, sets: List[Dict], steps: int, batch: int = R.batch,
                  anchors_per_seq: int = R.anchors, lr: float = R.drafter_lr, warmup: int = 30, decay: float = R.decay,
                  seed: int = R.seed, log: Log = print, eval_sets: Optional[List[Dict]] = None,
                  eval_every: int = R.eval_every,
                  time_limit_s: Optional[float] = None) -> Dict:
    torch.manual_seed(seed)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tw = target.export()
    d = DrafterTorch(cfg, init_weights(drafter_tensor_shapes(cfg), seed + 1), tw["model.embed_tokens.weight"],
                     tw["lm_head.weight"])
    params = list(d.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    B = d.B
    wts = _depth_weights(B, decay)
    rng = np.random.default_rng(seed)
    # the target hiddens of every greedy sequence, once (the target is frozen)
    cache = []
    with torch.no_grad():
        for s in sets:
            hs = [target(c, hidden_layers=d.layer_ids, want_logits=False)[1] for c in s["tokens"].split(64)]
            cache.append({i: torch.cat([h[i] for h in hs]) for i in d.layer_ids})
    history: List[Dict] = []
    t0 = time.perf_counter()
    ema = None
    step = 0
    for step in range(steps):
        d.train()
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup)
        k = int(rng.integers(len(sets)))
        s, P = sets[k], sets[k]["prompt_len"]
        rows = torch.from_numpy(rng.choice(s["tokens"].shape[0], batch, replace=False))
        tok = s["tokens"][rows]
        hid = {i: h[rows] for i, h in cache[k].items()}
        L = tok.shape[1]
        a = _anchors(rng, batch, P, L - B, min(anchors_per_seq, L - B - P + 1))
        logits = d(hid, tok, a)                                                 # [N, A, B-1, V]
        lab = tok.gather(1, (a[:, :, None] + torch.arange(1, B)).reshape(batch, -1)).view(logits.shape[:-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="none").view(lab.shape)
        loss = (ce * wts).sum(-1).mean() / wts.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        last = step + 1 == steps or (time_limit_s is not None and time.perf_counter() - t0 > time_limit_s)
        if (step + 1) % eval_every == 0 or last or step == 0:
            rec = {"step": step + 1, "loss": round(lv, 4), "loss_ema": round(ema, 4),
                   "seconds": round(time.perf_counter() - t0, 1)}
            if eval_sets is not None:
                rec.update(eval_drafter(target, d, eval_sets))
            history.append(rec)
            log(f"drafter {rec}")
        if last:
            break
    return {"model": d, "history": history, "steps": step + 1, "seconds": time.perf_counter() - t0}
