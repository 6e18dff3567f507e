"""Composed-like configs of the checkpoint tests: conf/model/<name>.yaml and conf/quant/<name>.yaml on their schemas."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from kdtree.config.schema import ModelConfig, QuantConfig

ROOT = Path(__file__).resolve().parents[2]


def model_cfg(name: str = "tiny", init: str = "random"):
    """The model config; tiny defaults to init=random here (checkpoint tests exercise the seeded generator)."""
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / f"conf/model/{name}.yaml"),
                           {"init": init})


def quant_cfg(name: str = "fp32"):
    return OmegaConf.merge(OmegaConf.structured(QuantConfig), OmegaConf.load(ROOT / f"conf/quant/{name}.yaml"))


def int4_available() -> bool:
    try:
        from kdtree.checkpoint.tiny import _quantizer
        from kdtree.quant.int4 import Int4Weight  # noqa: F401

        _quantizer()
        return True
    except ImportError:
        return False
