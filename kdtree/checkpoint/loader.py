"""Load a checkpoint's tensors into memory: validated against names.py, read with large parallel reads.

    weights, stats = load_checkpoint(path, model_cfg, quant_cfg, threads=4)   # target
    drafter, stats = load_drafter(path, model_cfg)                              # <path>/drafter

Validation happens before any tensor byte is read: config.json vs the composed config, every tensor
expected by names.py present with its shape and a dtype we can load, nothing unexpected, every shard
header sane. Then the byte ranges of all tensors are sorted by file offset, merged where adjacent and
cut into chunks of `chunk_mb` (32 MiB) that `threads` threads work through (progress once per chunk):

strategy="mmap" (the default): every shard is mapped read-only; a chunk is made resident with
posix_fadvise(WILLNEED) (large asynchronous reads) + madvise(MADV_POPULATE_READ) (waits for them, maps
the pages). Tensors are then views of the page cache: no copy, no second copy of the weights in memory
(the page cache is the final buffer), pages shared by every process mapping the file (TP ranks on one
host). Only what must change is copied: bf16/fp16 widened to float32, column slices gathered. The
arrays are read-only; do not rewrite a shard in place while an engine maps it (replace it by rename).
strategy="eager": every tensor gets its own buffer (one np.empty arena per shard) and each chunk is one
`os.preadv` scattering the bytes straight into the final buffers (bf16/fp16 land in the first half of
their float32 buffer and are widened in place by the thread that completes the tensor).
raw=True keeps every tensor as stored (BF16 as uint16 bits, INT4 modules as their three parts).
bf16=True keeps every BF16 tensor outside INT4 modules as its uint16 bits (mmap: a zero-copy view), INT4 still
assembled (its BF16 scales widened to float32): what backend=cpu's native forward takes (it widens BF16 exactly
in its kernels), half the bytes of the widened copy.

`shard(name, shape) -> tuple of slices | None` selects part of a tensor (tensor parallelism): row
slices are one contiguous byte range, column slices one range per row; only those bytes are read
(mmap: the pages holding them; ranges less than 64 KiB apart are read as one).
A Linear stored as `<m>.weight_packed/_scale/_shape` loads as an Int4Weight whatever the quant config
says (config.json's quantization_config must still agree with quant=); one stored as `<m>.weight` loads
as float32. INT4 modules are offered to `shard` once, as `<module>.weight` with the logical [out, in]
shape; the slice is mapped onto weight_packed (8 values per int32) and weight_scale (one per group).

Rates are MB/s with MB = 10^6 bytes.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import math
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from kdtree.aligned import aligned_copy, aligned_empty
from kdtree.model import names
from kdtree.checkpoint.hf_config import check_drafter_config, check_target_config, plain
from kdtree.checkpoint.index import CONFIG_FILE, INDEX_FILE, CheckpointIndex, open_checkpoint
from kdtree.bf16 import bf16_to_f32
from kdtree.checkpoint.safetensors_io import FLOAT_DTYPES, TensorInfo
from kdtree.errors import CheckpointError
from kdtree.quant.int4 import Int4Weight

ShardFn = Callable[[str, Tuple[int, ...]], Optional[Tuple[slice, ...]]]
ProgressFn = Callable[[int, int, int, int], None]
MB = 1e6
DRAFTER_DIR = "drafter"
_IOV_MAX = 512          # iovecs per preadv (Linux allows 1024)


@dataclass
class ShardStats:
    file: str
    bytes_read: int
    seconds: float      # first read started -> last read finished, in this file
    mb_s: float


@dataclass
class LoadStats:
    bytes_read: int             # bytes actually read from the files (sliced reads count only their slices)
    bytes_total: int            # tensor-data bytes of the whole checkpoint
    seconds: float
    mb_s: float
    strategy: str
    threads: int
    tensors: int
    shards: List[ShardStats] = field(default_factory=list)


# ---------------------------------------------------------------- what the checkpoint must hold

@dataclass
class _Want:
    disk: str                       # tensor name in the file
    shape: Tuple[int, ...]
    dtypes: Tuple[str, ...]
    module: Optional[str] = None    # INT4 module this part belongs to
    part: str = ""                  # "packed" | "scale" | "shape" for INT4 parts


def _expected(idx: CheckpointIndex, cfg, quant_cfg, drafter: bool) -> List[_Want]:
    shapes = names.drafter_tensor_shapes(cfg) if drafter else names.target_tensor_shapes(cfg)
    linear = names.drafter_linear_shapes(cfg) if drafter else names.target_linear_shapes(cfg)
    group = int(plain(quant_cfg)["group_size"]) if quant_cfg is not None else 32
    out: List[_Want] = []
    for name, shape in shapes.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in linear and f"{module}.weight_packed" in idx.tensors:
            o, i = linear[module]
            out.append(_Want(f"{module}.weight_packed", (o, math.ceil(i / 8)), ("I32",), module, "packed"))
            out.append(_Want(f"{module}.weight_scale", (o, math.ceil(i / group)), FLOAT_DTYPES, module, "scale"))
            out.append(_Want(f"{module}.weight_shape", (2,), ("I32", "I64"), module, "shape"))
        else:
            out.append(_Want(name, tuple(shape), FLOAT_DTYPES))
    return out


def _validate(idx: CheckpointIndex, wants: List[_Want], label: str) -> None:
    where = idx.path / INDEX_FILE if (idx.path / INDEX_FILE).exists() else idx.path
    missing = [w for w in wants if w.disk not in idx.tensors]
    if missing:
        w = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: tensor '{w.disk}' {list(w.shape)} is missing{more}, expected by {label}; "
                              f"use the model/quant config this checkpoint was made for, or regenerate it")
    wanted = {w.disk for w in wants}
    extra_layers = int(idx.config.get("num_nextn_predict_layers") or 0)
    n_layers = idx.config.get("num_hidden_layers")

    def tolerated(name: str) -> bool:  # MTP layers after the last decoder layer are not used
        parts = name.split(".")
        if not extra_layers or n_layers is None or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return False
        return int(parts[2]) >= int(n_layers)

    unexpected = [t for t in idx.tensors.values() if t.name not in wanted and not tolerated(t.name)]
    if unexpected:
        t = unexpected[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{t.path}: unexpected tensor '{t.name}'{more}, not part of {label}; use the "
                              f"model config this checkpoint was made for, or regenerate it")
    for w in wants:
        t = idx.tensors[w.disk]
        if t.shape != w.shape:
            raise CheckpointError(f"{t.path}: tensor '{t.name}' has shape {list(t.shape)} but {label} expects "
                                  f"{list(w.shape)}; use the model config this checkpoint was made for, "
                                  f"or regenerate it")
        if t.dtype not in w.dtypes:
            raise CheckpointError(f"{t.path}: tensor '{t.name}' has dtype {t.dtype} but {label} expects "
                                  f"{' or '.join(w.dtypes)}; re-export the checkpoint with a supported dtype")


def _checked(path: Path, cfg, quant_cfg, drafter: bool) -> Tuple[CheckpointIndex, List[_Want]]:
    """config.json against the composed config, then every tensor's name, shape and dtype: headers only."""
    idx = open_checkpoint(path)
    m = plain(cfg)
    if drafter:
        check_drafter_config(idx.path / CONFIG_FILE, idx.config, cfg)
        label = f"the drafter of model={m.get('name')}"
    else:
        check_target_config(idx.path / CONFIG_FILE, idx.config, cfg, quant_cfg)
        qm = plain(quant_cfg)["method"] if quant_cfg is not None else "fp32"
        label = f"model={m.get('name')} quant={qm}"
    wants = _expected(idx, cfg, quant_cfg, drafter)
    _validate(idx, wants, label)
    return idx, wants


