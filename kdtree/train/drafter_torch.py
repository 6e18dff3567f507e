"""Torch re-statement of the DFlash block drafter (kdtree/model/drafter.py) for training.

ctx   = hidden_norm(fc(concat(target hiddens after target_layer_ids)))            [N, L, D]
block = target embedding of [tokens[a], MASK x (B-1)] at positions a..a+B-1       (one block per anchor a)
layer: x += o(attn(q = rope(q_norm(q_proj(h))), k/v over [ctx rows < a ; block rows])), h = input_ln(x)
       (context k/v come from ctx itself, block k/v from h, same k_proj/v_proj; k_norm on k; non-causal)
       x += mlp(post_attention_ln(x))
logits = lm_head(norm(x[1:]))   (the TARGET's frozen lm_head); block row j predicts token a + j.

Training runs many anchors per sequence at once: the block rows of anchor a see the context rows
[0, a) and their own block, nothing else (one boolean mask over [ctx ; all blocks]).
"""
from __future__ import annotations

from typing import Dict, List, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kdtree.model.names import drafter_tensor_shapes
from kdtree.train.k2_torch import _key, rms_norm


def rope_half_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """positions i64[...] -> cos, sin f32[..., hd] for rotate_half RoPE (float64 angles, as the numpy drafter)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class DrafterTorch(nn.Module):
    """DFlash drafter; `embed` and `lm_head` are the target's (frozen buffers)."""

    def __init__(self, cfg, weights: Mapping[str, np.ndarray], embed: np.ndarray, lm_head: np.ndarray):
        super().__init__()
        self.cfg = cfg
        d = cfg.drafter
        self.B = int(d.block_size)
        self.layer_ids = [int(i) for i in d.target_layer_ids]
        self.nl, self.hq, self.hkv, self.hd = int(d.num_hidden_layers), int(d.num_attention_heads), \
            int(d.num_key_value_heads), int(d.head_dim)
        self.eps, self.theta = float(d.rms_norm_eps), float(d.rope_theta)
        self.mask_id = int(cfg.mask_token_id)
        self.names: List[str] = list(drafter_tensor_shapes(cfg))
        for n in self.names:
            self.register_parameter(_key(n), nn.Parameter(torch.tensor(np.asarray(weights[n], np.float32))))
        self.register_buffer("embed", torch.tensor(np.asarray(embed, np.float32)))
        self.register_buffer("lm_head", torch.tensor(np.asarray(lm_head, np.float32)))

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, _key(name))

    def export(self) -> Dict[str, np.ndarray]:
        return {n: self.w(n).detach().cpu().numpy().astype(np.float32).copy() for n in self.names}

    def context(self, hiddens: Mapping[int, torch.Tensor]) -> torch.Tensor:
        feats = torch.cat([hiddens[i] for i in self.layer_ids], -1)
        return rms_norm(F.linear(feats, self.w("fc.weight")), self.w("hidden_norm.weight"), self.eps)

    def _kv(self, i: int, x: torch.Tensor, cos, sin):
        """x [N, S, D] -> roped k [N, Hkv, S, hd], v [N, Hkv, S, hd]."""
        a = f"layers.{i}.self_attn"
        N, S, _ = x.shape
        k = F.linear(x, self.w(f"{a}.k_proj.weight")).view(N, S, self.hkv, self.hd)
        v = F.linear(x, self.w(f"{a}.v_proj.weight")).view(N, S, self.hkv, self.hd)
        k = apply_rope_half(rms_norm(k, self.w(f"{a}.k_norm.weight"), self.eps), cos[:, :, None], sin[:, :, None])
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, hiddens: Mapping[int, torch.Tensor], tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """hiddens {layer: [N, L, D]} of tokens i64[N, L]; anchors i64[N, A] (1 <= a, a + B - 1 < L + 1)
        -> logits f32[N, A, B-1, V], row j-1 predicting tokens[a + j] (j = 1..B-1)."""
        N, L = tokens.shape
        A, B = anchors.shape[1], self.B
        ctx = self.context(hiddens)                                                   # [N, L, D]
        ids = torch.full((N, A, B), self.mask_id, dtype=torch.long)
        ids[:, :, 0] = tokens.gather(1, anchors)
        x = F.embedding(ids, self.embed).view(N, A * B, -1)                           # [N, A*B, D]
        bpos = (anchors[:, :, None] + torch.arange(B)).view(N, A * B)                 # [N, A*B]
        bcos, bsin = rope_half_tables(bpos, self.hd, self.theta)
        ccos, csin = rope_half_tables(torch.arange(L).expand(N, L), self.hd, self.theta)
        # mask [N, A*B, L + A*B]: block of anchor a sees ctx rows < a and its own block
        ctx_vis = torch.arange(L)[None, None, :] < anchors[:, :, None]                # [N, A, L]
        ctx_vis = ctx_vis[:, :, None, :].expand(N, A, B, L).reshape(N, A * B, L)
        own = torch.eye(A, dtype=torch.bool)[:, None, :, None].expand(A, B, A, B).reshape(A * B, A * B)
        mask = torch.cat([ctx_vis, own.expand(N, A * B, A * B)], -1)[:, None]         # [N, 1, AB, L+AB]
        group = self.hq // self.hkv
        for i in range(self.nl):
            p, a = f"layers.{i}", f"layers.{i}.self_attn"
            h = rms_norm(x, self.w(f"{p}.input_layernorm.weight"), self.eps)
            q = F.linear(h, self.w(f"{a}.q_proj.weight")).view(N, A * B, self.hq, self.hd)
            q = apply_rope_half(rms_norm(q, self.w(f"{a}.q_norm.weight"), self.eps), bcos[:, :, None],
                                bsin[:, :, None]).transpose(1, 2)                      # [N, Hq, AB, hd]
            kc, vc = self._kv(i, ctx, ccos, csin)
            kb, vb = self._kv(i, h, bcos, bsin)
            k = torch.cat([kc, kb], 2).repeat_interleave(group, 1)
            v = torch.cat([vc, vb], 2).repeat_interleave(group, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.hd ** -0.5)
            x = x + F.linear(o.transpose(1, 2).reshape(N, A * B, self.hq * self.hd), self.w(f"{a}.o_proj.weight"))
            h = rms_norm(x, self.w(f"{p}.post_attention_layernorm.weight"), self.eps)
            x = x + F.linear(F.silu(F.linear(h, self.w(f"{p}.mlp.gate_proj.weight"))) *
                             F.linear(h, self.w(f"{p}.mlp.up_proj.weight")), self.w(f"{p}.mlp.down_proj.weight"))
        x = x.view(N, A, B, -1)[:, :, 1:]
        return F.linear(rms_norm(x, self.w("norm.weight"), self.eps), self.lm_head)
