"""model=tiny_wide: the trained tiny checkpoint (kdtree/assets/tiny, target + DFlash drafter) widened to bigger
widths by a function-preserving transform: the widened model computes tiny's logits up to float rounding, so it
decodes tiny's tokens with tiny's acceptance, at (say) K2.6's matrix widths.

Hidden (residual) space D -> D': Q f32[D, D'] has orthonormal rows with disjoint supports (row i is a seeded random
unit vector on columns [i*g, (i+1)*g), g = D'/D), s = sqrt(D'/D), and every hidden vector x is carried as
x' = s * x @ Q. Then rms(x') = rms(x) (RMSNorm's eps stays), and an RMSNorm weight over D becomes the weight
repeated over each group (elementwise scaling commutes with Q because the supports are disjoint), so no norm is
folded anywhere: exact for the drafter's extra norms and for the lm_head shared after two final norms.

    Linear reading hidden (HF W[out, in]):   W' = W @ Q / s          (x' W'^T = x Q Q^T W^T = x W^T)
    Linear writing hidden:                   W' = s * Q^T @ W
    embedding rows:                          E' = s * E @ Q
    a concatenation of k hidden vectors:     blockdiag(Q, ..., Q) on the input side (the drafter's fc)
    SwiGLU intermediate I -> r*I:            each neuron repeated r times in gate/up rows, down columns repeated / r

Attention-internal dims (LoRA ranks, heads, head dims), the routers' biases and the drafter's MLP width stay
tiny's. Every tensor name of names.target_tensor_shapes / drafter_tensor_shapes has a rule; an unknown one raises.
Because Q has disjoint supports every widened element is one product (no sums), so the transform adds one float32
rounding per weight. The checkpoint is written one shard at a time (a default-width target is ~6.4 GB fp32).
"""
from __future__ import annotations

import math
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
from omegaconf import OmegaConf

from kdtree.checkpoint.hf_config import drafter_config_json, plain, target_config_json
from kdtree.checkpoint.index import INDEX_FILE
from kdtree.checkpoint.safetensors_io import read_file, read_header
from kdtree.checkpoint.writer import write_checkpoint
from kdtree.config.schema import CONF_DIR
from kdtree.errors import CheckpointError, ConfigError
from kdtree.model import names

WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size")
SOURCES = ("tiny",)   # models with a trained checkpoint to widen (kdtree/assets/tiny)


def _ns(m: dict):
    return types.SimpleNamespace(**{**m, "drafter": types.SimpleNamespace(**m["drafter"])})


def is_widened(model_cfg) -> bool:
    return bool(plain(model_cfg).get("widen_from", ""))


def source_config(model_cfg) -> dict:
    """The config of the trained model `model_cfg` widens: itself with widen_from's widths (and name), checked."""
    m = plain(model_cfg)
    src_name = m.get("widen_from", "")
    if src_name not in SOURCES:
        raise ConfigError(f"model.widen_from={src_name!r} (model={m['name']}) has no trained checkpoint to widen; "
                          f"use model.widen_from={' or '.join(SOURCES)}")
    if m.get("init", "trained") != "trained":
        raise ConfigError(f"model.init={m.get('init')} with model.widen_from={src_name} (model={m['name']}): a widened "
                          f"model is the trained one; use model.init=trained (model=k26_mini has random weights)")
    src = plain(OmegaConf.load(CONF_DIR / "model" / f"{src_name}.yaml"))
    out = {**m, **{k: src[k] for k in WIDTHS}, "name": src["name"], "widen_from": "", "init": "trained"}
    for k in WIDTHS:
        n, w = int(src[k]), int(m[k])
        if w < n or w % n:
            raise ConfigError(f"model.{k}={w} (model={m['name']}) is not a multiple of {src_name}'s {n}: widening "
                              f"repeats each of its {n} dims a whole number of times; use a multiple, e.g. {4 * n}")
    return out


