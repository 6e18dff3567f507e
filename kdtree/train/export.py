"""Write the trained tiny model as the embedded checkpoint: HF layout target + drafter/ + TRAINING.md.

Uses the checkpoint writer (kdtree/checkpoint/writer.py) and config.json builders (hf_config.py), so
the directory loads with kdtree.checkpoint.loader like any checkpoint. Provenance (corpus files and
hashes), the training arguments and the loss/acceptance histories go to TRAINING.md and training.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional

import numpy as np

from kdtree.checkpoint.hf_config import drafter_config_json, target_config_json
from kdtree.checkpoint.names import drafter_tensor_shapes, target_tensor_shapes
from kdtree.checkpoint.writer import write_checkpoint

SHARD_BYTES = 4 * 2 ** 20   # the same shard size as the generated tiny checkpoint


def _check(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple], what: str) -> Dict[str, np.ndarray]:
    out = {}
    for name, shape in shapes.items():
        if name not in tensors or tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{what}: tensor {name} missing or not of shape {list(shape)}")
        out[name] = np.ascontiguousarray(tensors[name], np.float32)
    return out


def write_assets(cfg, target: Mapping[str, np.ndarray], drafter: Mapping[str, np.ndarray], out: Path,
                 info: Optional[dict] = None, training_md: str = "") -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + list((out / "drafter").glob("*.safetensors")):
        old.unlink()
    write_checkpoint(out, _check(target, target_tensor_shapes(cfg), "target"), target_config_json(cfg), SHARD_BYTES)
    write_checkpoint(out / "drafter", _check(drafter, drafter_tensor_shapes(cfg), "drafter"), drafter_config_json(cfg), 0)
    if info is not None:
        (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    if training_md:
        (out / "TRAINING.md").write_text(training_md)
    return out


def export_assets(cfg, work: Path, out: Path) -> Path:
    """From a `python -m kdtree.train.run` work dir (target/drafter .safetensors + .json)."""
    from kdtree.train.run import load_tensors

    work = Path(work)
    t = json.loads((work / "target.json").read_text())
    d = json.loads((work / "drafter.json").read_text())
    ev = json.loads((work / "eval.json").read_text()) if (work / "eval.json").exists() else None
    info = {"target": t, "drafter": d, "eval": ev}
    return write_assets(cfg, load_tensors(work / "target.safetensors"), load_tensors(work / "drafter.safetensors"),
                        out, info)
