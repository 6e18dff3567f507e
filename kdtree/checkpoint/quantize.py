"""Quantize an FP32 HF checkpoint directory into the INT4-W4A16 compressed-tensors layout.

    summary = quantize_checkpoint(src_dir, dst_dir, quant_cfg)      # quant_cfg.method == "int4_w4a16"

Per source shard, one destination shard of the same file name (same sharding scheme): each Linear
`<m>.weight` that `module_is_quantized(m)` becomes `<m>.weight_packed` I32, `<m>.weight_scale` BF16 and
`<m>.weight_shape` I32 in that shard; every other tensor is copied with its dtype and bytes unchanged.
Then a new index (weight_map + metadata.total_size = tensor-data bytes), config.json + quantization_config,
and everything else in the directory (drafter/, tokenizer files) copied unchanged - the drafter stays FP32.

Linear modules come from kdtree.model.names.target_linear_shapes over the source config.json (or the
given model config). The result is written into a temporary sibling directory and renamed into place, so
dst is either absent or complete; concurrent callers (tp ranks) racing on the same dst all end up with it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Dict

import numpy as np

from kdtree.model import names
from kdtree.checkpoint.hf_config import plain
from kdtree.checkpoint.index import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, open_checkpoint
from kdtree.checkpoint.safetensors_io import read_file, write_file
from kdtree.checkpoint.writer import write_config
from kdtree.errors import CheckpointError, ConfigError
from kdtree.bf16 import bf16_to_f32
from kdtree.quant.int4 import module_is_quantized, quantization_config_json, quantize_weight

_META = {"format": "pt"}    # what HF transformers expects in a shard's __metadata__


def _linear_shapes(config: dict, model_cfg, src: Path) -> Dict[str, tuple]:
    if model_cfg is not None:
        return names.target_linear_shapes(SimpleNamespace(**plain(model_cfg)))
    fields = dict(first_k_dense_replace=0, moe_layer_freq=1, n_shared_experts=0)
    fields.update(config)
    try:
        return names.target_linear_shapes(SimpleNamespace(**fields))
    except AttributeError as e:
        raise CheckpointError(f"{src / CONFIG_FILE}: lacks {e.name!r}, needed to find the Linear modules; "
                              f"fix config.json or pass the model config") from None


def quantize_checkpoint(src_dir, dst_dir, quant_cfg, model_cfg=None, overwrite: bool = False) -> dict:
    """FP32 checkpoint `src_dir` -> INT4 checkpoint `dst_dir`; returns a summary (counts and bytes)."""
    src, dst = Path(src_dir).expanduser(), Path(dst_dir).expanduser()
    quant = plain(quant_cfg)
    qconf = quantization_config_json(quant)                              # ConfigError unless int4_w4a16
    group = int(quant["group_size"])
    idx = open_checkpoint(src)
    if not idx.config:
        raise CheckpointError(f"{src}: no config.json; the quantizer needs it to find the Linear modules")
    if idx.config.get("quantization_config"):
        raise CheckpointError(f"{src / CONFIG_FILE}: already quantized (quantization_config.format="
                              f"{idx.config['quantization_config'].get('format')!r}); quantize an FP32 checkpoint")
    if src.resolve() == dst.resolve():
        raise ConfigError(f"quantize dst={dst} is the source checkpoint; choose another directory")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{dst}: already exists and is not empty; remove it or choose another dst")
        shutil.rmtree(dst)
    linear = _linear_shapes(idx.config, model_cfg, src)

    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    summary = dict(dst=str(dst), quantized_modules=0, kept_tensors=0, shards=len(idx.files),
                   src_bytes=idx.data_bytes, dst_bytes=0)
    try:
        weight_map: Dict[str, str] = {}
        for hdr in idx.files:
            tensors = read_file(hdr.path)                                 # name -> storage array (BF16 as bits)
            out: Dict[str, np.ndarray] = {}
            dtypes: Dict[str, str] = {}
            for name, info in hdr.tensors.items():
                if name not in idx.tensors or idx.tensors[name].path != hdr.path:
                    continue                                              # not in the index: not part of it
                module = name[: -len(".weight")] if name.endswith(".weight") else None
                if module in linear and module_is_quantized(module, quant):
                    if tuple(info.shape) != tuple(linear[module]):
                        raise CheckpointError(f"{hdr.path}: tensor '{name}' is {list(info.shape)} but config.json "
                                              f"implies {list(linear[module])}; fix the checkpoint or its config")
                    w = tensors[name]
                    w = bf16_to_f32(w) if info.dtype == "BF16" else w.astype(np.float32)
                    packed, scale, shape = quantize_weight(w, group, name=f"{name} in {hdr.path}")
                    out[f"{module}.weight_packed"] = packed               # I32 [out, ceil(in/8)]
                    out[f"{module}.weight_scale"] = scale                 # BF16 bits [out, in/group]
                    out[f"{module}.weight_shape"] = shape                 # I32 [2]
                    dtypes[f"{module}.weight_scale"] = "BF16"
                    summary["quantized_modules"] += 1
                else:
                    out[name] = tensors[name]                             # unchanged dtype and bytes
                    dtypes[name] = info.dtype
                    summary["kept_tensors"] += 1
            del tensors
            summary["dst_bytes"] += write_file(tmp / hdr.path.name, out, dtypes, hdr.metadata or _META)
            weight_map.update({k: hdr.path.name for k in out})
        if (src / INDEX_FILE).exists():
            index = {"metadata": {"total_size": summary["dst_bytes"]}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = dict(idx.config)
        config["quantization_config"] = qconf
        write_config(tmp, config)
        shard_files = {h.path.name for h in idx.files} | {INDEX_FILE, CONFIG_FILE, SINGLE_FILE}
        for entry in sorted(src.iterdir()):                               # drafter/, tokenizer, generation config
            if entry.name in shard_files:
                continue
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)
        try:
            if dst.is_dir():
                dst.rmdir()                                               # empty (checked above)
            os.rename(tmp, dst)
        except OSError:
            if not (dst / CONFIG_FILE).exists():                          # not another rank's finished copy
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary
