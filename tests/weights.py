"""Weight transforms tests share."""
from __future__ import annotations


def int4_experts(weights, group: int = 32):
    """`weights` with every routed expert's gate/up/down projection INT4-quantized (group `group`; the scales are
    bfloat16 values, so the weight holds their BF16 bits as the loader does); every other tensor unchanged."""
    from kdtree.quant import int4
    w = dict(weights)
    for name in list(w):
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            packed, scale, shape = int4.quantize_weight(w[name], group)
            w[name] = int4.Int4Weight(packed, int4.bf16_to_f32(scale), shape, group)
    return w
