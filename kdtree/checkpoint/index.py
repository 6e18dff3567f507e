"""A checkpoint directory in HF layout, opened: config.json, the shard index, every shard's header.

`open_checkpoint(dir)` reads `model.safetensors.index.json` (or a lone `model.safetensors`), parses
the header of each shard it names and returns where every tensor lives. Nothing here reads tensor
data; a missing shard, a corrupt header or data beyond a file's end fail here, before any big read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from kdtree.checkpoint.safetensors_io import FileHeader, TensorInfo, read_header
from kdtree.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass
class CheckpointIndex:
    path: Path                          # the checkpoint directory
    config: dict                        # its config.json ({} when absent)
    files: List[FileHeader]             # shards in index order
    tensors: Dict[str, TensorInfo]      # name -> where it lives
    total_size: int                     # metadata.total_size of the index, else the sum of tensor bytes

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_config(path) -> dict:
    """`<dir>/config.json` -> dict; {} when the directory has none."""
    f = Path(path) / CONFIG_FILE
    if not f.exists():
        return {}
    try:
        cfg = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}); fix or regenerate config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: expected a JSON object, got {type(cfg).__name__}; fix config.json")
    return cfg


def open_checkpoint(path) -> CheckpointIndex:
    """Read config.json, the index and every shard header of the checkpoint directory `path`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist; set model.path to a directory "
                              f"holding config.json and *.safetensors (or leave it empty for the tiny model)")
    index_file = path / INDEX_FILE
    if index_file.exists():
        try:
            index = json.loads(index_file.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file}: corrupt index ({e!r}); it needs a 'weight_map' object of "
                                  f"tensor name -> shard file; re-download it") from None
        names: List[str] = []
        for fname in weight_map.values():
            if fname not in names:
                names.append(fname)
        for fname in names:
            if not (path / fname).is_file():
                tensor = next(k for k, v in weight_map.items() if v == fname)
                raise CheckpointError(f"{index_file}: tensor '{tensor}' points at shard '{fname}', which does not "
                                      f"exist in {path}; re-download the missing shard or fix the index")
        files = [read_header(path / fname) for fname in names]
        by_name = {h.path.name: h for h in files}
        tensors: Dict[str, TensorInfo] = {}
        for tensor, fname in weight_map.items():
            hdr = by_name[fname]
            if tensor not in hdr.tensors:
                raise CheckpointError(f"{index_file}: tensor '{tensor}' is mapped to '{fname}' but that shard does "
                                      f"not hold it; re-download the shard or fix the index")
            tensors[tensor] = hdr.tensors[tensor]
        total = index.get("metadata", {}).get("total_size")
    elif (path / SINGLE_FILE).exists():
        files = [read_header(path / SINGLE_FILE)]
        tensors = dict(files[0].tensors)
        total = None
    else:
        raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found; this is not a safetensors "
                              f"checkpoint directory")
    data = sum(t.nbytes for t in tensors.values())
    return CheckpointIndex(path, read_config(path), files, tensors, int(total) if total else data)