def check_checkpoint(path, model_cfg, quant_cfg, drafter: bool = True) -> None:
    """Every check that needs no weight byte, for the target and (drafter=True) the drafter in `<path>/drafter`:
    config.json against model=/quant= (quantization_config included), tensor names, shapes and dtypes.
    The engine calls it before loading, so a wrong drafter is reported in seconds, not after the target's load."""
    _checked(Path(path), model_cfg, quant_cfg, False)
    if drafter:
        _checked(Path(path) / DRAFTER_DIR, model_cfg, quant_cfg, True)


# ---------------------------------------------------------------- slices -> byte ranges

def _norm_slices(name: str, shape: Tuple[int, ...], slices) -> Optional[Tuple[Tuple[int, int], ...]]:
    """User slices -> ((start, stop) per dim), or None for the whole tensor."""
    if slices is None:
        return None
    slices = tuple(slices) + (slice(None),) * (len(shape) - len(slices))
    if len(slices) != len(shape):
        raise ValueError(f"shard() returned {len(slices)} slices for tensor '{name}' of shape {list(shape)}")
    out = []
    for s, n in zip(slices, shape):
        start, stop, step = s.indices(n)
        if step != 1 or stop < start:
            raise ValueError(f"shard() returned {s} for tensor '{name}' {list(shape)}; only step-1 slices read")
        out.append((start, stop))
    return tuple(out)


