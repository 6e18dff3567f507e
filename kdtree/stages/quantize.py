"""quantize: write the INT4-W4A16 (compressed-tensors pack-quantized) copy of an FP32 checkpoint.

    python -m kdtree.run pipeline=quantize quant=int4_w4a16                 # the embedded tiny model
    python -m kdtree.run pipeline=quantize quant=int4_w4a16 model=k26 model.path=/ckpt/fp32

src empty = model.path, and for the tiny model with an empty model.path its embedded FP32 checkpoint;
dst empty = <run_dir>/int4. Which Linear modules become INT4 is quant.targets / quant.ignore.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kdtree.checkpoint.quantize import quantize_checkpoint
from kdtree.checkpoint.tiny import ensure_tiny_checkpoint
from kdtree.config.schema import is_generated
from kdtree.errors import ConfigError

SIDE = "any"


@dataclass
class QuantizeConfig:
    dst: str = ""  # the INT4 checkpoint to write; empty = <run_dir>/int4 (the source is model.path)


CONFIG = QuantizeConfig  # cfg.quantize: this stage's options (kdtree/pipeline/registry.py)


def _source(cfg) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path).expanduser()
    if not is_generated(cfg.model.name):
        raise ConfigError(f"model.path is empty for model={cfg.model.name}; set model.path=/path/to/fp32-checkpoint "
                          f"or pass src= to the quantize stage")
    return Path(ensure_tiny_checkpoint(cfg.model, None, cfg.get("cache_dir", "")))   # None = the FP32 one


def run(ctx, conf: QuantizeConfig) -> dict:
    dst = conf.dst
    cfg = ctx.cfg
    if cfg.quant.method != "int4_w4a16":
        raise ConfigError(f"pipeline=quantize with quant={cfg.quant.method} has nothing to do; add quant=int4_w4a16")
    src_path = _source(cfg)
    dst_path = Path(dst).expanduser() if dst else Path(ctx.run_dir) / "int4"
    summary = quantize_checkpoint(src_path, dst_path, cfg.quant)
    ratio = summary["dst_bytes"] / max(summary["src_bytes"], 1)
    ctx.emit("quantized", src=str(src_path), dst=str(dst_path), modules=summary["quantized_modules"],
             src_bytes=summary["src_bytes"], dst_bytes=summary["dst_bytes"], ratio=round(ratio, 4))
    print(f"quantized {summary['quantized_modules']} Linear modules of {src_path} -> {dst_path} "
          f"({summary['src_bytes'] / 1e6:.1f} MB -> {summary['dst_bytes'] / 1e6:.1f} MB, x{ratio:.3f})")
    return {**summary, "src": str(src_path)}
