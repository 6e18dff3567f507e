"""The K2 architecture rules (which layers are MoE) and the tensor names and shapes of a K2 target and its DFlash
drafter, derived from the config alone.

The single source of truth for "which tensors must a checkpoint hold": the loader validates against it,
the tiny checkpoint generator fills it, the planner sizes it, the quantizer decides per module.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Tuple

import numpy as np

Shape = Tuple[int, ...]


def is_moe_layer(cfg, layer: int) -> bool:
    return layer >= cfg.first_k_dense_replace and layer % cfg.moe_layer_freq == 0


def target_linear_shapes(cfg) -> Dict[str, Shape]:
    """Module name -> [out, in] of every Linear of the target (weights are `<module>.weight`)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out: Dict[str, Shape] = {}
    for i in range(cfg.num_hidden_layers):
        a = f"model.layers.{i}.self_attn"
        out[f"{a}.q_a_proj"] = (cfg.q_lora_rank, D)
        out[f"{a}.q_b_proj"] = (H * (nope + rope), cfg.q_lora_rank)
        out[f"{a}.kv_a_proj_with_mqa"] = (cfg.kv_lora_rank + rope, D)
        out[f"{a}.kv_b_proj"] = (H * (nope + v), cfg.kv_lora_rank)
        out[f"{a}.o_proj"] = (D, H * v)
        m = f"model.layers.{i}.mlp"
        if is_moe_layer(cfg, i):
            inter = cfg.moe_intermediate_size
            for e in range(cfg.n_routed_experts):
                out[f"{m}.experts.{e}.gate_proj"] = (inter, D)
                out[f"{m}.experts.{e}.up_proj"] = (inter, D)
                out[f"{m}.experts.{e}.down_proj"] = (D, inter)
            if cfg.n_shared_experts:
                shared = inter * cfg.n_shared_experts
                out[f"{m}.shared_experts.gate_proj"] = (shared, D)
                out[f"{m}.shared_experts.up_proj"] = (shared, D)
                out[f"{m}.shared_experts.down_proj"] = (D, shared)
        else:
            out[f"{m}.gate_proj"] = (cfg.intermediate_size, D)
            out[f"{m}.up_proj"] = (cfg.intermediate_size, D)
            out[f"{m}.down_proj"] = (D, cfg.intermediate_size)
    out["lm_head"] = (cfg.vocab_size, D)
    return out


def target_tensor_shapes(cfg) -> Dict[str, Shape]:
    """Tensor name -> shape of every tensor of an unquantized target checkpoint, in file order."""
    D = cfg.hidden_size
    lin = target_linear_shapes(cfg)
    by_layer: Dict[str, list] = {}  # "model.layers.N" -> its linears in order (one pass, not layers x linears)
    for name, shape in lin.items():
        if name.startswith("model.layers."):
            by_layer.setdefault(".".join(name.split(".", 3)[:3]), []).append((name, shape))
    out: Dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (D,)
        out[f"{p}.post_attention_layernorm.weight"] = (D,)
        out[f"{p}.self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[f"{p}.self_attn.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        for name, shape in by_layer.get(p, ()):
            out[f"{name}.weight"] = shape
        if is_moe_layer(cfg, i):
            out[f"{p}.mlp.gate.weight"] = (cfg.n_routed_experts, D)
            out[f"{p}.mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
    out["model.norm.weight"] = (D,)
    out["lm_head.weight"] = lin["lm_head"]
    return out


def drafter_linear_shapes(cfg) -> Dict[str, Shape]:
    """Module name -> [out, in] of every Linear of the DFlash drafter (cfg = the target ModelConfig)."""
    d, D = cfg.drafter, cfg.hidden_size
    hq, hkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    out: Dict[str, Shape] = {"fc": (D, len(d.target_layer_ids) * D)}
    for i in range(d.num_hidden_layers):
        a = f"layers.{i}.self_attn"
        out[f"{a}.q_proj"] = (hq * hd, D)
        out[f"{a}.k_proj"] = (hkv * hd, D)
        out[f"{a}.v_proj"] = (hkv * hd, D)
        out[f"{a}.o_proj"] = (D, hq * hd)
        out[f"layers.{i}.mlp.gate_proj"] = (d.intermediate_size, D)
        out[f"layers.{i}.mlp.up_proj"] = (d.intermediate_size, D)
        out[f"layers.{i}.mlp.down_proj"] = (D, d.intermediate_size)
    return out


def drafter_tensor_shapes(cfg) -> Dict[str, Shape]:
    """Tensor name -> shape of the DFlash drafter checkpoint (embeddings and lm_head are the target's)."""
    d, D = cfg.drafter, cfg.hidden_size
    lin = drafter_linear_shapes(cfg)
    out: Dict[str, Shape] = {"fc.weight": lin["fc"], "hidden_norm.weight": (D,)}
    for i in range(d.num_hidden_layers):
        p = f"layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (D,)
        out[f"{p}.post_attention_layernorm.weight"] = (D,)
        out[f"{p}.self_attn.q_norm.weight"] = (d.head_dim,)
        out[f"{p}.self_attn.k_norm.weight"] = (d.head_dim,)
        for name, shape in lin.items():
            if name.startswith(p + "."):
                out[f"{name}.weight"] = shape
    out["norm.weight"] = (D,)
    return out


class LazyWeights(Mapping):
    """init_weights(shapes, seed), each tensor generated when it is read (same bytes): a big checkpoint is
    written shard by shard without holding every tensor (k26_mini: 6.7 GB of float32)."""

    def __init__(self, shapes: Dict[str, Shape], seed: int):
        self.shapes, self.seed = dict(shapes), seed

    def __getitem__(self, name: str) -> np.ndarray:
        return init_weights({name: self.shapes[name]}, self.seed)[name]

    def peek(self, name: str) -> np.ndarray:
        """A zero-strided float32 array of the tensor's shape: its size without generating it."""
        return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), self.shapes[name], (0,) * len(self.shapes[name]))

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def init_weights(shapes: Dict[str, Shape], seed: int) -> Dict[str, np.ndarray]:
    """Deterministic random float32 weights: norms = 1, biases ~ N(0, 0.1), matrices ~ N(0, 1/fan_in).

    Every tensor gets its own generator seeded from (seed, name), so adding a tensor changes no other.
    """
    import zlib

    out: Dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith("norm.weight"):
            w = np.ones(shape, np.float32)
        elif name.endswith("e_score_correction_bias"):
            w = rng.normal(0.0, 0.1, shape).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            w = rng.normal(0.0, 1.0, shape).astype(np.float32)
        else:
            w = (rng.normal(0.0, 1.0, shape) / np.sqrt(shape[-1])).astype(np.float32)
        out[name] = w
    return out
