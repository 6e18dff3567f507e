"""What a K2 target derives from its checkpoint's tensors and config, defined once for every target that runs it:
the numpy K2Model (kdtree/model/k2.py) and the native one (kdtree/backends/native_forward.NativeTarget).

    w = weight_getter(cfg, weights)                    # name -> tensor, a missing one is a CheckpointError
    lm_head = lm_head_weight(cfg, weights, embed)      # lm_head.weight, or the tied embeddings
    heads, w_uk, w_uv = split_kv_b(cfg, w, layer)      # absorbed MLA: kv_b_proj per head
    route = route_params(cfg)                          # routing constants as plain Python values
    yarn_inv_freq(cfg), rope_mscale(cfg), softmax_scale(cfg)   # kdtree/model/rope.py, re-exported here

Tensor names follow kdtree/model/names.py (target_tensor_shapes).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Mapping, Tuple

import numpy as np

from kdtree.bf16 import bf16_to_f32
from kdtree.errors import CheckpointError, ConfigError
from kdtree.model.rope import rope_mscale, softmax_scale, yarn_inv_freq


def weight_getter(cfg, weights: Mapping[str, Any]) -> Callable[[str], Any]:
    """name -> weights[name]; a missing tensor is a CheckpointError naming it and the model."""
    def w(name: str) -> Any:
        if name not in weights:
            raise CheckpointError(f"tensor {name} is missing from the weights of model={cfg.name}; "
                                  f"regenerate or re-download the checkpoint")
        return weights[name]
    return w


def is_bf16(a: Any) -> bool:
    """A tensor the loader kept as BF16 bits (load_checkpoint(bf16=True): uint16 ndarray)."""
    return isinstance(a, np.ndarray) and a.dtype == np.uint16


def as_f32(a: Any) -> np.ndarray:
    """A float tensor as float32 values: BF16 bits widened exactly, anything else converted."""
    return bf16_to_f32(a) if is_bf16(a) else np.asarray(a, np.float32)


def dense(w: Any, name: str) -> np.ndarray:
    """A weight the model needs as float32 values (kv_b_proj, the router): an ndarray, or a quantized one
    dequantized; anything else is a CheckpointError naming the tensor."""
    if isinstance(w, np.ndarray):
        return as_f32(w)
    if hasattr(w, "dequantize"):
        return np.asarray(w.dequantize(), np.float32)
    raise CheckpointError(f"{name}: expected a float32 array, got {type(w).__name__}; "
                          f"keep this module unquantized (add it to quant.ignore)")


def embed_weight(weights: Mapping[str, Any], w: Callable[[str], Any]) -> np.ndarray:
    """model.embed_tokens.weight as f32[V, D] (kept as BF16 bits u16[V, D] when the loader kept it so)."""
    e = w("model.embed_tokens.weight")
    return e if is_bf16(e) else np.asarray(e, np.float32)


def lm_head_weight(cfg, weights: Mapping[str, Any], embed: np.ndarray) -> Any:
    """lm_head.weight [V, D] (f32 or quantized), or the embeddings themselves when the config ties them and the
    checkpoint has no lm_head.weight."""
    if "lm_head.weight" in weights or not cfg.tie_word_embeddings:
        return weight_getter(cfg, weights)("lm_head.weight")
    return embed


def attn_heads(cfg, q_b: Any) -> int:
    """Local attention heads of q_b_proj [H * (nope + rope), q_lora] (tensor-parallel shards split heads)."""
    return int(q_b.shape[0]) // (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


def split_kv_b(cfg, w: Callable[[str], Any], layer: int,
               keep_bf16: bool = False) -> Tuple[int, np.ndarray, np.ndarray]:
    """kv_b_proj of `layer` split per head for the absorbed form -> (heads, W_uk f32[H, nope, L], W_uv f32[H, v, L]);
    keep_bf16: a kv_b_proj the loader kept as BF16 bits stays so (u16, the same layout: the native forward widens it
    exactly in its kernels)."""
    nope, v, L = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    p = f"model.layers.{layer}.self_attn"
    heads = attn_heads(cfg, w(f"{p}.q_b_proj.weight"))
    raw = w(f"{p}.kv_b_proj.weight")
    kv_b = (raw if keep_bf16 and is_bf16(raw) else dense(raw, f"{p}.kv_b_proj.weight")).reshape(heads, nope + v, L)
    w_uk = np.ascontiguousarray(kv_b[:, :nope, :])   # [H, nope, L]
    w_uv = np.ascontiguousarray(kv_b[:, nope:, :])   # [H, v, L]
    return heads, w_uk, w_uv


def transposed_w_uk(w_uk: np.ndarray) -> np.ndarray:
    """W_uk [H, nope, L] as per-head linear weights W_uk^T [H, L, nope] (the native per-head linear's layout)."""
    return np.ascontiguousarray(w_uk.transpose(0, 2, 1))


def router_weights(w: Callable[[str], Any], layer: int, keep_bf16: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """The MoE router of `layer`: gate f32[E, D] (keep_bf16: a gate the loader kept as BF16 bits stays so, u16[E, D])
    and e_score_correction_bias f32[E]."""
    p = f"model.layers.{layer}.mlp.gate"
    raw = w(f"{p}.weight")
    gate = raw if keep_bf16 and is_bf16(raw) else dense(raw, f"{p}.weight").astype(np.float32)
    return gate, as_f32(w(f"{p}.e_score_correction_bias"))


def route_params(cfg) -> SimpleNamespace:
    """Routing parameters as plain Python values: read per MoE layer per forward, and an OmegaConf lookup costs more
    than the routing arithmetic of a few rows."""
    return SimpleNamespace(
        num_experts_per_tok=int(cfg.num_experts_per_tok), n_group=int(cfg.n_group),
        topk_group=int(cfg.topk_group), norm_topk_prob=bool(cfg.norm_topk_prob),
        routed_scaling_factor=float(cfg.routed_scaling_factor))


def check_context(cfg, max_len: int) -> None:
    """A cache of max_len rows fits the model's context, else a ConfigError naming the fix."""
    if max_len > cfg.max_position_embeddings:
        raise ConfigError(f"context of {max_len} tokens exceeds max_position_embeddings="
                          f"{cfg.max_position_embeddings} of model={cfg.name}; "
                          f"shorten the prompt or lower max_new_tokens")


def check_seq(s: int, tokens, positions, cache, visibility):
    """One sequence's forward arguments, checked and converted: (tokens i64[T], positions i64[T], cache,
    visibility). Every target checks with this (TPModel on rank 0, before any worker starts)."""
    tokens = np.asarray(tokens, np.int64)
    positions = np.asarray(positions, np.int64)
    T = tokens.shape[0]
    if positions.shape != (T,):
        raise ValueError(f"sequence {s}: positions shape {positions.shape} != tokens shape ({T},)")
    if cache.length + T > cache.max_len:
        raise ConfigError(f"latent cache of {cache.max_len} rows cannot hold {cache.length} + {T} tokens; "
                          f"create it with a larger max_len (prompt + max_new_tokens + tree budget)")
    if visibility is not None and np.shape(visibility) != (T, (T + 63) // 64):
        raise ValueError(f"sequence {s}: visibility shape {np.shape(visibility)} != ({T}, {(T + 63) // 64})")
    return tokens, positions, cache, visibility


__all__ = ["attn_heads", "check_context", "check_seq", "dense", "embed_weight", "lm_head_weight", "route_params",
           "rope_mscale", "router_weights", "softmax_scale", "split_kv_b", "transposed_w_uk", "weight_getter",
           "yarn_inv_freq"]
