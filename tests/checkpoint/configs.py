"""Composed-like configs of the checkpoint tests: conf/model/<name>.yaml and conf/quant/<name>.yaml on their schemas."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from kdtree.config.schema import group_config

ROOT = Path(__file__).resolve().parents[2]


def model_cfg(name: str = "tiny", init: str = "random"):
    """The model config; tiny defaults to init=random here (checkpoint tests exercise the seeded generator)."""
    return OmegaConf.merge(group_config("model", name), {"init": init})


def quant_cfg(name: str = "fp32"):
    return group_config("quant", name)
