"""Torch re-statement of the K2 target (DeepSeek-V3 architecture) for training on a CPU.

Same math as kdtree/model/k2.py, but MLA in the *non-absorbed* form (mathematically equal):
  q      = q_b(rms(q_a(x)))                       -> [T, H, nope + rope]
  kv_a   = kv_a_proj_with_mqa(x) = [c | k_pe]      c: [T, kv_lora], k_pe: [T, rope] (shared by heads)
  k, v   = split(kv_b(rms(c)))                     -> [T, H, nope], [T, H, v]
  score  = (q_nope . k_nope + rope(q_pe) . rope(k_pe)) * softmax_scale(cfg)    (YaRN, interleaved pairs)
MoE: s = sigmoid(x Wg^T); top-k of s + e_score_correction_bias; weights = selected s normalised x
routed_scaling_factor; + the shared expert. Parameters keep the checkpoint tensor names
(kdtree/model/names.target_tensor_shapes) so `export()` writes a checkpoint directly.

The router bias is a buffer, not a parameter: gradients never touch it. `K2Torch.update_router_bias`
applies DeepSeek-V3's auxiliary-loss-free balancing (bias += gamma * sign(mean load - load)) from the
expert loads of the last forward.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kdtree.model.names import is_moe_layer, target_tensor_shapes
from kdtree.model.rope import rope_mscale, softmax_scale, yarn_inv_freq


def _key(name: str) -> str:
    return name.replace(".", "__")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(cfg, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """positions i64[...] -> cos, sin f32[..., R/2] (float64 angles, rounded once, as RotaryTable)."""
    inv = torch.from_numpy(yarn_inv_freq(cfg))                        # f64[R/2]
    ang = positions.to(torch.float64)[..., None] * inv
    m = rope_mscale(cfg)
    return (torch.cos(ang) * m).to(torch.float32), (torch.sin(ang) * m).to(torch.float32)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x [..., R], cos/sin broadcastable to [..., R/2]."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


class _Permute(torch.autograd.Function):
    """x[perm] whose backward is a gather by the inverse permutation (no scatter-add)."""

    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.save_for_backward(inv)
        return x[perm]

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g[inv], None, None


class K2Torch(nn.Module):
    """K2 target over a name -> tensor dict. forward(tokens [N, T]) -> (logits [N, T, V], {layer: hidden})."""

    def __init__(self, cfg, weights: Mapping[str, np.ndarray]):
        super().__init__()
        self.cfg = cfg
        self.eps = float(cfg.rms_norm_eps)
        self.names: List[str] = list(target_tensor_shapes(cfg))
        self.bias_names: List[str] = [n for n in self.names if n.endswith("e_score_correction_bias")]
        for name in self.names:
            t = torch.tensor(np.asarray(weights[name], np.float32))
            if name in self.bias_names:
                self.register_buffer(_key(name), t)
            else:
                self.register_parameter(_key(name), nn.Parameter(t))
        self.scale = softmax_scale(cfg)
        self.last_load: Dict[int, torch.Tensor] = {}   # layer -> tokens routed per expert, last forward

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, _key(name))

    def export(self) -> Dict[str, np.ndarray]:
        """Tensor name -> float32 ndarray, in checkpoint order."""
        return {n: self.w(n).detach().cpu().numpy().astype(np.float32).copy() for n in self.names}

    # ---------------------------------------------------------------------------------------------------
    def _attn(self, p: str, x: torch.Tensor, cos, sin, past: Optional[Tuple[torch.Tensor, ...]], mask):
        cfg = self.cfg
        N, T, _ = x.shape
        nope, R, V, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        H = cfg.num_attention_heads
        q = F.linear(rms_norm(F.linear(x, self.w(f"{p}.q_a_proj.weight")), self.w(f"{p}.q_a_layernorm.weight"),
                              self.eps), self.w(f"{p}.q_b_proj.weight")).view(N, T, H, nope + R)
        kv_a = F.linear(x, self.w(f"{p}.kv_a_proj_with_mqa.weight"))
        c = rms_norm(kv_a[..., :L], self.w(f"{p}.kv_a_layernorm.weight"), self.eps)
        k_pe = apply_rope_interleaved(kv_a[..., L:], cos, sin)                         # [N, T, R]
        kv = F.linear(c, self.w(f"{p}.kv_b_proj.weight")).view(N, T, H, nope + V)
        q_pe = apply_rope_interleaved(q[..., nope:], cos[:, :, None], sin[:, :, None])
        qf = torch.cat([q[..., :nope], q_pe], -1).transpose(1, 2)                      # [N, H, T, nope+R]
        kf = torch.cat([kv[..., :nope], k_pe[:, :, None].expand(N, T, H, R)], -1).transpose(1, 2)
        vf = kv[..., nope:].transpose(1, 2)                                            # [N, H, T, V]
        if past is not None:
            kf = torch.cat([past[0], kf], 2)
            vf = torch.cat([past[1], vf], 2)
        present = (kf, vf)
        if mask is None:
            o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=self.scale)
        o = o.transpose(1, 2).reshape(N, T, H * V)
        return F.linear(o, self.w(f"{p}.o_proj.weight")), present

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w(f"{p}.gate_proj.weight"))) * F.linear(x, self.w(f"{p}.up_proj.weight")),
                        self.w(f"{p}.down_proj.weight"))

    def _moe(self, i: int, p: str, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])                                                  # [M, D]
        scores = torch.sigmoid(F.linear(x2, self.w(f"{p}.gate.weight")))               # [M, E]
        choice = scores.detach() + self.w(f"{p}.gate.e_score_correction_bias")
        k = cfg.num_experts_per_tok
        idx = torch.topk(choice, k, dim=-1).indices                                    # [M, k]
        wts = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * cfg.routed_scaling_factor
        E = cfg.n_routed_experts
        M, D = x2.shape
        flat = idx.reshape(-1)                                                         # [M*k] token-major
        perm = torch.argsort(flat, stable=True)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        counts = torch.bincount(flat, minlength=E)
        self.last_load[i] = counts.detach()
        xs = _Permute.apply(x2[:, None, :].expand(M, k, D).reshape(M * k, D), perm, inv)   # grouped by expert
        ys = [self._mlp(f"{p}.experts.{e}", part) if part.shape[0] else part
              for e, part in enumerate(xs.split(counts.tolist()))]
        y = _Permute.apply(torch.cat(ys), inv, perm).view(M, k, D)                      # back to token order
        out = (y * wts[..., None]).sum(1)
        if cfg.n_shared_experts:
            out = out + self._mlp(f"{p}.shared_experts", x2)
        return out.view(shape)

    def forward(self, tokens: torch.Tensor, hidden_layers: Iterable[int] = (), positions: Optional[torch.Tensor] = None,
                past: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None, want_logits: bool = True):
        """tokens i64[N, T] -> (logits f32[N, T, V] | None, {layer: f32[N, T, D]}, present kv per layer).

        `past` (from a previous call's third output) continues a sequence: the new rows attend to all past
        rows and causally among themselves.
        """
        N, T = tokens.shape
        n_past = 0 if past is None else past[0][0].shape[2]
        if positions is None:
            positions = torch.arange(n_past, n_past + T).expand(N, T)
        cos, sin = rope_tables(self.cfg, positions)                                     # [N, T, R/2]
        mask = None
        if n_past:
            mask = torch.ones(T, n_past + T, dtype=torch.bool).tril(n_past)
        want = set(hidden_layers)
        h = F.embedding(tokens, self.w("model.embed_tokens.weight"))
        hiddens: Dict[int, torch.Tensor] = {}
        presents = []
        for i in range(self.cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            a, pres = self._attn(f"{p}.self_attn", rms_norm(h, self.w(f"{p}.input_layernorm.weight"), self.eps),
                                 cos, sin, None if past is None else past[i], mask)
            presents.append(pres)
            h = h + a
            x = rms_norm(h, self.w(f"{p}.post_attention_layernorm.weight"), self.eps)
            h = h + (self._moe(i, f"{p}.mlp", x) if is_moe_layer(self.cfg, i) else self._mlp(f"{p}.mlp", x))
            if i in want:
                hiddens[i] = h
        logits = None
        if want_logits:
            logits = F.linear(rms_norm(h, self.w("model.norm.weight"), self.eps), self.w("lm_head.weight"))
        return logits, hiddens, presents

    @torch.no_grad()
    def update_router_bias(self, gamma: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower over-loaded."""
        for i, load in self.last_load.items():
            b = self.w(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
            load = load.to(torch.float32)
            b += gamma * torch.sign(load.mean() - load)

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
        """Greedy continuation of equal-length prompts i64[N, P] -> i64[N, n_new] (KV-cached)."""
        logits, _, past = self.forward(prompts)
        out = []
        nxt = logits[:, -1].argmax(-1)
        for _ in range(n_new):
            out.append(nxt)
            if len(out) == n_new:
                break
            logits, _, past = self.forward(nxt[:, None], past=past)
            nxt = logits[:, -1].argmax(-1)
        return torch.stack(out, 1)
