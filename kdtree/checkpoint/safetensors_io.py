"""The safetensors file format, read and written by hand: 8-byte header length, JSON header, raw data.

A file is `u64 little-endian N` + `N bytes of JSON` + data; the JSON maps each tensor name to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the first data byte) plus an
optional `__metadata__` dict of strings. Reading the header ourselves lets the loader plan large
sequential preads straight into final numpy buffers; writing it ourselves keeps files byte-for-byte
deterministic and lets bf16 be written from numpy (which has no bf16 dtype: its bits travel as uint16).
Files written here load in the `safetensors` package (checked in tests/checkpoint).
"""
from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from kdtree.aligned import LINE
from kdtree.bf16 import f32_to_bf16
from kdtree.errors import CheckpointError

# safetensors dtype string -> numpy storage dtype (BF16 is stored as its raw uint16 bits)
DTYPES: Dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NUMPY_TO_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
                np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
                np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors package's own limit


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range [start, end) in `path`."""
    name: str
    path: Path
    dtype: str            # safetensors dtype string ("F32", "BF16", "I32", ...)
    shape: Tuple[int, ...]
    start: int            # absolute file offset of the first byte
    end: int              # absolute file offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def storage(self) -> np.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class FileHeader:
    path: Path
    file_size: int
    data_start: int                   # 8 + header length
    tensors: Dict[str, TensorInfo]    # in data-offset order
    metadata: Dict[str, str]


def read_header(path) -> FileHeader:
    """Parse and validate the header of one safetensors file (no tensor data is read)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors file, only {size} bytes (a header needs 8); "
                                      f"re-download or regenerate this shard")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file, header length {n} bytes "
                                      f"is beyond the file size {size} bytes; re-download or regenerate this shard")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file does not exist; re-download the checkpoint or fix its "
                              f"model.safetensors.index.json") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e}); "
                              f"re-download or regenerate this shard") from None
    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    tensors = []
    for name, entry in header.items():
        try:
            dtype, shape = entry["dtype"], tuple(int(s) for s in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header, tensor '{name}' entry {entry!r} lacks "
                                  f"dtype/shape/data_offsets; re-download or regenerate this shard") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {dtype!r} (known: "
                                  f"{', '.join(DTYPES)}); re-download or regenerate this shard")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if begin < 0 or end < begin or end - begin != want:
            raise CheckpointError(f"{path}: corrupt safetensors header, tensor '{name}' data_offsets "
                                  f"[{begin}, {end}] hold {end - begin} bytes but {dtype}{list(shape)} needs "
                                  f"{want}; re-download or regenerate this shard")
        if data_start + end > size:
            raise CheckpointError(f"{path}: truncated shard, tensor '{name}' ends at byte {data_start + end} but "
                                  f"the file has {size} bytes; re-download or regenerate this shard")
        tensors.append(TensorInfo(name, path, dtype, shape, data_start + begin, data_start + end))
    tensors.sort(key=lambda t: t.start)
    return FileHeader(path, size, data_start, {t.name: t for t in tensors}, dict(metadata))


def _as_numpy(value, dtype: Optional[str]) -> Tuple[np.ndarray, str]:
    """A tensor to write -> (little-endian contiguous storage array, safetensors dtype)."""
    if type(value).__module__.startswith("torch"):  # torch tensors: bf16 travels as its bits
        import torch

        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            value, dtype = t.view(torch.int16).numpy().view(np.uint16), dtype or "BF16"
        else:
            value = t.numpy()
    arr = np.asarray(value)
    if dtype is None:
        if arr.dtype not in _NUMPY_TO_ST:
            raise TypeError(f"cannot write numpy dtype {arr.dtype} to safetensors")
        dtype = _NUMPY_TO_ST[arr.dtype]
    if dtype == "BF16" and arr.dtype != np.uint16:
        arr = f32_to_bf16(arr.astype(np.float32))
    elif dtype != "BF16":
        arr = arr.astype(DTYPES[dtype], copy=False)
    return np.ascontiguousarray(arr).astype(DTYPES[dtype].newbyteorder("<"), copy=False), dtype


def write_file(path, tensors: Mapping[str, object], dtypes: Optional[Mapping[str, str]] = None,
               metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write one safetensors file; returns its tensor-data bytes.

    `dtypes` optionally maps a name to a safetensors dtype ("BF16", "F16", ...): float arrays are
    converted, uint16 arrays given as "BF16" are taken as raw bits. Tensors are laid out by storage
    size descending (stable), like the safetensors package, so every tensor stays aligned to its element -- and,
    beyond the package, on a 64-byte cache line wherever the file allows it: the data starts on a line (the header
    padded) and the tensors whose size is a whole number of lines come first, so a mapped weight's rows start on
    lines as the native kernels read them (the format has no holes: the rest follow, element-aligned).
    """
    dtypes = dtypes or {}
    arrays = {name: _as_numpy(v, dtypes.get(name)) for name, v in tensors.items()}
    order = sorted(arrays, key=lambda k: (arrays[k][0].nbytes % LINE != 0,   # stable: keeps the given order
                                          -DTYPES[arrays[k][1]].itemsize))
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        arr, dt = arrays[name]
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % LINE)  # pad so the data starts on a cache line (8-byte aligned, as required)
    # a new file renamed over the old one: an engine that maps the old file keeps its (unlinked) pages
    # instead of seeing it truncated under it (SIGBUS)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name in order:
                arr = arrays[name][0]
                if arr.nbytes:
                    f.write(memoryview(arr.reshape(-1)).cast("B"))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return offset


def read_file(path) -> Dict[str, np.ndarray]:
    """Whole file -> {name: storage array} (BF16 as uint16 bits). For small files and tests."""
    hdr = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for t in hdr.tensors.values():
            buf = np.empty(t.shape, t.storage)
            n = os.preadv(f.fileno(), [memoryview(buf.reshape(-1)).cast("B")], t.start) if t.nbytes else 0
            if n != t.nbytes:
                raise CheckpointError(f"{path}: truncated shard while reading tensor '{t.name}'; re-download it")
            out[t.name] = buf
    return out
