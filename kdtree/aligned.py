"""Cache-line aligned numpy arrays. numpy's large allocations start 16 bytes past a 64-byte line (glibc's mmap
chunk header), so a weight row read 64 bytes at a time straddles two lines on every load: the native multi-row
kernels ran 1.1-1.3x slower on such rows at 9-33 rows (2048x7168, float32 and BF16; docs/measurements.md).
Low level: imports nothing from kdtree.
"""
from __future__ import annotations

import numpy as np

LINE = 64   # bytes


def aligned_empty(shape, dtype, align: int = LINE) -> np.ndarray:
    """np.empty(shape, dtype) whose data starts on an `align`-byte boundary (a view into a slightly larger
    buffer; the buffer is freed with the last view)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(n + align, np.uint8)
    start = -buf.ctypes.data % align
    return buf[start:start + n].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray, dtype=None) -> np.ndarray:
    """`a` copied (converted to `dtype`, default its own) into a fresh line-aligned C-contiguous array."""
    out = aligned_empty(a.shape, dtype or a.dtype)
    np.copyto(out, a, casting="unsafe" if dtype is not None else "no")
    return out
