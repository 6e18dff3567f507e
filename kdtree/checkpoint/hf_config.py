"""config.json of a checkpoint: written from the composed config, and checked against it on load.

The target's config.json holds HF DeepseekV3 fields (every architecture field of ModelConfig); the
drafter's holds the DFlash fields. On load every field the file has must equal the composed config;
fields the file lacks are not checked (real checkpoints carry subsets), and shapes are checked
tensor by tensor anyway.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional

from kdtree.config.schema import DrafterConfig, ModelConfig
from kdtree.errors import CheckpointError

NOT_ARCH = ("name", "path", "tokenizer", "seed", "drafter", "int4_unquantized_dtype", "widen_from")
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in NOT_ARCH)
DRAFTER_FIELDS = tuple(f.name for f in dataclasses.fields(DrafterConfig))
# Fields every DeepseekV3/K2 config.json has: the shapes. A file without them is not this architecture's config.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def plain(cfg) -> Any:
    """A config node (OmegaConf, dataclass, namespace, dict) -> plain dicts/lists/scalars."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, dict):
        return {k: plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [plain(v) for v in cfg]
    if hasattr(cfg, "__dict__") and not isinstance(cfg, (str, int, float, bool)):
        return {k: plain(v) for k, v in vars(cfg).items()}
    return cfg


def target_config_json(model_cfg, quant_cfg=None) -> Dict[str, Any]:
    """HF DeepseekV3 config.json of the target (quantization_config is the quantizer's to add)."""
    m = plain(model_cfg)
    out: Dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
                           "torch_dtype": "float32"}
    out.update({k: m[k] for k in ARCH_FIELDS})
    return out


def drafter_config_json(model_cfg) -> Dict[str, Any]:
    """config.json of the DFlash drafter in `<checkpoint>/drafter/`."""
    m = plain(model_cfg)
    d = m["drafter"]
    out: Dict[str, Any] = {"architectures": ["DFlashDraftModel"], "model_type": "dflash",
                           "torch_dtype": "float32", "hidden_size": m["hidden_size"], "vocab_size": m["vocab_size"],
                           "mask_token_id": m["mask_token_id"]}
    out.update({k: d[k] for k in DRAFTER_FIELDS})
    out["dflash_config"] = {"mask_token_id": m["mask_token_id"], "target_layer_ids": d["target_layer_ids"],
                            "block_size": d["block_size"]}
    return out


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _compare(file, have: dict, want: dict, fields, label: str, prefix: str = "") -> None:
    for k in fields:
        if k not in have or k not in want:
            continue
        if isinstance(want[k], dict) and isinstance(have[k], dict):
            _compare(file, have[k], want[k], want[k].keys(), label, f"{prefix}{k}.")
        elif not _same(have[k], want[k]):
            raise CheckpointError(f"{file}: field {prefix}{k}={have[k]!r} but the composed config has "
                                  f"{label}.{prefix}{k}={want[k]!r}; choose the model config that matches this "
                                  f"checkpoint (or fix the override)")


def _group_size(qc: dict) -> Optional[int]:
    for group in (qc.get("config_groups") or {}).values():
        gs = (group.get("weights") or {}).get("group_size") if isinstance(group, dict) else None
        if gs is not None:
            return int(gs)
    return None


def check_target_config(file, have: dict, model_cfg, quant_cfg) -> None:
    """config.json of a target must agree with model=... and quant=... (names the field and both values)."""
    missing = [k for k in REQUIRED_FIELDS if k not in have]
    if missing:
        raise CheckpointError(f"{file}: no {', '.join(missing)} (a DeepseekV3/K2 config.json has them); this is "
                              f"not a K2-architecture checkpoint's config, or it was cut short")
    m = plain(model_cfg)
    _compare(file, have, m, ARCH_FIELDS, "model")
    q = plain(quant_cfg) if quant_cfg is not None else {"method": "fp32"}
    qc = have.get("quantization_config")
    if q["method"] == "int4_w4a16" and not qc:
        raise CheckpointError(f"{file}: no quantization_config (an unquantized checkpoint) but the composed config "
                              f"has quant.method=int4_w4a16; use quant=fp32")
    if q["method"] in ("fp32", "bf16") and qc:
        raise CheckpointError(f"{file}: quantization_config.format={qc.get('format')!r} (a quantized checkpoint) "
                              f"but the composed config has quant.method={q['method']}; use quant=int4_w4a16")
    if qc and _group_size(qc) not in (None, q.get("group_size")):
        raise CheckpointError(f"{file}: quantization_config group_size={_group_size(qc)} but the composed config "
                              f"has quant.group_size={q.get('group_size')}; set quant.group_size={_group_size(qc)}")


def check_drafter_config(file, have: dict, model_cfg) -> None:
    """config.json of a drafter must agree with model.drafter (and the target's dims it shares)."""
    m = plain(model_cfg)
    _compare(file, have, {k: m[k] for k in ("hidden_size", "vocab_size", "mask_token_id")},
             ("hidden_size", "vocab_size", "mask_token_id"), "model")
    _compare(file, have, m["drafter"], DRAFTER_FIELDS, "model.drafter")
    dflash = have.get("dflash_config") or {}
    _compare(file, dflash, {"mask_token_id": m["mask_token_id"]}, ("mask_token_id",), "model")
    _compare(file, dflash, m["drafter"], ("target_layer_ids", "block_size"), "model.drafter")