def _runs(info: TensorInfo, sl: Optional[Tuple[Tuple[int, int], ...]]) -> Tuple[Tuple[int, ...], List[int], int]:
    """(output shape, absolute file offset of each contiguous run, bytes per run); runs fill the output in order."""
    shape, item = info.shape, info.storage.itemsize
    if sl is None or all(a == 0 and b == n for (a, b), n in zip(sl, shape)):
        return shape, [info.start], info.nbytes
    out_shape = tuple(b - a for a, b in sl)
    if 0 in out_shape:
        return out_shape, [], 0
    strides = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]  # elements
    last = max(i for i, ((a, b), n) in enumerate(zip(sl, shape)) if (a, b) != (0, n))
    run = (sl[last][1] - sl[last][0]) * strides[last] * item
    base = info.start + sl[last][0] * strides[last] * item
    offsets = [base]
    for i in range(last - 1, -1, -1):  # outer dims: every index in their slice, C order
        idx = np.arange(sl[i][0], sl[i][1], dtype=np.int64) * strides[i] * item
        offsets = (idx[:, None] + np.asarray(offsets, dtype=np.int64)[None, :]).reshape(-1).tolist()
    return out_shape, offsets, run


# ---------------------------------------------------------------- reading

_WIDEN_BLOCK = 1 << 18             # elements per in-place widening step (1 MiB of float32: stays in cache)


@dataclass
class _Job:
    """One on-disk tensor (or slice of it) to materialise.

    Tensors stored F32/I32/... are read straight into their final buffer. BF16/F16 ones get a float32
    final buffer too: their raw 2-byte values are read into its first half and widened in place, back
    to front in cache-sized blocks (block [a, b) reads bytes [2a, 2b) and writes [4a, 4b); everything it
    overwrites is already widened), so no second full-size array is ever allocated.
    """
    want: _Want
    info: TensorInfo
    shape: Tuple[int, ...]          # output shape (the slice's)
    raw: bool = False               # keep the stored dtype (BF16 as uint16 bits)
    bf16: bool = False              # keep BF16 as uint16 bits (INT4 scales are kept so always)
    pieces: int = 0
    result: Optional[np.ndarray] = None

    def __post_init__(self):
        # INT4 scales (an INT4 module's BF16 part) stay BF16 bits whatever bf16 says: Int4Weight holds them so
        keep = self.raw or (self.info.dtype == "BF16" and (self.bf16 or self.want.module is not None))
        self.widen = self.info.dtype in ("BF16", "F16") and not keep
        self.count = math.prod(self.shape)
        self.nbytes = self.count * self.info.storage.itemsize    # bytes read from the file
        self.out_dtype = np.dtype(np.float32) if self.widen else self.info.storage
        self.out_nbytes = self.count * self.out_dtype.itemsize  # bytes of the final array
        self.buf: Optional[np.ndarray] = None

    def target(self) -> memoryview:
        """The bytes the file's data is read into (the final buffer, placed by _place_in_arenas)."""
        return memoryview(self.buf.reshape(-1).view(np.uint8))[: self.nbytes]

    def finish(self) -> None:
        """After the reads: widen in place (eager)."""
        if self.widen and self.count:
            flat = self.buf.reshape(-1)
            bits = flat.view(np.uint32)
            src = flat.view(np.uint16 if self.info.dtype == "BF16" else np.float16)[: self.count]
            last = (self.count - 1) // _WIDEN_BLOCK * _WIDEN_BLOCK
            for a in range(last, -1, -_WIDEN_BLOCK):
                b = min(self.count, a + _WIDEN_BLOCK)
                if self.info.dtype == "BF16":
                    tmp = src[a:b].astype(np.uint32)          # a copy, taken before [a, b) is written
                    np.left_shift(tmp, 16, out=tmp)
                    bits[a:b] = tmp
                else:
                    flat[a:b] = src[a:b].astype(np.float32)
        self.result = self.buf

    def from_view(self, view: np.ndarray) -> None:
        """mmap: `view` is the tensor (or slice) in the mapping; copy only what needs converting."""
        if self.info.dtype == "BF16" and self.widen:
            self.result = bf16_to_f32(view)
        elif self.widen:
            self.result = aligned_copy(view, np.float32)
        else:
            self.result = view if view.flags.c_contiguous else aligned_copy(view)


@dataclass
class _Call:                        # one preadv: contiguous file bytes scattered into views
    offset: int
    end: int
    views: List[memoryview]
    jobs: List[int]


@dataclass
class _Unit:
    """One work item of a thread: ~chunk bytes of one file.

    eager: `calls` (preadvs into the final buffers). mmap: `spans` (page-aligned ranges of the mapping to
    make resident). `jobs` holds one entry per piece of a job inside this unit; a job is finished when all
    its pieces are (job.pieces counts them). `nbytes` is tensor bytes, what progress reports.
    """
    file: int
    nbytes: int = 0
    calls: List[_Call] = field(default_factory=list)
    spans: List[Tuple[int, int]] = field(default_factory=list)
    jobs: List[int] = field(default_factory=list)


