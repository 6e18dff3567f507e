"""DFlash drafter: forward against an independent torch transcription of the DFlash layer, incremental
context == one-shot context, safetensors round trip, and one-line errors for a wrong checkpoint.

Run: .venv/bin/python -m pytest -q tests/model/test_drafter.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kdtree.backends import get_ops
from kdtree.model.names import drafter_tensor_shapes, init_weights, target_tensor_shapes
from kdtree.errors import CheckpointError, KdtreeError
from kdtree.model.drafter import DFlashDrafter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return tiny_cfg


@pytest.fixture(scope="module")
def target_w(cfg):
    shapes = target_tensor_shapes(cfg)
    keep = {k: shapes[k] for k in ("model.embed_tokens.weight", "lm_head.weight")}
    return init_weights(keep, seed=0)


@pytest.fixture(scope="module")
def drafter_w(cfg):
    w = init_weights(drafter_tensor_shapes(cfg), seed=1)
    rng = np.random.default_rng(3)
    for k in w:  # non-unit norms so a norm applied to the wrong tensor shows up
        if k.endswith("norm.weight"):
            w[k] = (1.0 + 0.3 * rng.standard_normal(w[k].shape)).astype(np.float32)
    return w


def make(cfg, drafter_w, target_w):
    return DFlashDrafter(cfg, drafter_w, get_ops("numpy"), target_w["model.embed_tokens.weight"],
                         target_w["lm_head.weight"])


def hiddens(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    return {i: rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for i in cfg.drafter.target_layer_ids}


def torch_reference(cfg, W, embed, lm_head, hid, bonus):
    """DFlash's Qwen3 drafter written the HF way (rotate_half, repeat_kv, SDPA non-causal), float64."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    d = cfg.drafter
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in W.items()}
    B, hq, hkv, hd, eps = d.block_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rot(x):
        return torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)

    feats = torch.cat([torch.tensor(hid[i], dtype=torch.float64) for i in d.target_layer_ids], -1)
    ctx = rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    n = ctx.shape[0]
    ids = torch.tensor([bonus] + [cfg.mask_token_id] * (B - 1))
    x = torch.tensor(embed, dtype=torch.float64)[ids]
    inv = 1.0 / (d.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(n + B, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[None], emb.sin()[None]          # [1, n+B, hd]
    for i in range(d.num_hidden_layers):
        p = f"layers.{i}"
        h = rms(x, t[f"{p}.input_layernorm.weight"])
        q = (h @ t[f"{p}.self_attn.q_proj.weight"].T).view(B, hq, hd).transpose(0, 1)
        both = torch.cat([ctx, h], 0)
        k = (both @ t[f"{p}.self_attn.k_proj.weight"].T).view(n + B, hkv, hd).transpose(0, 1)
        v = (both @ t[f"{p}.self_attn.v_proj.weight"].T).view(n + B, hkv, hd).transpose(0, 1)
        q, k = rms(q, t[f"{p}.self_attn.q_norm.weight"]), rms(k, t[f"{p}.self_attn.k_norm.weight"])
        q = q * cos[:, n:] + rot(q) * sin[:, n:]
        k = k * cos + rot(k) * sin
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=False)[0]
        x = x + o.transpose(0, 1).reshape(B, hq * hd) @ t[f"{p}.self_attn.o_proj.weight"].T
        h = rms(x, t[f"{p}.post_attention_layernorm.weight"])
        g, u = h @ t[f"{p}.mlp.gate_proj.weight"].T, h @ t[f"{p}.mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ t[f"{p}.mlp.down_proj.weight"].T
    return (rms(x, t["norm.weight"])[1:] @ torch.tensor(lm_head, dtype=torch.float64).T).numpy()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_forward_matches_torch_transcription(cfg, drafter_w, target_w, backend):
    try:
        ops = get_ops(backend)
    except KdtreeError as e:
        pytest.skip(f"backend={backend} unavailable ({e})")
    dr = DFlashDrafter(cfg, drafter_w, ops, target_w["model.embed_tokens.weight"], target_w["lm_head.weight"])
    hid = hiddens(cfg, 11)
    cache = dr.new_cache(64)
    dr.extend(cache, hid)
    got = dr.draft(cache, bonus=65)
    assert got.shape == (cfg.drafter.block_size - 1, cfg.vocab_size) and got.dtype == np.float32
    ref = torch_reference(cfg, drafter_w, target_w["model.embed_tokens.weight"], target_w["lm_head.weight"], hid, 65)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)  # float32 vs float64, logits ~O(1)


def test_incremental_context_equals_one_shot(cfg, drafter_w, target_w):
    dr = make(cfg, drafter_w, target_w)
    hid = hiddens(cfg, 13, seed=5)
    one = dr.new_cache(32)
    dr.extend(one, hid)
    inc = dr.new_cache(32)
    for a, b in ((0, 6), (6, 7), (7, 13)):     # prefill, then rounds committing 1 and 6 tokens
        dr.extend(inc, {k: v[a:b] for k, v in hid.items()})
    assert inc.length == one.length == 13
    np.testing.assert_allclose(dr.draft(inc, 7), dr.draft(one, 7), rtol=1e-5, atol=1e-5)
    # the context matters: dropping the last row changes the draft
    short = dr.new_cache(32)
    dr.extend(short, {k: v[:12] for k, v in hid.items()})
    assert not np.allclose(dr.draft(short, 7), dr.draft(one, 7), atol=1e-3)


def test_loads_from_safetensors(cfg, drafter_w, target_w, tmp_path):
    from safetensors.numpy import save_file

    d = tmp_path / "drafter"
    d.mkdir()
    names = list(drafter_w)
    save_file({k: drafter_w[k] for k in names[: len(names) // 2]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: drafter_w[k] for k in names[len(names) // 2:]}, str(d / "model-00002-of-00002.safetensors"))
    ops = get_ops("numpy")
    loaded = DFlashDrafter.load(d, cfg, ops, target_w["model.embed_tokens.weight"], target_w["lm_head.weight"])
    mem = make(cfg, drafter_w, target_w)
    hid = hiddens(cfg, 9, seed=2)
    c1, c2 = loaded.new_cache(32), mem.new_cache(32)
    loaded.extend(c1, hid)
    mem.extend(c2, hid)
    np.testing.assert_array_equal(loaded.draft(c1, 3), mem.draft(c2, 3))


def test_wrong_checkpoint_is_one_line_error(cfg, drafter_w, target_w, tmp_path):
    from safetensors.numpy import save_file

    bad = dict(drafter_w)
    bad["fc.weight"] = bad["fc.weight"][:, :-1].copy()
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"fc\.weight has shape .* expected") as e:
        DFlashDrafter.load(tmp_path, cfg, get_ops("numpy"), target_w["model.embed_tokens.weight"],
                           target_w["lm_head.weight"])
    assert "\n" not in str(e.value)
    missing = {k: v for k, v in drafter_w.items() if k != "norm.weight"}
    with pytest.raises(CheckpointError, match=r"lacks tensor norm\.weight"):
        make(cfg, missing, target_w)
    with pytest.raises(CheckpointError, match="no .safetensors"):
        DFlashDrafter.load(tmp_path / "nowhere", cfg, get_ops("numpy"), None, None)
