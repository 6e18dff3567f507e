"""The native kernel library (native/include/kdtree.h) through cffi, and `NativeOps` for backend=cpu|cuda.

cffi ABI mode (`ffi.dlopen`), not API mode: the .so is built by `make native` (plain gcc/nvcc, no Python
headers), so installing kdtree never needs a compiler and one wheel serves both libraries. The declarations
cffi uses are read from kdtree.h itself (one source for both builds and Python); `kd_version()` == ABI_VERSION
at load guards against a library built from an older header.

    lib = load_library("cpu")                  # NativeError if missing or mismatched
    tree = lib.tree_build(logp, ids, budget)   # thin typed wrappers: check, call, raise NativeError
    ops = NativeOps("cpu")                     # the Ops interface (kdtree/backends/base.py)

CUDA: the C ops take device pointers and a cudaStream_t. `NativeOps("cuda")` takes numpy arrays, copies them
to the device with the library's own kd_memcpy_* (weights once, cached by identity), runs the op on the default
stream and copies the result back. Callers holding torch CUDA tensors call the C functions directly:
`lib.c.kd_linear_f32(lib.ptr("float*", t.data_ptr()), ..., lib.stream(torch.cuda.current_stream().cuda_stream))`.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from kdtree.backends.base import Ops
from kdtree.backends.native_forward import LIBRARY_CLOCK
from kdtree.tree import Tree as _Tree
from kdtree.errors import ConfigError, NativeError

ABI_VERSION = 17  # = KD_ABI_VERSION of native/include/kdtree.h; a library of another version is refused
BUILD_DIR = Path(__file__).resolve().parents[2] / "native" / "build"

HEADER = Path(__file__).resolve().parents[2] / "native" / "include" / "kdtree.h"


def _cdef(header: Path = HEADER) -> str:
    """The C ABI's declarations for cffi, from the one header both builds compile against (comments,
    preprocessor lines and the extern "C" wrapper dropped; cffi parses plain declarations only)."""
    try:
        text = header.read_text()
    except OSError as e:
        raise NativeError(f"native header {header} is unreadable ({e.strerror}); reinstall kdtree") from None
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines()
                     if line.strip() and not line.lstrip().startswith("#") and line.strip() not in ('extern "C" {', "}"))

_ffi = None
_LIBS: Dict[Tuple[str, str], "NativeLibrary"] = {}
CUDA_REASON = ""  # why cuda_device_count() returned 0, "" otherwise


def _get_ffi():
    global _ffi
    if _ffi is None:
        import cffi
        _ffi = cffi.FFI()
        _ffi.cdef(_cdef())
    return _ffi


def library_path(kind: str, path: str = "") -> Path:
    return Path(path) if path else BUILD_DIR / f"libkdtree_{kind}.so"


def load_library(kind: str = "cpu", path: str = "") -> "NativeLibrary":
    """Open libkdtree_<kind>.so (cached per path); reads kd_version and kd_device_count at load."""
    if kind not in ("cpu", "cuda"):
        raise NativeError(f"native library kind={kind!r} is unknown; use kind='cpu' or 'cuda'")
    p = library_path(kind, path)
    key = (kind, str(p))
    if key not in _LIBS:
        if not p.exists():
            raise NativeError(f"native library {p} not found; build it with `make native`"
                              + (" (needs nvcc)" if kind == "cuda" else ""))
        ffi = _get_ffi()
        try:
            c = ffi.dlopen(str(p))
        except OSError as e:
            raise NativeError(f"cannot load native library {p}: {e}; rebuild it with `make native`") from None
        _LIBS[key] = NativeLibrary(kind, p, ffi, c)
    return _LIBS[key]


def library_info(kind: str = "cpu", path: str = "") -> dict:
    """What a benchmark ran on (bench.json's provenance): the library file (path, size, sha256 prefix), its ABI
    version, the host kernels chosen at load (avx512 / avx2 / generic: KDTREE_CPU_ISA, KDTREE_CPU_GENERIC and the
    CPU's flags), the threads a region uses, and the devices (cuda: 0 with the reason when none)."""
    lib = load_library(kind, path)
    data = lib.path.read_bytes()
    out = {"library": str(lib.path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16],
           "abi": lib.version, "host_kernels": lib.host_kernels, "threads": lib.threads,
           "device_count": lib.device_count}
    if lib.device_reason:
        out["device_reason"] = lib.device_reason
    return out


def cuda_device_count(path: str = "") -> int:
    """Number of CUDA devices the CUDA library sees; 0 (reason in CUDA_REASON) when the library, the driver or
    a device is missing. Never raises."""
    global CUDA_REASON
    try:
        n = load_library("cuda", path).device_count
    except Exception as e:  # noqa: BLE001 - by contract this never raises
        CUDA_REASON = str(e)
        return 0
    CUDA_REASON = "" if n > 0 else load_library("cuda", path).device_reason
    return n


def _c_contig(a: np.ndarray, dtype, name: str, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise NativeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise NativeError(f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if a.ndim != ndim:
        raise NativeError(f"{name}: shape {a.shape} has {a.ndim} dims, expected {ndim}")
    if not a.flags.c_contiguous:
        raise NativeError(f"{name}: array with shape {a.shape} is not C-contiguous; pass np.ascontiguousarray(...)")
    return a


_NO_TREE = (None,) * 6   # tree_build_fast's "no previous build to repeat" (nothing `is` None there)


class NativeLibrary:
    """One loaded libkdtree_*.so: version/backend/device count read at load, typed wrappers over host arrays."""

    def __init__(self, kind: str, path: Path, ffi, c):
        self.kind, self.path, self.ffi, self.c = kind, path, ffi, c
        self.version = int(c.kd_version())
        if self.version != ABI_VERSION:
            raise NativeError(f"native library {path} has ABI version {self.version}, kdtree expects "
                              f"{ABI_VERSION}; rebuild it with `make native`")
        self.backend = ffi.string(c.kd_backend()).decode()
        self.device_count = int(c.kd_device_count())
        self.device_reason = self.last_error() if self.device_count == 0 else ""
        self.host_kernels = ffi.string(c.kd_host_kernels()).decode()   # avx512 / avx2 / generic
        self._local = threading.local()  # per-thread tree_build / tree_accept output buffers
        self._tree_job = c.kd_tree_build_job
        self._fb_raw = ffi._backend.from_buffer                         # skips ffi's type-string parsing
        self._f32a, self._i32a = ffi.typeof("float[]"), ffi.typeof("int32_t[]")
        self._weights: Dict[int, Tuple[Any, "DeviceArray"]] = {}  # cuda: id -> (weakref to array, device copy)

    # ---- plumbing ---------------------------------------------------------------------------------------
    def set_threads(self, n: int) -> int:
        """backend.threads: the OpenMP threads of the CPU build's multi-row kernels and forwards, process-wide
        (0 = OpenMP's default: OMP_NUM_THREADS, else every core). Returns the threads a region uses now
        (the CUDA build: accepted, 1)."""
        self.check(self.c.kd_set_threads(int(n)), "kd_set_threads")
        return int(self.c.kd_threads())

    @property
    def threads(self) -> int:
        return int(self.c.kd_threads())

    def last_error(self) -> str:
        return self.ffi.string(self.c.kd_last_error()).decode(errors="replace")

    def check(self, rc: int, op: str) -> None:
        if rc != 0:
            raise NativeError(f"{op} ({self.kind}): {self.last_error() or f'status {rc}'}")

    def ptr(self, ctype: str, obj: Any):
        """A typed pointer to a numpy array's data, an int address (device pointer, torch data_ptr()) or None."""
        if obj is None:
            return self.ffi.NULL
        if isinstance(obj, np.ndarray):
            return self.ffi.cast(ctype, self.ffi.from_buffer(obj))  # ~4x faster than obj.ctypes.data
        return self.ffi.cast(ctype, int(obj))

    def stream(self, handle: Optional[int] = None):
        return self.ffi.NULL if not handle else self.ffi.cast("void *", int(handle))

    def require_device(self, op: str) -> None:
        if self.kind == "cuda" and self.device_count == 0:
            raise NativeError(f"{op}: no CUDA device ({self.device_reason or 'none visible'}); use backend=cpu")

    # ---- tree ops (host arrays in both builds) -----------------------------------------------------------
    def draft_topk(self, logits: np.ndarray, width: int) -> Tuple[np.ndarray, np.ndarray]:
        """kd_draft_topk: (logp f32[rows, w], ids i32[rows, w]) as kdtree.tree.draft_topk, in this thread's buffers
        for the shape (overwritten by its next call; copy to keep). logits: host f32[rows, V]."""
        if not (type(logits) is np.ndarray and logits.dtype == _F32 and logits.ndim == 2 and logits.flags.c_contiguous):
            logits = np.ascontiguousarray(logits, np.float32)
            if logits.ndim != 2:
                raise NativeError(f"draft_topk: logits shape {logits.shape}; expected [depth, V]")
        rows, V = logits.shape
        if not isinstance(width, (int, np.integer)) or width < 1 or V < 1:
            raise NativeError(f"draft_topk: width={width!r} must be an int >= 1 (V={V})")
        key = (rows, V, int(width))
        slots = getattr(self._local, "topk", None)
        if slots is None:
            slots = self._local.topk = {}
        slot = slots.get(key)
        if slot is None:
            w = min(int(width), V)
            lp, ids = np.empty((rows, w), np.float32), np.empty((rows, w), np.int32)
            slot = slots[key] = (lp, ids, self.ffi.from_buffer("float[]", lp), self.ffi.from_buffer("int32_t[]", ids))
        t0 = time.perf_counter()
        rc = self.c.kd_draft_topk(self._fb_raw(self._f32a, logits, False), rows, V, int(width), slot[2], slot[3])
        LIBRARY_CLOCK.seconds += time.perf_counter() - t0
        self.check(rc, "draft_topk")
        return slot[0], slot[1]

    def tree_build(self, logp: np.ndarray, ids: np.ndarray, budget: int):
        """-> Tree, identical to kdtree.tree.tree_build. The Tree and its arrays are this thread's buffers
        for this (depth, width, budget), allocated on the first call: the next call of the same shape on the same
        thread overwrites them (a decode round uses its tree before building the next); copy a field to keep it."""
        tree = self.tree_build_fast(logp, ids, budget)
        if tree is not None:
            return tree
        _c_contig(logp, np.float32, "tree_build logp", 2)
        _c_contig(ids, np.int32, "tree_build ids", 2)
        if logp.shape != ids.shape:
            raise NativeError(f"tree_build: logp {logp.shape} and ids {ids.shape} differ; both are [depth, width]")
        job, tree = self._tree_slot(logp.shape, budget)
        job.logp, job.ids = self._fb_raw(self._f32a, logp, False), self._fb_raw(self._i32a, ids, False)
        self._local.last_tree = _NO_TREE
        t0 = time.perf_counter()
        rc = self._tree_job(job)
        LIBRARY_CLOCK.seconds += time.perf_counter() - t0
        self.check(rc, "tree_build")
        self._local.last_tree = (logp, ids, budget, logp.shape, job, tree)
        return tree

    def tree_build_fast(self, logp: Any, ids: Any, budget: Any):
        """The per-round path: C-contiguous f32/i32 arrays of a shape seen before on this thread -> Tree; None
        where anything differs (tree_build then checks, allocates and reports).

        A decode round passes the same two arrays every time (draft_topk's buffers): when logp and ids are the
        very arrays of this thread's previous build, with the same shape, dtypes and budget, the call is one
        pointer to a kd_tree_job that already holds every pointer (this thread's `last_tree` keeps the two arrays
        referenced, so their memory cannot be freed or reused). Otherwise a dict lookup by shape and the two
        pointers are set first."""
        try:
            last = self._local.last_tree
            if (logp is last[0] and ids is last[1] and budget == last[2] and logp.shape == last[3] == ids.shape
                    and logp.dtype is _F32 and ids.dtype is _I32):
                t0 = time.perf_counter()
                rc = self._tree_job(last[4])
                LIBRARY_CLOCK.seconds += time.perf_counter() - t0
                if rc == 0:
                    return last[5]
                return None
        except AttributeError:
            pass
        try:
            if logp.dtype is _F32 and ids.dtype is _I32 and logp.shape == ids.shape:
                job, tree = self._local.trees[(logp.shape, budget)]
                fb = self._fb_raw   # raises ValueError for a non-contiguous array
                job.logp, job.ids = fb(self._f32a, logp, False), fb(self._i32a, ids, False)
                self._local.last_tree = _NO_TREE   # not reusable if the call below fails
                t0 = time.perf_counter()
                rc = self._tree_job(job)
                LIBRARY_CLOCK.seconds += time.perf_counter() - t0
                if rc == 0:
                    self._local.last_tree = (logp, ids, budget, logp.shape, job, tree)
                    return tree
        except (AttributeError, KeyError, TypeError, ValueError):
            pass
        return None

    def _tree_slot(self, shape: Tuple[int, int], budget: int):
        """(kd_tree_job with every pointer but logp / ids set, Tree of views) for one (depth, width, budget) on
        this thread."""
        if not isinstance(budget, (int, np.integer)) or budget < 0:
            raise NativeError(f"tree_build: budget={budget!r}; expected an int >= 0")
        depth, width = shape
        n = _max_nodes(depth, width, int(budget))           # the C op writes exactly this many nodes
        ints = np.zeros((3, max(n, 1)), np.int32)           # tokens, parents, depths
        vis = np.zeros((n + 1, (n + 1 + 63) // 64), np.uint64)
        fb = self.ffi.from_buffer
        job = self.ffi.new("kd_tree_job *")
        job.n_depth, job.width, job.budget, job.cap = depth, width, n, n
        job.tokens, job.parents = fb("int32_t[]", ints[0]), fb("int32_t[]", ints[1])
        job.depths, job.visibility = fb("int32_t[]", ints[2]), fb("uint64_t[]", vis)
        # the job's output pointers point into ints / vis, which the Tree's views keep alive with the slot
        slot = (job, _Tree(tokens=ints[0, :n], parents=ints[1, :n], depths=ints[2, :n], visibility=vis))
        if getattr(self._local, "trees", None) is None:
            self._local.trees = {}
        self._local.trees[(shape, budget)] = slot
        return slot

    def tree_accept(self, parents: np.ndarray, tokens: np.ndarray, target_argmax: np.ndarray) -> Tuple[np.ndarray, int]:
        """-> (path i32[k], bonus). `path` is a view of this thread's buffer for N nodes, overwritten by the next
        call with the same N on this thread; copy it to keep it."""
        n = parents.shape[0] if type(parents) is np.ndarray else -1
        if not (n >= 0 and type(tokens) is np.ndarray and type(target_argmax) is np.ndarray
                and parents.dtype == _I32 and tokens.dtype == _I32 and target_argmax.dtype == _I32
                and parents.ndim == 1 and tokens.shape == parents.shape and target_argmax.shape == (n + 1,)
                and parents.flags.c_contiguous and tokens.flags.c_contiguous and target_argmax.flags.c_contiguous):
            _c_contig(parents, np.int32, "tree_accept parents", 1)
            _c_contig(tokens, np.int32, "tree_accept tokens", 1)
            _c_contig(target_argmax, np.int32, "tree_accept target_argmax", 1)
            raise NativeError(f"tree_accept: parents [{parents.shape[0]}], tokens [{tokens.shape[0]}], target_argmax "
                              f"[{target_argmax.shape[0]}]; expected [N], [N], [N+1]")
        slots = getattr(self._local, "accept", None)
        if slots is None:
            slots = self._local.accept = {}
        slot = slots.get(n)
        if slot is None:
            path = np.zeros(max(n, 1), np.int32)
            slot = slots[n] = (path, self.ffi.from_buffer("int32_t[]", path), self.ffi.new("int64_t *"),
                               self.ffi.new("int32_t *"))
        path, p_path, k, bonus = slot
        fb, ia = self._fb_raw, self._i32a
        t0 = time.perf_counter()
        rc = self.c.kd_tree_accept(fb(ia, parents, False), fb(ia, tokens, False), n, fb(ia, target_argmax, False),
                                   p_path, k, bonus)
        LIBRARY_CLOCK.seconds += time.perf_counter() - t0
        if rc:
            self.check(rc, "tree_accept")
        return path[:k[0]], bonus[0]

    def token_bitmask_apply(self, logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
        """kd_token_bitmask_apply, in place on host logits f32[T, V] (C-contiguous); bitmask u32[T, words]."""
        T, V, bits = self._bitmask_args("token_bitmask_apply", logits, bitmask)
        t0 = time.perf_counter()
        rc = self.c.kd_token_bitmask_apply(self.ffi.from_buffer("float[]", logits),
                                           self.ffi.from_buffer("uint32_t[]", bits), T, V, bits.shape[1])
        LIBRARY_CLOCK.seconds += time.perf_counter() - t0
        self.check(rc, "token_bitmask_apply")
        return logits

    def masked_argmax(self, logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
        """kd_masked_argmax: i32[T], as Ops.masked_argmax."""
        logits = np.ascontiguousarray(logits, np.float32)
        T, V, bits = self._bitmask_args("masked_argmax", logits, bitmask)
        out = np.empty(T, np.int32)
        t0 = time.perf_counter()
        rc = self.c.kd_masked_argmax(self.ffi.from_buffer("float[]", logits), self.ffi.from_buffer("uint32_t[]", bits),
                                     T, V, bits.shape[1], self.ffi.from_buffer("int32_t[]", out))
        LIBRARY_CLOCK.seconds += time.perf_counter() - t0
        self.check(rc, "masked_argmax")
        return out

    @staticmethod
    def _bitmask_args(op: str, logits: np.ndarray, bitmask: np.ndarray):
        if not (type(logits) is np.ndarray and logits.dtype == _F32 and logits.ndim == 2 and logits.flags.c_contiguous
                and logits.flags.writeable):
            raise NativeError(f"{op}: logits must be a writable C-contiguous f32[T, V] array")
        bits = np.ascontiguousarray(bitmask, np.uint32)
        T, V = logits.shape
        if bits.ndim != 2 or bits.shape[0] != T or bits.shape[1] < (V + 31) // 32:
            raise NativeError(f"{op}: bitmask shape {bits.shape}; expected [{T}, >= {(V + 31) // 32}] for logits "
                              f"[{T}, {V}]")
        return T, V, bits

    # ---- dense ops: host arrays (cpu build) -------------------------------------------------------------
    def linear_f32(self, x: np.ndarray, w: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        return self._linear("linear", "kd_linear_f32", np.float32, x, w, out)

    def linear_bf16(self, x: np.ndarray, w: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """x f32 [T, in] . w^T with w BF16 bit patterns uint16 [out, in]: exactly linear_f32 on the widened w."""
        return self._linear("linear_bf16", "kd_linear_bf16", np.uint16, x, w, out)

    def _linear(self, label: str, fn: str, wdtype, x: np.ndarray, w: np.ndarray, out: Optional[np.ndarray]):
        _c_contig(x, np.float32, f"{label} x", 2)
        _c_contig(w, wdtype, f"{label} w", 2)
        if x.shape[1] != w.shape[1]:
            raise NativeError(f"{label}: x {x.shape} and w {w.shape} disagree on in_features")
        out = self._out(out, (x.shape[0], w.shape[0]), f"{label} out")
        self._run(fn, (x, w, out), x.shape[0], x.shape[1], w.shape[0], weights=(1,))
        return out

    def linear_w4a16(self, x: np.ndarray, packed: np.ndarray, scales: np.ndarray, n_in: int, group: int,
                     out: Optional[np.ndarray] = None) -> np.ndarray:
        _c_contig(x, np.float32, "linear_w4a16 x", 2)
        _c_contig(packed, np.int32, "linear_w4a16 packed", 2)
        bf16_scales = isinstance(scales, np.ndarray) and scales.dtype == np.uint16   # BF16 bits, as checkpoints hold
        _c_contig(scales, np.uint16 if bf16_scales else np.float32, "linear_w4a16 scales", 2)
        n_out = packed.shape[0]
        if x.shape[1] != n_in or packed.shape[1] != (n_in + 7) // 8 or group <= 0 or \
                scales.shape != (n_out, (n_in + group - 1) // group):
            raise NativeError(f"linear_w4a16: x {x.shape}, packed {packed.shape}, scales {scales.shape} do not "
                              f"match in={n_in}, group={group}")
        out = self._out(out, (x.shape[0], n_out), "linear_w4a16 out")
        self._run("kd_linear_w4a16_bf16_scales" if bf16_scales else "kd_linear_w4a16", (x, packed, scales, out),
                  x.shape[0], n_in, n_out, group, weights=(1, 2))
        return out

    def linear_w4a16_half(self, x: np.ndarray, act_dtype: str, packed: np.ndarray, scales: np.ndarray, n_in: int,
                          group: int) -> np.ndarray:
        """CUDA only: x float16 [T, in] (act_dtype "f16") or bf16 bit patterns uint16 [T, in] ("bf16")."""
        code = {"f16": 1, "bf16": 2}.get(act_dtype)
        if code is None:
            raise NativeError(f"linear_w4a16_half: act_dtype={act_dtype!r}; use 'f16' or 'bf16'")
        _c_contig(x, np.float16 if code == 1 else np.uint16, "linear_w4a16_half x", 2)
        _c_contig(packed, np.int32, "linear_w4a16_half packed", 2)
        _c_contig(scales, np.float32, "linear_w4a16_half scales", 2)
        out = np.empty((x.shape[0], packed.shape[0]), np.float32)
        if self.kind == "cpu":
            self.check(self.c.kd_linear_w4a16_half(self.ptr("void *", x), code, self.ptr("int32_t *", packed),
                                                   self.ptr("float *", scales), self.ptr("float *", out), x.shape[0],
                                                   n_in, packed.shape[0], group, self.ffi.NULL), "kd_linear_w4a16_half")
            return out
        self.require_device("kd_linear_w4a16_half")
        dx, dp, ds = (self.device_array(a) for a in (x, packed, scales))
        do = self.device_array(out, upload=False)
        self.check(self.c.kd_linear_w4a16_half(self.ffi.cast("void *", dx.addr), code,
                                               self.ffi.cast("int32_t *", dp.addr), self.ffi.cast("float *", ds.addr),
                                               self.ffi.cast("float *", do.addr), x.shape[0], n_in, packed.shape[0],
                                               group, self.ffi.NULL), "kd_linear_w4a16_half")
        return do.download(out)

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float, out: Optional[np.ndarray] = None) -> np.ndarray:
        _c_contig(x, np.float32, "rms_norm x", 2)
        _c_contig(w, np.float32, "rms_norm w", 1)
        if w.shape[0] != x.shape[1]:
            raise NativeError(f"rms_norm: x {x.shape} and w {w.shape} disagree on D")
        out = self._out(out, x.shape, "rms_norm out")
        self._run("kd_rms_norm", (x, w, out), x.shape[0], x.shape[1], float(eps), weights=(1,))
        return out

    def silu_mul(self, gate: np.ndarray, up: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        _c_contig(gate, np.float32, "silu_mul gate", 2)
        _c_contig(up, np.float32, "silu_mul up", 2)
        if gate.shape != up.shape:
            raise NativeError(f"silu_mul: gate {gate.shape} and up {up.shape} differ")
        out = self._out(out, gate.shape, "silu_mul out")
        self._run("kd_silu_mul", (gate, up, out), gate.shape[0], gate.shape[1])
        return out

    def mla_attention(self, q: np.ndarray, kv: np.ndarray, n_prefix: int, visibility: Optional[np.ndarray],
                      scale: float, kv_lora: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        _c_contig(q, np.float32, "mla_attention q", 3)
        _c_contig(kv, np.float32, "mla_attention kv", 2)
        T, H, E = q.shape
        L = int(kv_lora)
        if kv.shape != (n_prefix + T, E) or not 0 <= L <= E:
            raise NativeError(f"mla_attention: q {q.shape}, kv {kv.shape}, n_prefix={n_prefix}, kv_lora={L}; "
                              f"expected kv [n_prefix + T, L + R] with 0 <= L <= L + R")
        if visibility is not None:
            _c_contig(visibility, np.uint64, "mla_attention visibility", 2)
            if visibility.shape != (T, (T + 63) // 64):
                raise NativeError(f"mla_attention: visibility {visibility.shape}, expected ({T}, {(T + 63) // 64})")
        out = self._out(out, (T, H, L), "mla_attention out")
        self._run("kd_mla_attention", (q, kv, visibility, out), T, H, L, E - L, int(n_prefix), float(scale))
        return out

    _CTYPES = {np.dtype(np.float32): "float *", np.dtype(np.int32): "int32_t *", np.dtype(np.uint64): "uint64_t *",
               np.dtype(np.float16): "void *", np.dtype(np.uint16): "void *"}

    def _out(self, out, shape, name):
        if out is None:
            return np.empty(shape, np.float32)
        _c_contig(out, np.float32, name, len(shape))
        if out.shape != tuple(shape):
            raise NativeError(f"{name}: shape {out.shape}, expected {tuple(shape)}")
        return out

    def _run(self, fn: str, arrays, *sizes, weights=()) -> None:
        """Call a dense op on host arrays (the last one is the output): directly on cpu; on cuda through device
        copies, the arrays at positions `weights` uploaded once and kept while the numpy array lives."""
        if self.kind == "cpu":
            ptrs = [self.ffi.NULL if a is None else self.ptr(self._CTYPES[a.dtype], a) for a in arrays]
            self.check(getattr(self.c, fn)(*ptrs, *sizes, self.ffi.NULL), fn)
            return
        self.require_device(fn)
        bufs = [None if a is None else self._weight(a) if i in weights else
                self.device_array(a, upload=i < len(arrays) - 1) for i, a in enumerate(arrays)]
        ptrs = [self.ffi.NULL if b is None else self.ffi.cast(self._CTYPES[b.dtype], b.addr) for b in bufs]
        self.check(getattr(self.c, fn)(*ptrs, *sizes, self.ffi.NULL), fn)
        bufs[-1].download(arrays[-1])

    # ---- device memory (cuda) ------------------------------------------------------------------------------
    def device_array(self, a: np.ndarray, upload: bool = True) -> "DeviceArray":
        return DeviceArray(self, a, upload)

    def _weight(self, a: np.ndarray) -> "DeviceArray":
        key = id(a)
        hit = self._weights.get(key)
        if hit is None or hit[0]() is not a:
            # a weak reference: the device copy is freed when the numpy array dies (its id may then be reused)
            ref = weakref.ref(a, lambda _r, k=key, w=self._weights: w.pop(k, None))
            hit = self._weights[key] = (ref, self.device_array(a))
        return hit[1]

    def release_weights(self) -> None:
        """Free the device copies of weights (cuda)."""
        self._weights.clear()


class DeviceArray:
    """A device copy of a numpy array, freed with the object (kd_malloc / kd_free)."""

    def __init__(self, lib: NativeLibrary, a: np.ndarray, upload: bool = True):
        self.lib, self.shape, self.dtype, self.nbytes = lib, a.shape, a.dtype, a.nbytes
        p = lib.ffi.new("void **")
        lib.check(lib.c.kd_malloc(p, max(self.nbytes, 1)), "kd_malloc")
        self.addr = int(lib.ffi.cast("uintptr_t", p[0]))
        if upload and self.nbytes:
            lib.check(lib.c.kd_memcpy_h2d(p[0], lib.ffi.cast("void *", a.ctypes.data), self.nbytes, lib.ffi.NULL),
                      "kd_memcpy_h2d")

    def download(self, out: np.ndarray) -> np.ndarray:
        lib = self.lib
        if self.nbytes:
            lib.check(lib.c.kd_memcpy_d2h(lib.ffi.cast("void *", out.ctypes.data), lib.ffi.cast("void *", self.addr),
                                          self.nbytes, lib.ffi.NULL), "kd_memcpy_d2h")
        return out

    def __del__(self):
        if getattr(self, "addr", 0):
            self.lib.c.kd_free(self.lib.ffi.cast("void *", self.addr))
            self.addr = 0


def _max_nodes(depth: int, width: int, budget: int) -> int:
    """min(budget, number of nodes in the full width-ary tree of `depth` levels)."""
    total, level = 0, 1
    for _ in range(depth):
        level *= width
        total += level
        if total >= budget:
            return int(budget)
    return int(min(budget, total))


_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _int4_parts(w: Any) -> Optional[Tuple[np.ndarray, np.ndarray, int, int]]:
    """(packed i32[out, in/8], scale [out, in/group], in_features, group) of a quantized weight
    (kdtree.quant.int4.Int4Weight: .packed, .scale_held, .shape, .group_size), else None. The scale is as held:
    BF16 bits (uint16), else float32."""
    if isinstance(w, np.ndarray) or not hasattr(w, "packed"):
        return None
    packed = np.ascontiguousarray(w.packed, np.int32)
    return packed, w.scale_held, int(w.shape[1]), int(w.group_size)


class NativeOps(Ops):
    """The Ops interface on the native library: backend=cpu (host) or backend=cuda (device copies)."""

    def __init__(self, kind: str = "cpu", path: str = ""):
        self.lib = load_library(kind, path)
        self.name = kind
        # backend=cpu hot path: host arrays straight to the C op through cached cffi handles; only the cheap
        # checks the C op cannot make (dtype, contiguity, agreeing shapes) and anything unusual falls back to
        # the fully checked NativeLibrary wrappers (same C op, same result)
        self._host = kind == "cpu"
        ffi = self.lib.ffi
        self._c, self._null = self.lib.c, ffi.NULL
        self._fb_raw, self._f32a = ffi._backend.from_buffer, ffi.typeof("float[]")   # skips ffi's str parsing
        self._i32a, self._u64a = ffi.typeof("int32_t[]"), ffi.typeof("uint64_t[]")
        self._u16a = ffi.typeof("uint16_t[]")
        self._head_linear = self._c.kd_head_linear_f32
        self.has_head_linear = self._host
        self._moe_tables: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        # whole-model forwards in one library call (cpu: kd_forward.c; cuda: kd_forward.cu, on a device only):
        # build_target / build_drafter (kdtree/model/target.py) then pick NativeTarget / NativeDrafter. False = K2Model
        # / DFlashDrafter over these ops, the per-op path (same kernels; backend.drafter_forward=per_op sets it for
        # the drafter).
        runs = self._host or self.lib.device_count > 0
        self.native_forward = hasattr(self._c, "kd_model_forward") and runs
        self.native_drafter_forward = hasattr(self._c, "kd_drafter_create") and runs

    def linear(self, x: np.ndarray, w: Any) -> np.ndarray:
        if self._host and type(w) is np.ndarray and w.dtype == _F32 and w.ndim == 2 and w.flags.c_contiguous:
            x = np.ascontiguousarray(x, _F32)
            if x.ndim == 2 and x.shape[1] == w.shape[1]:
                T, n_in = x.shape
                out = np.empty((T, w.shape[0]), _F32)
                fb, fa = self._fb_raw, self._f32a
                rc = self._c.kd_linear_f32(fb(fa, x, False), fb(fa, w, False), fb(fa, out, False), T, n_in,
                                           w.shape[0], self._null)
                if rc:
                    self.lib.check(rc, "kd_linear_f32")
                return out
        x = np.ascontiguousarray(x, np.float32)
        if isinstance(w, np.ndarray) and w.dtype == np.uint16:   # BF16 bits (load_checkpoint(bf16=True))
            return self.lib.linear_bf16(x, np.ascontiguousarray(w))
        if isinstance(w, np.ndarray):
            return self.lib.linear_f32(x, np.ascontiguousarray(w, np.float32))
        parts = _int4_parts(w)
        if self._host and parts is not None:
            packed, scale, n_in, group = parts
            n_out = packed.shape[0]
            if (x.ndim == 2 and x.shape[1] == n_in and group > 0 and packed.shape[1] == (n_in + 7) // 8
                    and scale.shape == (n_out, (n_in + group - 1) // group)):
                out = np.empty((x.shape[0], n_out), _F32)
                fb = self._fb_raw
                if scale.dtype == np.uint16:            # BF16 scales, as the checkpoint holds them
                    fn, sp = "kd_linear_w4a16_bf16_scales", fb(self._u16a, scale, False)
                else:
                    fn, sp = "kd_linear_w4a16", fb(self._f32a, scale, False)
                rc = getattr(self._c, fn)(fb(self._f32a, x, False), fb(self._i32a, packed, False), sp,
                                          fb(self._f32a, out, False), x.shape[0], n_in, n_out, group, self._null)
                if rc:
                    self.lib.check(rc, fn)
                return out
        if parts is None:
            raise NativeError(f"linear: weight of type {type(w).__name__} is neither a float32 ndarray nor an "
                              f"Int4Weight")
        packed, scale, n_in, group = parts
        return self.lib.linear_w4a16(x, packed, scale, n_in, group)

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        if self._host and type(w) is np.ndarray and w.dtype == _F32 and w.ndim == 1 and w.flags.c_contiguous:
            x = np.ascontiguousarray(x, _F32)
            if x.ndim == 2 and x.shape[1] == w.shape[0] and x.shape[1] > 0:
                out = np.empty(x.shape, _F32)
                fb, fa = self._fb_raw, self._f32a
                rc = self._c.kd_rms_norm(fb(fa, x, False), fb(fa, w, False), fb(fa, out, False), x.shape[0],
                                         x.shape[1], float(eps), self._null)
                if rc:
                    self.lib.check(rc, "kd_rms_norm")
                return out
        return self.lib.rms_norm(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32), eps)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self._host:
            gate, up = np.ascontiguousarray(gate, _F32), np.ascontiguousarray(up, _F32)
            if gate.ndim == 2 and gate.shape == up.shape:
                out = np.empty(gate.shape, _F32)
                fb, fa = self._fb_raw, self._f32a
                rc = self._c.kd_silu_mul(fb(fa, gate, False), fb(fa, up, False), fb(fa, out, False), gate.shape[0],
                                         gate.shape[1], self._null)
                if rc:
                    self.lib.check(rc, "kd_silu_mul")
                return out
        return self.lib.silu_mul(np.ascontiguousarray(gate, np.float32), np.ascontiguousarray(up, np.float32))

    def moe(self, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, layer: Any) -> Optional[np.ndarray]:
        """Fused MoE layer (kd_moe_f32, one C call) on backend=cpu with float32 expert weights; None otherwise (the
        caller then runs the grouped path, same bits). layer: .experts[e].{gate,up,down}, .shared (or None)."""
        if not self._host:
            return None
        tables = self._moe_tables.get(layer, False) if _weakrefable(layer) else None
        if tables is False:
            tables = self._moe_tables[layer] = self._build_moe_tables(layer)
        if tables is None:
            return None
        x = np.ascontiguousarray(x, _F32)
        experts = np.ascontiguousarray(experts, np.int32)
        weights = np.ascontiguousarray(weights, _F32)
        T, D = x.shape
        if D != tables["D"] or experts.shape != weights.shape or experts.ndim != 2 or experts.shape[0] != T:
            return None
        out = np.empty((T, D), _F32)
        fb, fa = self._fb_raw, self._f32a
        rc = self._c.kd_moe_f32(fb(fa, x, False), fb(self._i32a, experts, False), fb(fa, weights, False),
                                tables["gate"], tables["up"], tables["down"], tables["E"], *tables["shared"],
                                fb(fa, out, False), T, D, tables["I"], tables["Is"], experts.shape[1], self._null)
        if rc:
            self.lib.check(rc, "kd_moe_f32")
        return out

    def head_linear(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
        """out[t, h] = w[h] @ x[t, h] (kd_head_linear_f32) on backend=cpu; False (nothing written) otherwise.
        x f32[T, H, in] and out f32[T, H, out] may be views whose last axis is contiguous; w f32[H, out, in]."""
        if not self._host:
            return False
        T, H, n_in = x.shape
        n_out = w.shape[1]
        if (x.dtype != _F32 or out.dtype != _F32 or type(w) is not np.ndarray or w.dtype != _F32
                or not w.flags.c_contiguous or w.shape != (H, n_out, n_in) or out.shape != (T, H, n_out)
                or x.strides[2] != 4 or out.strides[2] != 4 or min(x.strides + out.strides) < 0
                or any(s % 4 for s in x.strides + out.strides)):
            return False
        c = self.lib.ffi.cast
        rc = self._head_linear(c("float *", x.__array_interface__["data"][0]), x.strides[0] // 4, x.strides[1] // 4,
                               self._fb_raw(self._f32a, w, False), c("float *", out.__array_interface__["data"][0]),
                               out.strides[0] // 4, out.strides[1] // 4, T, H, n_in, n_out, self._null)
        if rc:
            self.lib.check(rc, "kd_head_linear_f32")
        return True

    def _build_moe_tables(self, layer: Any) -> Optional[Dict[str, Any]]:
        """Pointer tables of one MoE layer's expert weights (kept alive with the layer), or None when the fused op
        does not apply (a non-float32 weight, mismatched shapes)."""
        mats = [(m.gate, m.up, m.down) for m in layer.experts]
        if layer.shared is not None:
            mats.append((layer.shared.gate, layer.shared.up, layer.shared.down))
        if not mats:
            return None
        for g, u, d in mats:
            for w in (g, u, d):
                if type(w) is not np.ndarray or w.dtype != _F32 or w.ndim != 2 or not w.flags.c_contiguous:
                    return None
            if g.shape != u.shape or d.shape != (g.shape[1], g.shape[0]):
                return None
        D = mats[0][0].shape[1]
        routed = mats[:len(layer.experts)]
        I = routed[0][0].shape[0] if routed else 0
        if any(g.shape != (I, D) for g, _, _ in routed):
            return None
        ffi = self.lib.ffi
        keep = []

        def p(w):
            c = self._fb_raw(self._f32a, w, False)
            keep.append(c)
            return c

        tab = {name: ffi.new("float *[]", [p(m[i]) for m in routed] or [ffi.NULL])
               for i, name in enumerate(("gate", "up", "down"))}
        if layer.shared is not None:
            g, u, d = mats[-1]
            if g.shape[1] != D:
                return None
            tab["shared"], tab["Is"] = (p(g), p(u), p(d)), g.shape[0]
        else:
            tab["shared"], tab["Is"] = (ffi.NULL, ffi.NULL, ffi.NULL), 0
        tab.update(E=len(routed), D=D, I=I, keep=keep)
        return tab

    def mla_attention(self, q, kv, n_prefix, visibility, scale, kv_lora):
        if self._host:
            q, kv = np.ascontiguousarray(q, _F32), np.ascontiguousarray(kv, _F32)
            vis = None if visibility is None else np.ascontiguousarray(visibility, np.uint64)
            if q.ndim == 3 and kv.ndim == 2:
                T, H, E = q.shape
                L, n_prefix = int(kv_lora), int(n_prefix)
                if (kv.shape == (n_prefix + T, E) and 0 <= L <= E
                        and (vis is None or vis.shape == (T, (T + 63) // 64))):
                    out = np.empty((T, H, L), _F32)
                    fb, fa = self._fb_raw, self._f32a
                    rc = self._c.kd_mla_attention(fb(fa, q, False), fb(fa, kv, False),
                                                  self._null if vis is None else fb(self._u64a, vis, False),
                                                  fb(fa, out, False), T, H, L, E - L, n_prefix, float(scale),
                                                  self._null)
                    if rc:
                        self.lib.check(rc, "kd_mla_attention")
                    return out
        vis = None if visibility is None else np.ascontiguousarray(visibility, np.uint64)
        return self.lib.mla_attention(np.ascontiguousarray(q, np.float32), np.ascontiguousarray(kv, np.float32),
                                      int(n_prefix), vis, scale, kv_lora)

    def draft_topk(self, logits, width):
        return self.lib.draft_topk(np.asarray(logits), width)

    def tree_build(self, logp, ids, budget):
        tree = self.lib.tree_build_fast(logp, ids, budget)
        if tree is not None:
            return tree
        return self.lib.tree_build(np.ascontiguousarray(logp, np.float32), np.ascontiguousarray(ids, np.int32),
                                   int(budget))

    def tree_accept(self, parents, tokens, target_argmax):
        return self.lib.tree_accept(*(a if type(a) is np.ndarray and a.dtype == _I32 and a.flags.c_contiguous
                                      else np.ascontiguousarray(a, np.int32) for a in (parents, tokens, target_argmax)))

    def token_bitmask_apply(self, logits, bitmask):
        return self.lib.token_bitmask_apply(logits, bitmask)

    def masked_argmax(self, logits, bitmask):
        return self.lib.masked_argmax(logits, bitmask)


def set_loaded_threads(n: int) -> Optional[int]:
    """kd_set_threads(n) on every CPU library this process has loaded; the threads a region now uses, or None when
    none is loaded (bench_peer's thread limit)."""
    got = None
    for lib in list(_LIBS.values()):
        if lib.kind == "cpu":
            got = lib.set_threads(n)
    return got


def auto_threads(backend_cfg: Any, tp: int = 1, serving: bool = False) -> int:
    """The OpenMP threads of this process's native forward. An explicit backend.threads wins; 0 (auto) means
    OMP_NUM_THREADS if set (the tp launcher sets it for ranks 1..N-1), else this process's cores / tp (the ranks
    share the host), less one when the process also serves HTTP: uvicorn's event loop, tokenizing and the SSE
    events need a core (on the 2-core VM a server whose forward took both cores streamed one request 1.4-2x
    slower, and 16 clients no faster). At least 1."""
    n = 0 if isinstance(backend_cfg, str) else int(getattr(backend_cfg, "threads", 0) or 0)
    if n > 0:
        return n
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(tp)) - (1 if serving else 0))


def make_ops(kind: str, backend_cfg: Any) -> Ops:
    """backend=cpu|cuda from config: a missing library or (cuda) a missing device is a ConfigError (one line)."""
    path = "" if isinstance(backend_cfg, str) else str(getattr(backend_cfg, "library", "") or "")
    try:
        ops = NativeOps(kind, path)
    except NativeError as e:
        raise ConfigError(f"backend={kind} (backend.library={path or '<default>'}): {e}; or use "
                          f"backend=numpy") from None
    if kind == "cuda" and ops.lib.device_count == 0:
        raise ConfigError(f"backend=cuda: no CUDA device ({ops.lib.device_reason}); use backend=cpu or "
                          f"backend=numpy")
    threads = getattr(backend_cfg, "threads", 0) if not isinstance(backend_cfg, str) else 0
    try:
        threads = int(threads or 0)
    except (TypeError, ValueError):
        threads = -1
    if threads < 0:
        raise ConfigError(f"backend.threads={getattr(backend_cfg, 'threads', None)!r} must be an integer >= 0 "
                          f"(0 = every core, or OMP_NUM_THREADS); e.g. backend.threads=4")
    ops.lib.set_threads(threads)
    mode = "native" if isinstance(backend_cfg, str) else str(getattr(backend_cfg, "drafter_forward", "") or "native")
    if mode not in ("native", "per_op"):
        raise ConfigError(f"backend.drafter_forward={mode!r}; use native (one library call per drafter extend / "
                          f"draft) or per_op (one call per op)")
    if mode == "per_op":
        ops.native_drafter_forward = False
    return ops


__all__ = ["ABI_VERSION", "auto_threads", "set_loaded_threads", "NativeLibrary", "NativeOps", "DeviceArray", "load_library", "library_info", "cuda_device_count", "make_ops",
           "library_path"]
