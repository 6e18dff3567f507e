"""Tensor-parallel sharding plan: which slice of each K2 tensor rank r of tp reads (the rules below).

    shard = shard_fn(cfg.model, rank=3, tp=8)            # load_checkpoint(..., shard=shard) reads only these bytes
    shard("model.layers.0.self_attn.q_b_proj.weight", (H * 24, 64)) -> (slice(3*H/8*24, 4*H/8*24), slice(None))
    bytes_per_rank(cfg.model, cfg.quant, tp=8, float_bytes=2)    # bytes one rank reads (plan / ETA)

Column-parallel (split the OUTPUT rows of the weight, no communication after):
  q_b_proj   [H*(nope+rope), q_lora]  rows, one block of H/tp heads (each head a [nope+rope] row block)
  kv_b_proj  [H*(nope+v), kv_lora]    rows, the same heads (each head a [nope+v] row block: W_uk then W_uv)
  gate_proj, up_proj [I, D]           rows, I/tp of the intermediate dim (dense MLP, shared and routed experts)
Row-parallel (split the INPUT columns; the partial outputs are summed by the all-reduce K2Model applies):
  o_proj     [D, H*v]                 columns, the same heads' v blocks
  down_proj  [D, I]                   columns, the same I/tp slice as gate/up
Replicated (every rank reads the whole tensor):
  q_a_proj, kv_a_proj_with_mqa and all norms: small, and the latent cache they produce is the same on every
    rank (each rank keeps a full latent cache for its own heads' absorbed attention);
  router gate + e_score_correction_bias: every rank routes every token itself (no routing broadcast);
  embed_tokens, lm_head: 2 x V x D, small next to the experts (K2.6: 2 x 1.2 G of ~1 T params), and rank 0
    needs the full logits row for greedy tree accept and the drafter (which shares both). A vocab split of
    lm_head (+ all-gather of logits to rank 0) is a future option for k26 that would save 2.3 GB per rank.
INT4 (compressed-tensors pack-quantized) modules are planned on their logical [out, in] weight; the loader maps
a row slice onto weight_packed [out, in/8] and weight_scale [out, in/group] unchanged and a column slice onto
packed columns /8 and scale columns /group, so column splits (down_proj of routed experts, the only INT4
row-parallel weight in K2) must fall on group boundaries: validate_tp checks moe_intermediate_size/tp % group.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Optional, Tuple

from kdtree.errors import ConfigError
from kdtree.model import names
from kdtree.quant.int4 import module_is_quantized

ROWS, COLS = 0, 1   # the axis of a [out, in] weight that is split

_SPLITS = (  # (pattern on the tensor name, axis, what one block of the axis is)
    (re.compile(r"model\.layers\.\d+\.self_attn\.q_b_proj\.weight$"), ROWS, "q_head"),
    (re.compile(r"model\.layers\.\d+\.self_attn\.kv_b_proj\.weight$"), ROWS, "kv_head"),
    (re.compile(r"model\.layers\.\d+\.self_attn\.o_proj\.weight$"), COLS, "v_head"),
    (re.compile(r"model\.layers\.\d+\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up)_proj\.weight$"), ROWS, "inter"),
    (re.compile(r"model\.layers\.\d+\.mlp\.(experts\.\d+\.|shared_experts\.)?down_proj\.weight$"), COLS, "inter"),
)


def split_axis(name: str) -> Optional[Tuple[int, str]]:
    """(axis, block kind) of a split target tensor, or None when every rank reads all of it."""
    for pattern, axis, block in _SPLITS:
        if pattern.match(name):
            return axis, block
    return None


def _block_size(cfg, block: str) -> int:
    """Rows/columns of one indivisible unit of the split axis (a head, or one intermediate channel)."""
    return {"q_head": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            "kv_head": cfg.qk_nope_head_dim + cfg.v_head_dim,
            "v_head": cfg.v_head_dim,
            "inter": 1}[block]


def shard_slices(cfg, name: str, shape: Tuple[int, ...], rank: int, tp: int) -> Optional[Tuple[slice, ...]]:
    """The slice of tensor `name` [shape] that rank `rank` of `tp` reads, or None = the whole tensor."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} outside 0..{tp - 1} (tp={tp})")
    split = split_axis(name) if tp > 1 else None
    if split is None:
        return None
    axis, block = split
    n, unit = int(shape[axis]), _block_size(cfg, block)
    if n % (unit * tp):
        raise ConfigError(f"tp={tp} cannot split tensor {name} {list(shape)} on axis {axis} into whole "
                          f"{block} blocks of {unit}; use a tp that divides {n // unit} (model={cfg.name})")
    per = n // tp
    sl = [slice(None)] * len(shape)
    sl[axis] = slice(rank * per, (rank + 1) * per)
    return tuple(sl)


def shard_fn(cfg, rank: int, tp: int) -> Callable[[str, Tuple[int, ...]], Optional[Tuple[slice, ...]]]:
    """`shard(name, shape)` for kdtree.checkpoint.loader.load_checkpoint: rank `rank`'s slices."""
    return lambda name, shape: shard_slices(cfg, name, tuple(shape), rank, tp)


def bytes_per_rank(cfg, quant_cfg, tp: int, float_bytes: int = 2) -> int:
    """Tensor-data bytes one rank reads from the target checkpoint (the same for every rank; drafter excluded).

    float_bytes: bytes per element of unquantized tensors as stored (2 = bf16 as Kimi ships K2, 4 = float32 as
    the embedded tiny checkpoint). INT4 modules: weight_packed int32 [out, in/8], weight_scale bf16
    [out, in/group], weight_shape int32 [2] (read whole by every rank). tp=1 gives the whole target.
    """
    group = int(quant_cfg.group_size) if quant_cfg is not None else 32
    linear = names.target_linear_shapes(cfg)
    total = 0
    for name, shape in names.target_tensor_shapes(cfg).items():
        sl = shard_slices(cfg, name, shape, 0, tp)
        part = tuple(shape) if sl is None else tuple(len(range(*s.indices(n))) for s, n in zip(sl, shape))
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if quant_cfg is not None and module in linear and module_is_quantized(module, quant_cfg):
            rows, cols = part
            total += rows * math.ceil(cols / 8) * 4 + rows * math.ceil(cols / group) * 2 + 2 * 4
        else:
            total += math.prod(part) * float_bytes
    return total