class _Throttle:
    """Caps the aggregate read rate: each chunk reserves a time slot of nbytes / rate."""

    def __init__(self, mb_s: float):
        self.rate = mb_s * MB
        self.lock = threading.Lock()
        self.next = time.monotonic()

    def after_read(self, nbytes: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.next = max(self.next, now - 0.05) + nbytes / self.rate  # small bursts only after idling
            until = self.next
        if until > now:
            time.sleep(until - now)


def _preadv_full(fd: int, views: List[memoryview], offset: int, path: Path, tensor: str) -> None:
    views = [v for v in views if len(v)]
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            raise CheckpointError(f"{path}: truncated shard, reading tensor '{tensor}' hit the end of the file at "
                                  f"byte {offset}; re-download or regenerate this shard")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _plan(jobs: List[_Job], runs: List[Tuple[int, int, int, int]], chunk: int) -> List[_Unit]:
    """eager: runs (file, offset, nbytes, job) -> units of at most `chunk` bytes, file-contiguous calls merged."""
    views = {j: job.target() for j, job in enumerate(jobs)}
    pos: Dict[int, int] = {}
    pieces = []
    for f, off, n, j in runs:  # runs of one job come in output order: consecutive destination bytes
        d = pos.get(j, 0)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            pieces.append((f, off + a, b - a, j, views[j][d + a: d + b]))
            jobs[j].pieces += 1
        pos[j] = d + n
    pieces.sort(key=lambda p: (p[0], p[1]))
    units: List[_Unit] = []
    for f, off, n, j, view in pieces:
        u = units[-1] if units else None
        if u is None or u.file != f or u.nbytes + n > chunk:
            u = _Unit(f)
            units.append(u)
        c = u.calls[-1] if u.calls else None
        if c is not None and c.end == off and len(c.views) < _IOV_MAX:
            c.views.append(view)
            c.jobs.append(j)
            c.end += n
        else:
            u.calls.append(_Call(off, off + n, [view], [j]))
        u.nbytes += n
        u.jobs.append(j)
    return units


_PAGE = mmap.PAGESIZE
_SPAN_GAP = 1 << 16                 # mmap: runs closer than this are made resident as one range


def _spans(runs: List[Tuple[int, int, int, int]]) -> List[list]:
    """runs (file, offset, nbytes, job) -> [file, start, end, [(offset, nbytes, job)]]: page-aligned ranges, runs
    less than _SPAN_GAP apart merged (fewer, larger reads; column slices closer than that map whole rows)."""
    spans: List[list] = []
    for f, off, n, j in sorted(runs, key=lambda r: (r[0], r[1])):
        if n <= 0:
            continue
        a, b = off // _PAGE * _PAGE, -(-(off + n) // _PAGE) * _PAGE
        s = spans[-1] if spans else None
        if s is not None and s[0] == f and a <= s[2] + _SPAN_GAP:
            s[2] = max(s[2], b)
            s[3].append((off, n, j))
        else:
            spans.append([f, a, b, [(off, n, j)]])
    return spans


def _plan_mmap(jobs: List[_Job], runs: List[Tuple[int, int, int, int]], chunk: int) -> List[_Unit]:
    """mmap: runs -> page-aligned ranges (runs less than _SPAN_GAP apart merged) cut into `chunk`-byte units."""
    chunk = max(_PAGE, chunk // _PAGE * _PAGE)
    units: List[_Unit] = []
    for f, a, b, members in _spans(runs):
        mine = [_Unit(f, spans=[(c, min(b, c + chunk))]) for c in range(a, b, chunk)]
        for off, n, j in members:
            for k in range((off - a) // chunk, (off + n - 1 - a) // chunk + 1):
                u = mine[k]
                c0, c1 = u.spans[0]
                u.nbytes += min(off + n, c1) - max(off, c0)
                if not u.jobs or u.jobs[-1] != j:  # tensors do not overlap: a job's runs are adjacent here
                    u.jobs.append(j)
                    jobs[j].pieces += 1
        units.extend(u for u in mine if u.nbytes)
    return units


_ALIGN = 64                         # bytes; every tensor in an arena starts on a cache line (the arena on one too)


def _place_in_arenas(jobs: List[_Job], file_no: Dict[Path, int]) -> None:
    """Give every job its final buffer: a view into one big allocation per shard file.

    One large np.empty per file instead of one per tensor: numpy backs allocations of 4 MiB and more
    with transparent huge pages, so filling them costs one page fault per 2 MiB rather than per 4 KiB
    (page faults, not copies, bound a loader writing fresh memory; in VMs by far). The arrays are
    views, so one file's memory is freed when none of its tensors is referenced any more.
    """
    by_file: Dict[int, List[_Job]] = {}
    for job in jobs:
        by_file.setdefault(file_no[job.info.path], []).append(job)
    for fjobs in by_file.values():
        fjobs.sort(key=lambda j: j.info.start)  # file order: adjacent reads land in adjacent memory
        offsets, size = [], 0
        for job in fjobs:
            offsets.append(size)
            size += -(-job.out_nbytes // _ALIGN) * _ALIGN
        arena = aligned_empty(max(size, 1), np.uint8)
        for job, off in zip(fjobs, offsets):
            job.buf = arena[off: off + job.out_nbytes].view(job.out_dtype).reshape(job.shape)


class _Resident:
    """Makes byte ranges of a file mapping resident: the same large sequential reads, without a copy.

    posix_fadvise(WILLNEED) starts the range's reads (large requests, asynchronous), then
    madvise(MADV_POPULATE_READ) (Linux >= 5.14) waits for them and maps every page. madvise is called
    through ctypes, which releases the GIL (Python's mmap.madvise holds it), so threads overlap. Where
    MADV_POPULATE_READ is missing, one byte per page is read instead.
    """

    MADV_POPULATE_READ = 22

    def __init__(self, lock: bool = False):
        self.madvise = self.mlock = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self.madvise, self.mlock = libc.madvise, libc.mlock
                self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                self.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            except (OSError, AttributeError):
                self.madvise = self.mlock = None
        if lock and self.mlock is None:
            raise CheckpointError("load.mlock=true needs mlock(2) (Linux); set load.mlock=false")
        self.lock = lock

    def __call__(self, fd: int, base: int, pages: np.ndarray, a: int, b: int, path: Path) -> None:
        try:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)
        except (AttributeError, OSError):
            pass
        populated = False
        if self.madvise is not None:
            populated = self.madvise(ctypes.c_void_p(base + a), b - a, self.MADV_POPULATE_READ) == 0
            err = ctypes.get_errno()
            if not populated and err == errno.EFAULT:   # pages past the end of the file
                raise CheckpointError(f"{path}: truncated shard, bytes {a}..{b} are past its end (it has "
                                      f"{os.fstat(fd).st_size} bytes now: changed while loading?); re-download "
                                      f"or regenerate this shard")
            if not populated and err not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise CheckpointError(f"{path}: reading bytes {a}..{b} failed ({os.strerror(err)}); its storage "
                                      f"is failing: check the disk, or re-download the shard")
            if not populated:
                self.madvise = None     # an older kernel: fall back to touching the pages
        if not populated:
            int(pages[a:b:_PAGE].max())
        if self.lock and self.mlock(ctypes.c_void_p(base + a), b - a) != 0:
            err = ctypes.get_errno()
            raise CheckpointError(f"{path}: cannot lock bytes {a}..{b} in memory ({os.strerror(err)}); raise the "
                                  f"memlock limit (ulimit -l unlimited; LimitMEMLOCK=infinity under systemd) or "
                                  f"set load.mlock=false")


@contextlib.contextmanager
def _opened(files: List[Path]):
    """The files opened read-only (sequential-read hint), closed on the way out."""
    fds: List[int] = []
    try:
        for p in files:
            fds.append(os.open(p, os.O_RDONLY))
            try:
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def _execute(files: List[Path], units: List[_Unit], jobs: List[_Job], threads: int,
             io: Callable[[List[int], _Unit], None], finish: Callable[[int], None], throttle: Optional[_Throttle],
             progress: Optional[ProgressFn], total: int, shard_stats: List[Dict]) -> int:
    """Run `io(fds, unit)` on every unit from `threads` threads (fds: `files` opened, in order);
    `finish(j)` runs (in the thread) once job j is complete."""
    for j, job in enumerate(jobs):
        if job.pieces == 0:
            finish(j)
    left_per_file = [0] * len(files)
    for u in units:
        left_per_file[u.file] += 1
    shards_total = sum(1 for n in left_per_file if n)
    lock = threading.Lock()

    def work(fds: List[int], u: _Unit) -> _Unit:
        t0 = time.monotonic()
        io(fds, u)
        if throttle:
            throttle.after_read(u.nbytes)
        done = []
        with lock:
            st = shard_stats[u.file]
            st["t0"] = min(st["t0"], t0)
            st["t1"] = max(st["t1"], time.monotonic())
            st["bytes"] += u.nbytes
            for j in u.jobs:
                jobs[j].pieces -= 1
                if jobs[j].pieces == 0:
                    done.append(j)
        for j in done:  # widening and INT4 assembly happen in the reading threads, beside other reads
            finish(j)
        return u

    bytes_done = shards_done = 0
    if progress:
        progress(0, total, 0, shards_total)
    with _opened(files) as fds, ThreadPoolExecutor(max_workers=max(1, threads),
                                                   thread_name_prefix="kdtree-load") as pool:
        pending = {pool.submit(work, fds, u) for u in units}
        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    u = fut.result()
                    bytes_done += u.nbytes
                    left_per_file[u.file] -= 1
                    shards_done += left_per_file[u.file] == 0
                    if progress:  # once per chunk, so callers see every step
                        progress(bytes_done, total, shards_done, shards_total)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return bytes_done


def _read_eager(files: List[Path], jobs: List[_Job], runs, threads: int, chunk: int,
                throttle: Optional[_Throttle], progress: Optional[ProgressFn], total: int,
                shard_stats: List[Dict], assembler: "_Assembler") -> int:
    def io(fds: List[int], u: _Unit) -> None:
        for c in u.calls:
            _preadv_full(fds[u.file], list(c.views), c.offset, files[u.file], jobs[c.jobs[0]].info.name)

    def finish(j: int) -> None:
        jobs[j].finish()
        assembler.done(jobs[j])

    return _execute(files, _plan(jobs, runs, chunk), jobs, threads, io, finish, throttle, progress, total,
                    shard_stats)


def _read_mmap(files: List[Path], jobs: List[_Job], runs, slices: List, threads: int, chunk: int,
               throttle: Optional[_Throttle], progress: Optional[ProgressFn], total: int,
               shard_stats: List[Dict], assembler: "_Assembler", lock: bool = False) -> int:
    """Map the shards, make the needed pages resident from `threads` threads, tensors are views of the map.

    Tensors kept in their stored dtype and row slices are zero-copy, read-only views of the page cache
    (no second copy of the weights in memory; several processes mapping one file share its pages);
    what must be converted (bf16 -> float32) or gathered (column slices) is copied once it is resident.
    """
    file_no = {p: i for i, p in enumerate(files)}
    maps: Dict[int, Tuple[mmap.mmap, np.ndarray, int]] = {}
    for f in sorted({file_no[job.info.path] for job in jobs}):
        if files[f].stat().st_size == 0:    # cannot be mapped; holds no tensor bytes either
            continue
        try:
            with open(files[f], "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{files[f]}: cannot be memory-mapped ({e}); use load.strategy=eager on this "
                                  f"filesystem") from None
        pages = np.frombuffer(mm, np.uint8)   # (no MADV_SEQUENTIAL: it lets reclaim take weight pages first)
        maps[f] = (mm, pages, pages.ctypes.data)

    def view(j: int) -> np.ndarray:
        job, sl = jobs[j], slices[j]
        f = file_no[job.info.path]
        count = int(np.prod(job.info.shape, dtype=np.int64))
        if f in maps:
            full = np.frombuffer(maps[f][0], job.info.storage, count, job.info.start).reshape(job.info.shape)
        else:
            full = np.empty(job.info.shape, job.info.storage)
        return full if sl is None else full[tuple(slice(a, b) for a, b in sl)]

    resident = _Resident(lock)

    def io(fds: List[int], u: _Unit) -> None:
        _, pages, base = maps[u.file]
        for a, b in u.spans:
            resident(fds[u.file], base, pages, a, min(b, pages.size), files[u.file])

    def finish(j: int) -> None:
        jobs[j].from_view(view(j))
        assembler.done(jobs[j])

    return _execute(files, _plan_mmap(jobs, runs, chunk), jobs, threads, io, finish, throttle, progress, total,
                    shard_stats)


# ---------------------------------------------------------------- public entry points

def _load(path: Path, cfg, quant_cfg, drafter: bool, shard: Optional[ShardFn], progress: Optional[ProgressFn],
          threads: int, strategy: str, throttle_mb_s: float, chunk_mb: float, raw: bool = False,
          mlock: bool = False, bf16: bool = False):
    if strategy not in ("eager", "mmap"):
        raise ValueError(f"strategy={strategy!r}; use 'eager' or 'mmap'")
    if chunk_mb <= 0:
        raise ValueError(f"chunk_mb={chunk_mb!r}; use a positive number of MiB (32 is the default)")
    if mlock and strategy != "mmap":
        raise ValueError("mlock=True locks the mapped shards: it needs strategy='mmap' (eager's copies are "
                         "anonymous memory, which only swap can evict)")
    t_start = time.monotonic()
    idx, files, file_no, jobs, slices, runs, module_slices, linear, group = _prepare(path, cfg, quant_cfg, drafter,
                                                                                     shard, raw, bf16)
    assembler = _Assembler(module_slices, linear, group, raw)
    shard_stats = [{"t0": math.inf, "t1": -math.inf, "bytes": 0} for _ in files]
    total = sum(job.nbytes for job in jobs)
    chunk = int(chunk_mb * 2 ** 20)
    if throttle_mb_s > 0:  # small chunks so a throttled load still reports progress often
        chunk = min(chunk, max(64 * 1024, int(throttle_mb_s * MB * 0.1)))
    throttle = _Throttle(throttle_mb_s) if throttle_mb_s > 0 else None
    if strategy == "eager":
        _place_in_arenas(jobs, file_no)
        nread = _read_eager(files, jobs, runs, threads, chunk, throttle, progress, total, shard_stats, assembler)
    else:
        nread = _read_mmap(files, jobs, runs, slices, threads, chunk, throttle, progress, total, shard_stats,
                           assembler, mlock)
    weights = assembler.weights(jobs)
    seconds = time.monotonic() - t_start
    per_shard = [ShardStats(p.name, s["bytes"], max(0.0, s["t1"] - s["t0"]),
                            s["bytes"] / MB / max(s["t1"] - s["t0"], 1e-9) if s["bytes"] else 0.0)
                 for p, s in zip(files, shard_stats)]
    stats = LoadStats(nread, idx.data_bytes, seconds, nread / MB / max(seconds, 1e-9), strategy, threads,
                      len(weights), per_shard)
    return weights, stats


def _prepare(path: Path, cfg, quant_cfg, drafter: bool, shard: Optional[ShardFn], raw: bool, bf16: bool = False):
    """Checks, then one _Job per on-disk tensor (or slice) and the file byte runs to read: headers only."""
    idx, wants = _checked(path, cfg, quant_cfg, drafter)
    group = int(plain(quant_cfg)["group_size"]) if quant_cfg is not None else 32
    linear = names.drafter_linear_shapes(cfg) if drafter else names.target_linear_shapes(cfg)

    # slices per on-disk tensor (INT4 modules are asked once, by their logical name and shape)
    module_slices: Dict[str, Optional[Tuple[Tuple[int, int], ...]]] = {}
    files = [h.path for h in idx.files]
    file_no = {p: i for i, p in enumerate(files)}
    jobs: List[_Job] = []
    slices: List = []
    runs: List[Tuple[int, int, int, int]] = []
    for w in wants:
        info = idx.tensors[w.disk]
        if w.module is None:
            sl = _norm_slices(w.disk, w.shape, shard(w.disk, w.shape)) if shard else None
        else:
            if w.module not in module_slices:
                logical = linear[w.module]
                module_slices[w.module] = (_norm_slices(f"{w.module}.weight", logical,
                                                        shard(f"{w.module}.weight", logical)) if shard else None)
            sl = _int4_part_slices(w, module_slices[w.module], linear[w.module], group)
        out_shape, offsets, run = _runs(info, sl)
        jobs.append(_Job(w, info, out_shape, raw, bf16))
        slices.append(sl)
        f = file_no[info.path]
        runs.extend((f, off, run, len(jobs) - 1) for off in offsets)

    return idx, files, file_no, jobs, slices, runs, module_slices, linear, group


@dataclass
class MemoryPlan:
    """What one load will hold, from the headers alone (plan_load). Bytes."""
    read_bytes: int     # tensor bytes inside the requested slices (what LoadStats.bytes_read reports)
    mapped_bytes: int   # mmap: file pages made resident and still mapped after the load (page-aligned; runs
                        # < _SPAN_GAP apart merged; shards holding only copied tensors are unmapped by then)
    copied_bytes: int   # new memory: bf16/f16 widened to float32, gathered column slices (eager: every tensor)
    view_bytes: int     # mmap: tensors used in place (zero-copy views of the mapped pages)


def plan_load(path, model_cfg, quant_cfg, *, drafter: bool = False, shard: Optional[ShardFn] = None,
              strategy: str = "mmap", raw: bool = False, bf16: bool = False) -> MemoryPlan:
    """The memory a load_checkpoint/load_drafter call with these arguments will hold, computed the way the
    loader plans its reads (same slices, same span merging), without reading a weight byte."""
    p = Path(path) / DRAFTER_DIR if drafter else Path(path)
    _, _, _, jobs, _, runs, _, _, _ = _prepare(p, model_cfg, quant_cfg, drafter, shard, raw, bf16)
    pieces: Dict[int, int] = {}
    for _, _, _, j in runs:
        pieces[j] = pieces.get(j, 0) + 1
    read = sum(job.nbytes for job in jobs)
    if strategy == "eager":
        return MemoryPlan(read, 0, sum(job.out_nbytes for job in jobs), 0)
    copy = [job.widen or pieces.get(j, 0) > 1 for j, job in enumerate(jobs)]
    copied = sum(job.out_nbytes for job, c in zip(jobs, copy) if c)
    views = sum(job.out_nbytes for job, c in zip(jobs, copy) if not c)
    # a shard whose tensors were all copied is unmapped when the load returns (no view keeps its mmap alive)
    kept = {f for f, _, _, j in runs if not copy[j]}
    mapped = sum(b - a for f, a, b, _ in _spans(runs) if f in kept)
    return MemoryPlan(read, mapped, copied, views)


def resident_bytes() -> int:
    """This process's resident memory (RssAnon + RssFile + RssShmem of /proc/self/status, bytes); 0 off Linux."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    except OSError:
        return 0
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile", "RssShmem") if k in fields)


def _int4_part_slices(w: _Want, sl, logical: Tuple[int, int], group: int):
    """A slice of the logical [out, in] weight -> the slice of its packed / scale / shape part."""
    if sl is None or w.part == "shape":
        return None
    (r0, r1), (c0, c1) = sl
    n_in = logical[1]
    per = 8 if w.part == "packed" else group
    if c0 % per or (c1 % per and c1 != n_in):
        raise ValueError(f"shard() slices columns {c0}:{c1} of INT4 weight '{w.module}.weight' {list(logical)}; "
                         f"INT4 column slices must be multiples of {per} ({w.part})")
    return ((r0, r1), (c0 // per, math.ceil(c1 / per)))


class _Assembler:
    """Finished jobs -> weights. An INT4 module becomes an Int4Weight as soon as its 3 parts are read."""

    def __init__(self, module_slices, linear, group: int, raw: bool = False):
        self.module_slices, self.linear, self.group, self.raw = module_slices, linear, group, raw
        self.lock = threading.Lock()
        self.parts: Dict[str, Dict[str, _Job]] = {}
        self.int4: Dict[str, object] = {}

    def done(self, job: _Job) -> None:
        m = job.want.module
        if m is None or self.raw:
            return
        with self.lock:
            parts = self.parts.setdefault(m, {})
            parts[job.want.part] = job
            if len(parts) < 3:
                return
            del self.parts[m]
        self.int4[m] = _int4(m, parts, self.module_slices[m], self.linear[m], self.group)

    def weights(self, jobs: List[_Job]) -> Dict[str, object]:
        """name -> tensor in names.py order (INT4 modules as `<module>.weight`)."""
        out: Dict[str, object] = {}
        for job in jobs:
            m = job.want.module
            if m is None or self.raw:
                out[job.want.disk] = job.result
            elif job.want.part == "packed":
                out[f"{m}.weight"] = self.int4[m]
        return out


def _int4(module: str, p: Dict[str, _Job], sl, logical: Tuple[int, int], group: int):
    stored = tuple(int(v) for v in p["shape"].result.reshape(-1))
    if stored != tuple(logical):
        raise CheckpointError(f"{p['shape'].info.path}: tensor '{module}.weight_shape' holds {list(stored)} but the "
                              f"model config expects {list(logical)}; regenerate the quantized checkpoint")
    shape = logical if sl is None else (sl[0][1] - sl[0][0], sl[1][1] - sl[1][0])
    return Int4Weight.from_tensors(f"{module}.weight", p["packed"].result, p["scale"].result, shape, group)


def load_checkpoint(path, model_cfg, quant_cfg, *, shard: Optional[ShardFn] = None,
                    progress: Optional[ProgressFn] = None, threads: int = 4, strategy: str = "mmap",
                    throttle_mb_s: float = 0, chunk_mb: float = 32, raw: bool = False, mlock: bool = False,
                    bf16: bool = False):
    """Target checkpoint at `path` -> ({name: float32 ndarray | Int4Weight}, LoadStats).

    bf16=True: BF16 tensors (outside INT4 modules) stay uint16 bits, for a backend that widens them itself
    (kdtree.backends.native_forward.keeps_bf16).

    raw=True: {on-disk name: ndarray as stored} (BF16 as uint16 bits, INT4 modules as their three parts),
    nothing converted or assembled: what a backend that uploads the stored format as is takes.
    mlock=True (mmap): the mapped pages are locked in RAM, so memory pressure cannot evict weights.
    """
    return _load(Path(path), model_cfg, quant_cfg, False, shard, progress, threads, strategy, throttle_mb_s,
                 chunk_mb, raw, mlock, bf16)


def load_drafter(path, model_cfg, quant_cfg=None, *, shard: Optional[ShardFn] = None,
                 progress: Optional[ProgressFn] = None, threads: int = 4, strategy: str = "mmap",
                 throttle_mb_s: float = 0, chunk_mb: float = 32, raw: bool = False, mlock: bool = False,
                 bf16: bool = False):
    """DFlash drafter in `<path>/drafter` -> ({name: float32 ndarray}, LoadStats); bf16 as load_checkpoint."""
    return _load(Path(path) / DRAFTER_DIR, model_cfg, quant_cfg, True, shard, progress, threads, strategy,
                 throttle_mb_s, chunk_mb, raw, mlock, bf16)


def load_options(load_cfg, throttle: bool = True) -> Dict[str, object]:
    """The `load:` config section -> load_checkpoint/load_drafter keyword arguments."""
    opts = {"threads": int(load_cfg.threads), "strategy": str(load_cfg.strategy), "mlock": bool(load_cfg.mlock)}
    if throttle:
        opts["throttle_mb_s"] = float(load_cfg.throttle_mb_s)
    return opts


def checkpoint_bytes(path) -> int:
    """Tensor-data bytes of a checkpoint (index metadata.total_size, else the sum over headers): for ETAs."""
    return open_checkpoint(path).total_size
