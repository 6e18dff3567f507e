"""Write a checkpoint directory in HF layout: config.json + shards + model.safetensors.index.json.

Shards are filled in the given tensor order and a new one starts when the next tensor would push the
current one past `max_shard_bytes` (a tensor bigger than that gets a shard of its own), named
`model-0000N-of-0000M.safetensors` like HF. `max_shard_bytes=0` writes one `model.safetensors` and no
index (the layout of the drafter directory). Output bytes depend only on the inputs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import numpy as np

from kdtree.checkpoint.index import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from kdtree.checkpoint.safetensors_io import DTYPES, write_file


def _nbytes(value, dtype: Optional[str]) -> int:
    n = int(np.prod(value.shape, dtype=np.int64))
    if dtype:
        return n * DTYPES[dtype].itemsize
    return n * value.element_size() if hasattr(value, "element_size") else n * np.asarray(value).itemsize


def write_config(directory, config_json: Mapping) -> None:
    (Path(directory) / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")


def write_checkpoint(directory, tensors: Mapping[str, object], config_json: Mapping, max_shard_bytes: int,
                     dtypes: Optional[Mapping[str, str]] = None) -> Path:
    """Write `tensors` (name -> ndarray, or torch tensor) and `config_json` into `directory` (created).

    dtypes: optional name -> safetensors dtype on disk ("BF16", "F16", ...); default = the array's own.
    A mapping with `peek(name)` (an array of the right shape and dtype, e.g. zero-strided) is read one shard at
    a time: tensors generated on access are never all in memory at once.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtypes = dict(dtypes or {})
    write_config(directory, config_json)
    meta = {"format": "pt"}
    if not max_shard_bytes:
        write_file(directory / SINGLE_FILE, tensors, dtypes, meta)
        return directory
    shards: List[List[str]] = [[]]
    used = 0
    peek = getattr(tensors, "peek", tensors.__getitem__)  # a lazy mapping sizes a tensor without making it
    for name in tensors:
        n = _nbytes(peek(name), dtypes.get(name))
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    weight_map: Dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_file(directory / fname, {k: tensors[k] for k in names}, dtypes, meta)
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return directory
