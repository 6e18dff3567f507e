"""Absorbed MLA over the latent cache equals textbook MLA (kv_b_proj expanded to full per-head K and V,
HF-style rotate_half RoPE on de-interleaved pairs, standard masked softmax attention), and the whole K2
forward equals an independent float64 transcription of HF DeepseekV3.

Run: .venv/bin/python -m pytest -q tests/model/test_mla.py
"""
from __future__ import annotations

import numpy as np

from kdtree.model.names import is_moe_layer
from kdtree.model.rope import rope_mscale, softmax_scale, yarn_inv_freq


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def hf_rope(x, positions, cfg):
    """HF DeepSeek: de-interleave (x0,x2,..,x1,x3,..), then x*cos + rotate_half(x)*sin with cat(freqs, freqs)."""
    R = x.shape[-1]
    x = x.reshape(*x.shape[:-1], R // 2, 2).swapaxes(-1, -2).reshape(x.shape)
    ang = positions[:, None].astype(np.float64) * yarn_inv_freq(cfg)[None, :]
    emb = np.concatenate([ang, ang], axis=-1)                             # [S, R]
    cos, sin = np.cos(emb) * rope_mscale(cfg), np.sin(emb) * rope_mscale(cfg)
    if x.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    rot = np.concatenate([-x[..., R // 2:], x[..., :R // 2]], axis=-1)
    return x * cos + rot * sin


def naive_attention(cfg, W, layer, x, positions, mask):
    """Textbook MLA in float64: x [S, D] (already input-normed), mask bool[S, S] (query, key) -> [S, D]."""
    W = {k: np.asarray(v, np.float64) for k, v in W.items() if k.startswith(f"model.layers.{layer}.self_attn")}
    p = f"model.layers.{layer}.self_attn"
    H, nope, R, v, L = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    eps = cfg.rms_norm_eps
    x = x.astype(np.float64)
    S = x.shape[0]
    q = rms(x @ W[f"{p}.q_a_proj.weight"].T, W[f"{p}.q_a_layernorm.weight"], eps) @ W[f"{p}.q_b_proj.weight"].T
    q = q.reshape(S, H, nope + R)
    kv_a = x @ W[f"{p}.kv_a_proj_with_mqa.weight"].T                       # [S, L+R]
    c = rms(kv_a[:, :L], W[f"{p}.kv_a_layernorm.weight"], eps)
    kv = (c @ W[f"{p}.kv_b_proj.weight"].T).reshape(S, H, nope + v)       # full per-head K_nope and V
    k_pe = hf_rope(kv_a[:, L:], positions, cfg)                           # [S, R], shared by heads
    q_pe = hf_rope(q[:, :, nope:], positions, cfg)
    k = np.concatenate([kv[:, :, :nope], np.broadcast_to(k_pe[:, None, :], (S, H, R))], axis=-1)
    qq = np.concatenate([q[:, :, :nope], q_pe], axis=-1)
    scores = np.einsum("shd,thd->hst", qq, k) * softmax_scale(cfg)        # [H, S, S]
    scores = np.where(mask[None], scores, -np.inf)
    prob = np.exp(scores - scores.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    out = np.einsum("hst,thd->shd", prob, kv[:, :, nope:]).reshape(S, H * v)
    return out @ W[f"{p}.o_proj.weight"].T


def naive_mlp(W, p, x):
    g, u = x @ W[f"{p}.gate_proj.weight"].T, x @ W[f"{p}.up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ W[f"{p}.down_proj.weight"].T


def naive_moe(cfg, W, p, x):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        s = 1 / (1 + np.exp(-(W[f"{p}.gate.weight"] @ x[t])))
        choice = s + W[f"{p}.gate.e_score_correction_bias"]
        top = sorted(range(cfg.n_routed_experts), key=lambda e: -choice[e])[:cfg.num_experts_per_tok]
        w = s[top] / s[top].sum() * cfg.routed_scaling_factor
        for e, we in zip(top, w):
            out[t] += we * naive_mlp(W, f"{p}.experts.{e}", x[t])
        out[t] += naive_mlp(W, f"{p}.shared_experts", x[t])
    return out


def naive_forward(cfg, W64, tokens, positions):
    """HF DeepseekV3 forward, float64, causal, no cache -> logits [S, V]."""
    eps, S = cfg.rms_norm_eps, len(tokens)
    mask = np.tril(np.ones((S, S), bool))
    h = W64["model.embed_tokens.weight"][tokens]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        h = h + naive_attention(cfg, W64, i, rms(h, W64[f"{p}.input_layernorm.weight"], eps), positions, mask)
        x = rms(h, W64[f"{p}.post_attention_layernorm.weight"], eps)
        h = h + (naive_moe(cfg, W64, f"{p}.mlp", x) if is_moe_layer(cfg, i) else naive_mlp(W64, f"{p}.mlp", x))
    return rms(h, W64["model.norm.weight"], eps) @ W64["lm_head.weight"].T


def test_absorbed_attention_with_cache_equals_naive(tiny_cfg, tiny_weights, tiny_model):
    """Prefix of 5 rows goes into the cache, then a causal block of 4 rows attends to cache + block."""
    cfg, m = tiny_cfg, tiny_model
    rng = np.random.default_rng(1)
    P, T = 5, 4
    S = P + T
    x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    positions = np.arange(100, 100 + S)  # away from 0 so RoPE really rotates
    cos, sin = m.rotary.cos_sin(positions)
    for layer in (0, 2):
        a = m.layers[layer]["attn"]
        kv = np.zeros((S, cfg.kv_lora_rank + cfg.qk_rope_head_dim), np.float32)
        out_prefix = m._attention(a, x[:P], cos[:P], sin[:P], kv, 0, None)
        out_block = m._attention(a, x[P:], cos[P:], sin[P:], kv, P, None)
        ref = naive_attention(cfg, tiny_weights, layer, x, positions, np.tril(np.ones((S, S), bool)))
        got = np.concatenate([out_prefix, out_block])
        assert np.allclose(got, ref, rtol=1e-4, atol=1e-5), np.abs(got - ref).max()


def test_absorbed_attention_under_a_tree_mask_equals_naive(tiny_cfg, tiny_weights, tiny_model):
    """Block rows see the cache and only the block rows their visibility bits name."""
    from kdtree.tree import pack_visibility

    cfg, m = tiny_cfg, tiny_model
    rng = np.random.default_rng(2)
    P, T = 3, 5
    S = P + T
    x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    parents = [-1, 0, 0, 1, 2]  # block row -> parent block row
    vis = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    positions = np.concatenate([np.arange(P), P + np.array([0, 1, 1, 2, 2])])
    cos, sin = m.rotary.cos_sin(positions)
    mask = np.zeros((S, S), bool)
    mask[:, :P] = np.tril(np.ones((S, P), bool)) | (np.arange(S)[:, None] >= P)
    mask[P:, P:] = vis
    a = m.layers[1]["attn"]
    kv = np.zeros((S, cfg.kv_lora_rank + cfg.qk_rope_head_dim), np.float32)
    m._attention(a, x[:P], cos[:P], sin[:P], kv, 0, None)
    got = m._attention(a, x[P:], cos[P:], sin[P:], kv, P, pack_visibility(vis))
    ref = naive_attention(cfg, tiny_weights, 1, x, positions, mask)[P:]
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-5), np.abs(got - ref).max()


def test_model_forward_equals_float64_transcription(tiny_cfg, tiny_weights, tiny_model):
    """Prompt through the cache in two forwards (6 then 3 rows) == one naive causal pass over all 9 tokens."""
    cfg, m = tiny_cfg, tiny_model
    W64 = {k: v.astype(np.float64) for k, v in tiny_weights.items()}
    tokens = np.array([256, 72, 101, 108, 108, 111, 44, 32, 119], np.int32)
    positions = np.arange(len(tokens))
    cache = m.new_cache(16)
    first, _ = m.forward(tokens[:6], positions[:6], cache)
    second, _ = m.forward(tokens[6:], positions[6:], cache)
    got = np.concatenate([first, second])
    ref = naive_forward(cfg, W64, tokens, positions)
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-4), np.abs(got - ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).all()