def ratios(src: dict, dst: dict) -> Dict[str, int]:
    return {k: int(dst[k]) // int(src[k]) for k in WIDTHS}


def embedding(d: int, d_wide: int, seed: int) -> np.ndarray:
    """The rows of Q on their supports: V f32[D, g], row i = a seeded random unit vector (Q[i, i*g:(i+1)*g] = V[i])."""
    g = d_wide // d
    rng = np.random.default_rng([int(seed), d, d_wide])
    v = rng.standard_normal((d, g))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v.astype(np.float32)


class Widener:
    """widen(name, w): one tensor of the source checkpoint -> the widened one (float32)."""

    def __init__(self, src: dict, dst: dict):
        self.src, self.dst = src, dst
        self.r = ratios(src, dst)
        self.D, self.Dw = int(src["hidden_size"]), int(dst["hidden_size"])
        self.s = math.sqrt(self.Dw / self.D)
        v = embedding(self.D, self.Dw, dst["seed"])
        self.v_read = (v / np.float32(self.s)).astype(np.float32)   # Q / s on its supports
        self.v_write = (v * np.float32(self.s)).astype(np.float32)  # s * Q on its supports
        self.k = len(dst["drafter"]["target_layer_ids"])
        self.target_rules: List[Tuple[str, Callable]] = [
            (r"model\.embed_tokens\.weight", self.embed),
            (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", self.norm),
            (r"model\.norm\.weight", self.norm),
            (r"model\.layers\.\d+\.self_attn\.(q_a|kv_a)_layernorm\.weight", self.same),
            (r"model\.layers\.\d+\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", self.reader),
            (r"model\.layers\.\d+\.self_attn\.(q_b_proj|kv_b_proj)\.weight", self.same),
            (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", self.writer),
            (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", lambda w: self.gate_up(w, "intermediate_size")),
            (r"model\.layers\.\d+\.mlp\.down_proj\.weight", lambda w: self.down(w, "intermediate_size")),
            (r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.(gate|up)_proj\.weight",
             lambda w: self.gate_up(w, "moe_intermediate_size")),
            (r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.down_proj\.weight",
             lambda w: self.down(w, "moe_intermediate_size")),
            (r"model\.layers\.\d+\.mlp\.gate\.weight", self.reader),
            (r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias", self.same),
            (r"lm_head\.weight", self.reader),
        ]
        self.drafter_rules: List[Tuple[str, Callable]] = [
            (r"fc\.weight", self.fc),
            (r"hidden_norm\.weight", self.norm),
            (r"norm\.weight", self.norm),
            (r"layers\.\d+\.(input|post_attention)_layernorm\.weight", self.norm),
            (r"layers\.\d+\.self_attn\.(q|k)_norm\.weight", self.same),
            (r"layers\.\d+\.self_attn\.(q|k|v)_proj\.weight", self.reader),
            (r"layers\.\d+\.self_attn\.o_proj\.weight", self.writer),
            (r"layers\.\d+\.mlp\.(gate|up)_proj\.weight", self.reader),   # the drafter keeps its MLP width
            (r"layers\.\d+\.mlp\.down_proj\.weight", self.writer),
        ]

    # ---- the rules -------------------------------------------------------------------------------------------
    def same(self, w: np.ndarray) -> np.ndarray:
        return w

    def norm(self, w: np.ndarray) -> np.ndarray:
        """gamma over D -> gamma repeated over each group of D' (commutes with Q: disjoint supports)."""
        return np.repeat(w, self.Dw // self.D)

    def _times_q(self, w: np.ndarray, v: np.ndarray) -> np.ndarray:
        """w[..., D] @ Q (scaled into v): [..., D'] (row i of Q only on its group: one product per element)."""
        return (w[..., :, None] * v).reshape(*w.shape[:-1], self.Dw)

    def reader(self, w: np.ndarray) -> np.ndarray:
        return self._times_q(w, self.v_read)                        # W Q / s

    def embed(self, w: np.ndarray) -> np.ndarray:
        return self._times_q(w, self.v_write)                       # s E Q

    def writer(self, w: np.ndarray) -> np.ndarray:
        return (self.v_write[:, :, None] * w[:, None, :]).reshape(self.Dw, w.shape[1])  # s Q^T W

    def gate_up(self, w: np.ndarray, key: str) -> np.ndarray:
        return np.repeat(self.reader(w), self.r[key], axis=0)

    def down(self, w: np.ndarray, key: str) -> np.ndarray:
        r = self.r[key]
        return self.writer(np.repeat(w / np.float32(r), r, axis=1))

    def fc(self, w: np.ndarray) -> np.ndarray:
        """fc reads k concatenated hidden vectors (blockdiag(Q, ..., Q) / s) and writes hidden (s Q^T)."""
        out_dim = w.shape[0]
        read = self._times_q(w.reshape(out_dim, self.k, self.D), self.v_read).reshape(out_dim, self.k * self.Dw)
        return self.writer(read)

    # ---- dispatch --------------------------------------------------------------------------------------------
    def widen(self, name: str, w: np.ndarray, drafter: bool) -> np.ndarray:
        rules = self.drafter_rules if drafter else self.target_rules
        for pattern, rule in rules:
            if re.fullmatch(pattern, name):
                return np.ascontiguousarray(rule(np.asarray(w, np.float32)), np.float32)
        raise CheckpointError(f"widen: no rule for {'drafter' if drafter else 'target'} tensor '{name}'; "
                              f"add one to kdtree/checkpoint/widen.py (what it reads and writes decides it)")


class WidenedWeights(Mapping):
    """The widened tensors of one checkpoint (target or drafter), each made when it is read (write_checkpoint
    writes one shard at a time); `peek` sizes a tensor without making it."""

    def __init__(self, widener: Widener, source: Mapping[str, np.ndarray], shapes: Dict[str, tuple], drafter: bool):
        self.widener, self.source, self.shapes, self.drafter = widener, source, dict(shapes), drafter

    def __getitem__(self, name: str) -> np.ndarray:
        w = self.widener.widen(name, self.source[name], self.drafter)
        if tuple(w.shape) != tuple(self.shapes[name]):
            raise CheckpointError(f"widen: '{name}' came out {tuple(w.shape)}, names.py wants {self.shapes[name]}")
        return w

    def peek(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _read_dir(d: Path) -> Dict[str, np.ndarray]:
    out: Dict[str, np.ndarray] = {}
    for f in sorted(d.glob("*.safetensors")):
        bad = [t.name for t in read_header(f).tensors.values() if t.dtype != "F32"]
        if bad:
            raise CheckpointError(f"{f}: widening reads float32 weights; '{bad[0]}' is not F32")
        out.update(read_file(f))
    return out


def _check_names(have: Mapping, want: Dict[str, tuple], label: str) -> None:
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise CheckpointError(f"widen: the {label} checkpoint has tensors {extra[:3]} unknown to names.py and lacks "
                              f"{missing[:3]}; it is not the architecture of its config")
    for k, shape in want.items():
        if tuple(have[k].shape) != tuple(shape):
            raise CheckpointError(f"widen: {label} tensor '{k}' is {tuple(have[k].shape)}, names.py wants {shape}")


def write_widened_checkpoint(directory, model_cfg, source_dir: Path, shard_bytes: int, drafter_dir: Path) -> Path:
    """Widen the trained target in `source_dir` and the drafter in `drafter_dir` (float32; tiny.trained_drafter picks
    the shipped one of model.drafter's block size) to `model_cfg`'s widths into `directory`: same bytes for the same
    config; at most one shard of widened tensors in memory."""
    from kdtree.checkpoint.loader import DRAFTER_DIR

    directory = Path(directory)
    dst = plain(model_cfg)
    src = source_config(model_cfg)
    widener = Widener(src, dst)
    src_ns, dst_ns = _ns(src), _ns(dst)
    if not (source_dir / INDEX_FILE).is_file() and not list(source_dir.glob("*.safetensors")):
        raise CheckpointError(f"widen: {source_dir} has no checkpoint to widen")
    target = _read_dir(source_dir)
    _check_names(target, names.target_tensor_shapes(src_ns), "target")
    write_checkpoint(directory, WidenedWeights(widener, target, names.target_tensor_shapes(dst_ns), False),
                     target_config_json(model_cfg), shard_bytes)
    del target
    drafter = _read_dir(Path(drafter_dir))
    _check_names(drafter, names.drafter_tensor_shapes(src_ns), "drafter")
    write_checkpoint(directory / DRAFTER_DIR, WidenedWeights(widener, drafter, names.drafter_tensor_shapes(dst_ns), True),
                     drafter_config_json(model_cfg), 0)
    return directory
