"""The K2 target's whole forward in one library call (native/src/cpu/kd_forward.c, native/src/cuda/kd_forward.cu).

backend=cpu|cuda: NativeTarget hands the checkpoint's tensors to the library once (pointers into the loaded arrays,
kept alive by the target; INT4 stays packed), and each forward is then ONE C call. The library owns the latent
caches (a pool of slots, one per sequence) and grow-only scratch. Python keeps the decode loop. The drafter's twin
is kdtree/backends/native_drafter.py; build_target / build_drafter (kdtree/model/target.py) choose them.

    target = NativeTarget(cfg, weights, ops)             # registers the weights
    cache = target.new_cache(max_len)                    # a slot of the native pool (LatentCache interface)
    logits, hiddens = target.forward(tokens, positions, cache, visibility, hidden_layers)

The ABI takes rows of several sequences per forward (kd_forward_args: slots + row_start, block-diagonal
visibility). LIBRARY_CLOCK.seconds accumulates the wall time spent inside these calls (and the tree ops) so the
bench can report the share of decode time spent outside the library.
"""
from __future__ import annotations

import os
import time
import weakref
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from kdtree.errors import CachePoolBusy, ConfigError, NativeError
from kdtree.model.derived import (as_f32, check_context, embed_weight, is_bf16, lm_head_weight, rope_mscale,
                                  route_params,
                                  router_weights, softmax_scale, split_kv_b, transposed_w_uk, weight_getter,
                                  yarn_inv_freq)
from kdtree.model.names import is_moe_layer
from kdtree.tree import causal_visibility

_F32 = np.dtype(np.float32)


class LibraryClock:
    """Seconds spent inside native forward / draft / tree calls of this process (read as a difference);
    collective_seconds: the part of them spent back in Python, in the tensor-parallel all-reduce callbacks."""

    seconds = 0.0
    collective_seconds = 0.0


LIBRARY_CLOCK = LibraryClock()


def keeps_bf16(ops: Any) -> bool:
    """Whether these ops' target takes BF16 tensors as they are stored (load_checkpoint(bf16=True)): backend=cpu's
    native forward widens BF16 weights exactly in its kernels (kd_linear_bf16: the float32 path's bits), so they
    stay uint16 in memory, half the bytes held and streamed per token (W_uk / W_uv, the router and the norms are
    still widened copies: small). backend=numpy (the reference) and
    backend=cuda (which keeps exact-BF16 float32 tensors as BF16 on the device at upload) load them widened."""
    lib = getattr(ops, "lib", None)
    # the drafter shares the target's embed / lm_head: both must be native (backend.drafter_forward=per_op runs the
    # numpy-formula drafter over the ops, which takes float32 tensors)
    return (bool(getattr(ops, "native_forward", False)) and bool(getattr(ops, "native_drafter_forward", False))
            and getattr(lib, "kind", "") == "cpu")


def supports(w: Any) -> bool:
    """A weight the native forward takes as is: a float32 or BF16 (uint16 bits) 2-D ndarray or a packed
    Int4Weight."""
    if isinstance(w, np.ndarray):
        return w.dtype in (_F32, np.dtype(np.uint16)) and w.ndim == 2
    return hasattr(w, "packed") and hasattr(w, "scale") and hasattr(w, "group_size")


class _Registry:
    """Pointers handed to C, and the arrays/cdata they point into, kept alive together."""

    def __init__(self, lib):
        self.lib, self.ffi = lib, lib.ffi
        self.keep: List[Any] = []
        self.bytes: Dict[str, Tuple[int, int]] = {}   # weight name -> (bytes held, elements): weight_bytes()

    def ptr(self, a: np.ndarray, ctype: str = "float[]"):
        a = np.ascontiguousarray(a)
        c = self.ffi.from_buffer(ctype, a)
        self.keep += [a, c]
        return c

    def vec(self, a: Any):
        """A 1-D float32 vector (norm weights, router bias; BF16 bits widened)."""
        return self.ptr(np.ascontiguousarray(as_f32(a).reshape(-1)))

    def table(self, dst, name: str, a: np.ndarray) -> None:
        """An embedding table [V, D]: dst.<name>_bf16 for BF16 bits, else dst.<name> as float32."""
        if is_bf16(a):
            setattr(dst, f"{name}_bf16", self.ptr(a, "uint16_t[]"))
        else:
            setattr(dst, name, self.ptr(np.ascontiguousarray(a, np.float32)))

    def weight(self, dst, w: Any, name: str) -> None:
        """Fill a kd_weight from a float32 or BF16 (uint16 bits) [out, in] ndarray or an Int4Weight."""
        if isinstance(w, np.ndarray):
            if w.ndim != 2:
                raise NativeError(f"{name}: expected a 2-D weight, got shape {w.shape}")
            if is_bf16(w):
                dst.bf16 = self.ptr(w, "uint16_t[]")
                dst.n_out, dst.n_in = w.shape
                self.bytes[name] = (int(w.nbytes), int(w.size))
                return
            w = np.ascontiguousarray(w, np.float32)
            dst.f32 = self.ptr(w)
            dst.n_out, dst.n_in = w.shape
            self.bytes[name] = (int(w.nbytes), int(w.size))
            return
        if not supports(w):
            raise NativeError(f"{name}: weight of type {type(w).__name__} is neither a float32 ndarray nor an "
                              f"Int4Weight")
        dst.packed = self.ptr(np.ascontiguousarray(w.packed, np.int32), "int32_t[]")
        dst.scales = self.ptr(np.ascontiguousarray(w.scale, np.float32))
        dst.n_out, dst.n_in = int(w.shape[0]), int(w.shape[1])
        dst.group = int(w.group_size)
        self.bytes[name] = (int(self.keep[-4].nbytes + self.keep[-2].nbytes),   # packed + scales as held
                            int(w.shape[0]) * int(w.shape[1]))

    def mlp(self, dst, m: Any, name: str) -> None:
        self.weight(dst.gate, m.gate, f"{name}.gate_proj")
        self.weight(dst.up, m.up, f"{name}.up_proj")
        self.weight(dst.down, m.down, f"{name}.down_proj")


def _mlp_weights(w: Callable[[str], Any], p: str) -> SimpleNamespace:
    """gate/up/down of the MLP at prefix p (a dense MLP, a routed expert or the shared expert)."""
    return SimpleNamespace(gate=w(f"{p}.gate_proj.weight"), up=w(f"{p}.up_proj.weight"),
                           down=w(f"{p}.down_proj.weight"))


def nccl_library_path() -> str:
    """libnccl.so.2 for kd_model_set_nccl: $KDTREE_NCCL_LIB, else the nvidia-nccl wheel's copy (what torch loads),
    else "" (the C side then dlopens "libnccl.so.2", found if torch has loaded it or the loader's path has it)."""
    env = os.environ.get("KDTREE_NCCL_LIB", "")
    if env:
        return env
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("nccl/lib/libnccl.so.2", "nccl/lib/libnccl.so"):
            p = os.path.join(base, sub)
            if os.path.exists(p):
                return p
    return ""


def attach_nccl(lib, handle, world: int, rank: int, strict: bool) -> bool:
    """Every rank of the torch.distributed group: move the CUDA forward's all-reduce onto its stream
    (kd_nccl_unique_id on each rank to check that NCCL loads, rank 0's id to all, kd_model_set_nccl, and the group
    agrees at each step so that no rank waits in a collective the others skipped). True when set; on any failure
    every rank keeps the host all-reduce (said once on stderr), or with `strict` (tp.collective=nccl) raises."""
    import sys
    import torch.distributed as dist
    ffi = lib.ffi
    path = nccl_library_path()
    cpath = ffi.new("char[]", path.encode())
    buf = ffi.new("uint8_t[128]")
    ok = lib.c.kd_nccl_unique_id(cpath, buf) == 0
    got: List[Any] = [None] * world
    mine = bytes(ffi.buffer(buf)) if ok and rank == 0 else b""
    dist.all_gather_object(got, (ok, mine, "" if ok else lib.last_error()))
    bad = [(r, why) for r, (o, _, why) in enumerate(got) if not o]
    if not bad:
        uid = ffi.new("uint8_t[128]", list(got[0][1]))
        ok = lib.c.kd_model_set_nccl(handle, cpath, uid, world, rank) == 0
        dist.all_gather_object(got, (ok, b"", "" if ok else lib.last_error()))
        bad = [(r, why) for r, (o, _, why) in enumerate(got) if not o]
        if bad and ok:
            lib.c.kd_model_set_nccl(handle, cpath, ffi.NULL, 0, 0)   # back to the host all-reduce, as the others
    if not bad:
        return True
    r, why = bad[0]
    if strict:
        raise NativeError(f"tp.collective=nccl: rank {r} could not set up NCCL on the stream: {why}; use "
                          f"tp.collective=host")
    if rank == 0:
        print(f"kdtree: tp.collective=auto: NCCL on the forward's stream failed on rank {r} ({why}); every rank "
              f"all-reduces through the host instead (no CUDA graphs)", file=sys.stderr, flush=True)
    return False


KD_ENOMEM = -4   # kdtree.h: allocation failed (here: the reserved pool has no free range now)


def _free_slot(owner, free, slot: int) -> None:
    free(owner.handle, slot)


def _timed(fn, *args) -> int:
    t0 = time.perf_counter()
    rc = fn(*args)
    LIBRARY_CLOCK.seconds += time.perf_counter() - t0
    return rc


class NativeLatentCache:
    """A slot of the target's native latent-cache pool, with LatentCache's interface (length, max_len, kv,
    truncate, keep). Freed with the object."""

    def __init__(self, target: "NativeTarget", max_len: int):
        self.target, self.max_len = target, int(max_len)
        lib = target.lib
        p = lib.ffi.new("int64_t *")
        rc = lib.c.kd_cache_alloc(target.handle, self.max_len, p)
        if rc == KD_ENOMEM and target.pool_rows:          # the reserved pool is full for now, not the machine
            raise CachePoolBusy(f"kd_cache_alloc ({lib.kind}): {lib.last_error()}")
        lib.check(rc, "kd_cache_alloc")
        self.slot = int(p[0])
        self._len = lib.ffi.new("int64_t *")
        self._kv: Optional[List[np.ndarray]] = None
        target.__dict__.setdefault("_live_caches", weakref.WeakSet()).add(self)    # compact_pool drops their views
        # the finalizer holds the target, so the model is never destroyed before its cache slots are freed
        self._finalizer = weakref.finalize(self, _free_slot, target, lib.c.kd_cache_free, self.slot)

    def release(self) -> None:
        """Give the slot's rows back now (a finished request), not when the object is collected. Idempotent;
        the cache is unusable afterwards."""
        self._kv = None
        self._finalizer()

    @property
    def length(self) -> int:
        lib = self.target.lib
        lib.check(lib.c.kd_cache_length(self.target.handle, self.slot, self._len), "kd_cache_length")
        return int(self._len[0])

    @property
    def kv(self) -> List[np.ndarray]:
        """Per layer f32[max_len, kv_lora + rope] views of the native rows (valid while this cache lives)."""
        if self._kv is None:
            lib, t = self.target.lib, self.target
            p = lib.ffi.new("float **")
            views = []
            for layer in range(t.n_layers):
                lib.check(lib.c.kd_cache_rows(t.handle, self.slot, layer, p), "kd_cache_rows")
                if lib.kind == "cuda":   # device rows: a host copy, taken now (not a live view)
                    rows = np.empty((self.max_len, t.width), np.float32)
                    lib.check(lib.c.kd_memcpy_d2h(lib.ffi.from_buffer(rows), p[0], rows.nbytes, lib.ffi.NULL),
                              "kd_memcpy_d2h")
                    views.append(rows)
                    continue
                buf = lib.ffi.buffer(p[0], self.max_len * t.width * 4)
                views.append(np.frombuffer(buf, np.float32).reshape(self.max_len, t.width))
            if lib.kind == "cuda":
                return views
            self._kv = views
        return self._kv

    def truncate(self, n: int) -> None:
        """Drop rows [n, length) (a rejected verify block)."""
        length = self.length
        if not 0 <= n <= length:
            raise ValueError(f"truncate({n}) outside [0, {length}]")
        lib = self.target.lib
        lib.check(lib.c.kd_cache_truncate(self.target.handle, self.slot, int(n)), "kd_cache_truncate")

    def keep(self, start: int, rows: Iterable[int]) -> None:
        """Keep block rows `rows` (absolute, ascending, >= start) moved contiguously to start..; drop the rest."""
        rows = np.ascontiguousarray(list(rows) if not isinstance(rows, np.ndarray) else rows, dtype=np.int64)
        lib = self.target.lib
        rc = lib.c.kd_cache_keep(self.target.handle, self.slot, int(start), lib.ffi.from_buffer("int64_t[]", rows),
                                 rows.size)
        if rc:   # the library names what is wrong (bad rows, a freed slot, ...); do not guess
            raise ValueError(f"keep(start={start}, rows={rows.tolist()}): {lib.last_error()}")

    def read_rows(self, start: int, n: int) -> np.ndarray:
        """Rows [start, start + n) of every layer, a host copy f32[n_layers, n, width] (kd_cache_rows)."""
        if not 0 <= start <= start + n <= self.length:
            raise ValueError(f"read_rows({start}, {n}) outside [0, {self.length})")
        return np.stack([kv[start:start + n] for kv in self.kv])

    def write_rows(self, start: int, rows: np.ndarray) -> None:
        """Write host rows f32[n_layers, n, width] at start (<= length); length = start + n (kd_cache_write_rows)."""
        rows = np.ascontiguousarray(rows, np.float32)
        lib = self.target.lib
        rc = lib.c.kd_cache_write_rows(self.target.handle, self.slot, int(start), lib.ffi.from_buffer("float[]", rows),
                                       int(rows.shape[1]))
        if rc:
            raise ValueError(f"write_rows(start={start}, {rows.shape[1]} rows): {lib.last_error()}")


class NativeTarget:
    """A K2 target whose forward is ONE kd_model_forward call: the checkpoint's tensors (by kdtree/model/names.py's
    names) registered with the library, INT4 kept packed; the derived ones (W_uk^T / W_uv, YaRN, softmax scale,
    routing) from kdtree/model/derived.py, the same functions K2Model calls. The Target protocol
    (kdtree/model/target.py); build_target picks it for backend=cpu, and backend=cuda on a device.

    target = NativeTarget(cfg, weights, ops)             # ops: the NativeOps (decode's tree ops, the drafter's)
    cache = target.new_cache(max_len)                    # a slot of the native pool (LatentCache interface)
    logits, hiddens = target.forward(tokens, positions, cache, visibility, hidden_layers)
    """

    def __init__(self, cfg, weights: Mapping[str, Any], ops: Any,
                 all_reduce: Optional[Callable[[np.ndarray], np.ndarray]] = None):
        lib = ops.lib
        self.lib, self.cfg, self.ops, self.all_reduce = lib, cfg, ops, all_reduce
        self.return_logits = True   # False on tensor-parallel ranks 1..N-1: rank 0 alone needs the logits
        ffi = lib.ffi
        reg = self._reg = _Registry(lib)
        w = weight_getter(cfg, weights)
        self.n_layers = int(cfg.num_hidden_layers)
        self.width = int(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.embed_tokens = embed_weight(weights, w)                                    # [V, D]
        self.lm_head_w = lm_head_weight(cfg, weights, self.embed_tokens)               # a drafter shares both
        self.vocab, self.hidden = int(self.embed_tokens.shape[0]), int(self.embed_tokens.shape[1])
        d = self._desc = ffi.new("kd_model_desc *")
        d.vocab, d.hidden, d.n_layers = self.vocab, self.hidden, self.n_layers
        d.kv_lora, d.rope_dim = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
        d.nope, d.v_head = int(cfg.qk_nope_head_dim), int(cfg.v_head_dim)
        rc = route_params(cfg)
        d.n_experts, d.top_k = int(cfg.n_routed_experts or 0), rc.num_experts_per_tok
        d.n_group, d.topk_group = max(rc.n_group, 1), max(rc.topk_group, 1)
        d.norm_topk_prob, d.routed_scale = int(rc.norm_topk_prob), rc.routed_scaling_factor
        d.eps, d.attn_scale = float(cfg.rms_norm_eps), float(softmax_scale(cfg))
        d.inv_freq = reg.ptr(np.ascontiguousarray(yarn_inv_freq(cfg), np.float64), "double[]")
        d.rope_mscale = float(rope_mscale(cfg))
        reg.table(d, "embed", self.embed_tokens)
        d.final_norm = reg.vec(w("model.norm.weight"))
        reg.weight(d.lm_head, self.lm_head_w, "lm_head")
        layers = ffi.new("kd_layer[]", self.n_layers)
        reg.keep.append(layers)
        for i in range(self.n_layers):
            ly, p = layers[i], f"model.layers.{i}"
            a = f"{p}.self_attn"
            ly.in_norm = reg.vec(w(f"{p}.input_layernorm.weight"))
            ly.post_norm = reg.vec(w(f"{p}.post_attention_layernorm.weight"))
            reg.weight(ly.q_a, w(f"{a}.q_a_proj.weight"), f"{a}.q_a_proj")
            ly.q_a_norm = reg.vec(w(f"{a}.q_a_layernorm.weight"))
            reg.weight(ly.q_b, w(f"{a}.q_b_proj.weight"), f"{a}.q_b_proj")
            reg.weight(ly.kv_a, w(f"{a}.kv_a_proj_with_mqa.weight"), f"{a}.kv_a_proj_with_mqa")
            ly.kv_a_norm = reg.vec(w(f"{a}.kv_a_layernorm.weight"))
            heads, w_uk, w_uv = split_kv_b(cfg, w, i)
            ly.w_uk_t, ly.w_uv = reg.ptr(transposed_w_uk(w_uk)), reg.ptr(w_uv)
            for key, arr in ((f"{a}.w_uk", reg.keep[-4]), (f"{a}.w_uv", reg.keep[-2])):
                reg.bytes[key] = (int(arr.nbytes), int(arr.size))
            reg.weight(ly.o, w(f"{a}.o_proj.weight"), f"{a}.o_proj")
            ly.heads = heads
            if not is_moe_layer(cfg, i):
                ly.is_moe = 0
                reg.mlp(ly.mlp, _mlp_weights(w, f"{p}.mlp"), f"{p}.mlp")
                continue
            ly.is_moe = 1
            gate, bias = router_weights(w, i)
            ly.router, ly.router_bias = reg.ptr(np.ascontiguousarray(gate, np.float32)), reg.vec(bias)
            reg.bytes[f"{p}.mlp.gate"] = (int(reg.keep[-4].nbytes), int(reg.keep[-4].size))
            experts = ffi.new("kd_mlp[]", int(cfg.n_routed_experts))
            reg.keep.append(experts)
            for e in range(int(cfg.n_routed_experts)):
                reg.mlp(experts[e], _mlp_weights(w, f"{p}.mlp.experts.{e}"), f"{p}.mlp.experts.{e}")
            ly.experts = experts
            if cfg.n_shared_experts:
                ly.has_shared = 1
                reg.mlp(ly.shared, _mlp_weights(w, f"{p}.mlp.shared_experts"), f"{p}.mlp.shared_experts")
        d.layers = layers
        if all_reduce is not None:
            # tensor parallel: the C forward calls back into the ordered all-reduce between layer halves
            def _all_reduce(x, n, _ctx):
                t0 = time.perf_counter()
                buf = np.frombuffer(ffi.buffer(x, n * 4), np.float32)
                buf[:] = all_reduce(buf)
                LIBRARY_CLOCK.collective_seconds += time.perf_counter() - t0
                return 0

            cb = ffi.callback("int(float *, int64_t, void *)", _all_reduce, error=-1)
            reg.keep.append(cb)   # the callback object itself: the struct field alone does not keep it alive
            d.all_reduce = cb
        h = ffi.new("kd_model **")
        lib.check(lib.c.kd_model_create(d, h), "kd_model_create")
        self.handle = h[0]
        weakref.finalize(self, lib.c.kd_model_destroy, self.handle)
        # backend=cuda under tp: the all-reduce on the forward's stream (NCCL) instead of the callback above, set up
        # by attach_device_collective once every rank has loaded (its setup is a collective; see there)
        self.device_collective = False
        ar = all_reduce
        self._nccl = ((ar.world, ar.rank, ar.strict) if lib.kind == "cuda" and ar is not None
                      and getattr(ar, "collective", "host") == "nccl" else None)
        # reused per call: one argument block, one slot, one row range (one sequence per forward today)
        self._args = ffi.new("kd_forward_args *")
        self._seq = np.zeros(3, np.int64)                               # [slot, row_start 0, row_start 1]
        self._seq_c = ffi.from_buffer("int64_t[]", self._seq)
        self._args.n_seqs = 1
        self._args.slots = self._seq_c
        self._args.row_start = self._seq_c + 1
        self._fb = ffi._backend.from_buffer
        self._types = {k: ffi.typeof(f"{k}[]") for k in ("float", "int32_t", "int64_t", "uint64_t")}
        self._fwd = lib.c.kd_model_forward

    def attach_device_collective(self) -> bool:
        """backend=cuda, tp.collective=auto|nccl: move the all-reduce onto the forward's stream (attach_nccl); True
        when it is there. A collective, so every rank calls it at the same point: after ALL ranks have loaded
        (launch_tp), not when this one has. On a large checkpoint ranks finish loading minutes apart, and a rank that
        met the others here right after its own load would wait in the collective past tp.timeout_s. Once; later
        calls return the first answer."""
        if self._nccl is not None:
            world, rank, strict = self._nccl
            self._nccl = None
            self.device_collective = attach_nccl(self.lib, self.handle, world, rank, strict)
        return self.device_collective

    def new_cache(self, max_len: int) -> NativeLatentCache:
        check_context(self.cfg, max_len)
        return NativeLatentCache(self, max_len)

    pool_rows = 0   # rows of the reserved latent-cache pool (0: one allocation per cache)

    def reserve(self, rows: int) -> None:
        """One latent-cache arena of `rows` rows that every later cache is a row range of (kd_model_reserve);
        new_cache raises CachePoolBusy when no range is free. 0 = one allocation per cache again."""
        self.lib.check(self.lib.c.kd_model_reserve(self.handle, int(rows)), "kd_model_reserve")
        self.pool_rows = int(rows)

    def compact_pool(self) -> int:
        """Pack the arena's caches to its front (kd_model_compact: rows moved, caches unchanged otherwise), so its
        free rows are one range; returns their count. Between forwards only (the scheduler's admission)."""
        free = self.lib.ffi.new("int64_t *")
        self.lib.check(self.lib.c.kd_model_compact(self.handle, free), "kd_model_compact")
        for cache in list(getattr(self, "_live_caches", ())):
            cache._kv = None                              # views into the old rows
        return int(free[0])

    def reserve_cache_pool(self, rows: int) -> bool:
        """One latent-cache arena of `rows` rows that every later new_cache is carved from (a full pool raises
        CachePoolBusy); True. An arena still holding caches cannot be replaced: dropped caches are collected first;
        if some are alive, a larger arena is kept (the scheduler's accounting is exact either way) and a smaller
        one is an error naming the fix."""
        rows = int(rows)
        if self.pool_rows == rows:
            return True
        try:
            self.reserve(rows)
        except NativeError:
            import gc
            gc.collect()                                  # caches of finished generations not yet collected
            try:
                self.reserve(rows)
            except NativeError:
                if self.pool_rows < rows:
                    raise
        return True

    def set_graph_rows(self, rows: Iterable[int]) -> None:
        """backend=cuda: forwards of exactly these row counts are captured once as CUDA graphs and replayed
        (1 = an AR step, tree.budget + 1 = a verify); other counts launch eagerly. The CPU build ignores it."""
        r = np.ascontiguousarray(sorted({int(x) for x in rows}), np.int64)
        self.lib.check(self.lib.c.kd_model_set_graph_rows(self.handle, self.lib.ffi.from_buffer("int64_t[]", r),
                                                          r.size), "kd_model_set_graph_rows")

    def graph_rows(self, rows: Iterable[int]) -> bool:
        """backend=cuda: capture forwards of these row counts as CUDA graphs (set_graph_rows); True. False on the
        CPU build (nothing to capture)."""
        if self.lib.kind != "cuda":
            return False
        self.set_graph_rows(rows)
        return True

    def weight_bytes(self) -> Dict[str, Tuple[int, int]]:
        """{matrix name: (bytes the library holds and a forward that uses it streams, elements = multiply-adds
        per row)} for every linear (norms, biases and the embedding are not counted: a forward reads T of its rows)."""
        return dict(self._reg.bytes)

    def moe_stats(self, reset: bool = False) -> Dict[int, Dict[str, int]]:
        """{MoE layer: {forwards, experts, rows}} since the last reset: forwards of the layer, the distinct routed
        experts they used (summed: each forward streams the union of its rows' experts) and the rows. The CUDA
        build does not count (it routes on the device): {}."""
        st = self.lib.ffi.new("int64_t[]", 3 * self.n_layers)
        if self.lib.c.kd_model_moe_stats(self.handle, st, 1 if reset else 0):
            return {}
        return {i: {"forwards": int(st[3 * i]), "experts": int(st[3 * i + 1]), "rows": int(st[3 * i + 2])}
                for i in range(self.n_layers) if st[3 * i]}

    def graph_stats(self) -> Dict[str, float]:
        """{graphs, replays, eager, buckets, capture_s}: the CUDA graph counters (zeros on the CPU build)."""
        st, sec = self.lib.ffi.new("int64_t[4]"), self.lib.ffi.new("double *")
        self.lib.check(self.lib.c.kd_model_graph_stats(self.handle, st, sec), "kd_model_graph_stats")
        return {"graphs": int(st[0]), "replays": int(st[1]), "eager": int(st[2]), "buckets": int(st[3]),
                "capture_s": float(sec[0])}

    def close(self) -> None:
        """Nothing to do now: the library model is destroyed with this object, after its last cache."""

    def forward(self, tokens: np.ndarray, positions: np.ndarray, cache: NativeLatentCache,
                visibility: Optional[np.ndarray] = None, hidden_layers: Iterable[int] = ()
                ) -> Tuple[np.ndarray, Dict[int, np.ndarray]]:
        """K2Model.forward of one sequence in one library call: logits f32[T, V] (f32[T, 0] on tp ranks 1..N-1,
        return_logits False) and {layer: f32[T, D]} for the hidden_layers."""
        logits = self.return_logits
        if getattr(cache, "target", None) is not self:
            raise ValueError(f"forward: the cache ({type(cache).__name__}) was not made by this model's new_cache; "
                             f"use model.new_cache(max_len)")
        tokens = np.ascontiguousarray(tokens, np.int32)
        positions = np.ascontiguousarray(positions, np.int32)
        T = tokens.shape[0]
        if positions.shape != (T,):
            raise ValueError(f"positions shape {positions.shape} != tokens shape ({T},)")
        length = cache.length
        if length + T > cache.max_len:
            raise ConfigError(f"latent cache of {cache.max_len} rows cannot hold {length} + {T} tokens; "
                              f"create it with a larger max_len (prompt + max_new_tokens + tree budget)")
        if T == 0:
            return np.empty((0, self.vocab if logits else 0), np.float32), {}
        fb, ty = self._fb, self._types
        a = self._args
        if visibility is not None:
            visibility = np.ascontiguousarray(visibility, np.uint64)
            if visibility.shape != (T, (T + 63) // 64):
                raise ValueError(f"visibility shape {visibility.shape} != ({T}, {(T + 63) // 64})")
            a.visibility = fb(ty["uint64_t"], visibility, False)
        else:
            a.visibility = self.lib.ffi.NULL
        want = list(dict.fromkeys(int(i) for i in hidden_layers))
        D = self.hidden
        hid = np.empty((T, len(want) * D), np.float32) if want else None
        out = np.empty((T, self.vocab if logits else 0), np.float32)
        hl = np.asarray(want, np.int64)
        self._seq[0], self._seq[2] = cache.slot, T
        a.n_rows, a.tokens, a.positions = T, fb(ty["int32_t"], tokens, False), fb(ty["int32_t"], positions, False)
        a.n_out = T if logits else 0
        a.logits = fb(ty["float"], out, False) if logits else self.lib.ffi.NULL
        a.n_hidden = len(want)
        if want:
            a.hidden_layers, a.hidden = fb(ty["int64_t"], hl, False), fb(ty["float"], hid, False)
        rc = _timed(self._fwd, self.handle, a)
        if rc:
            self.lib.check(rc, "kd_model_forward")
        return out, {layer: hid[:, j * D:(j + 1) * D] for j, layer in enumerate(want)}


    def forward_batch(self, seqs: Sequence[Tuple[np.ndarray, np.ndarray, NativeLatentCache, Optional[np.ndarray]]],
                      hidden_layers: Iterable[int] = ()) -> Tuple[np.ndarray, np.ndarray, Dict[int, np.ndarray]]:
        """Rows of several sequences in ONE call: seqs = [(tokens i32[T_s], positions i32[T_s], cache, visibility
        u64[T_s, ceil(T_s/64)] | None = causal)], distinct caches. Each row sees its own cache and its own block's
        visible rows (block-diagonal), so its results equal its sequence's forward alone, bit for bit.
        Returns logits f32[N, V], argmax i32[N] and {layer: f32[N, D]}, rows in sequence order."""
        if not seqs:
            raise ValueError("forward_batch: no sequences; pass at least one (tokens, positions, cache, visibility)")
        toks, poss, vis, row_start, slots = [], [], [], [0], []
        for tokens, positions, cache, visibility in seqs:
            if getattr(cache, "target", None) is not self:
                raise ValueError(f"forward_batch: sequence {len(slots)}'s cache was not made by this model's "
                                 f"new_cache; use model.new_cache(max_len)")
            t = np.ascontiguousarray(tokens, np.int32)
            T = t.shape[0]
            if T == 0 or np.shape(positions) != (T,):
                raise ValueError(f"forward_batch: sequence {len(slots)} has tokens {t.shape}, positions "
                                 f"{np.shape(positions)}; expected [T] and [T] with T >= 1")
            if cache.length + T > cache.max_len:
                raise ConfigError(f"latent cache of {cache.max_len} rows cannot hold {cache.length} + {T} tokens; "
                                  f"create it with a larger max_len (prompt + max_new_tokens + tree budget)")
            v = causal_visibility(T) if visibility is None else np.ascontiguousarray(visibility, np.uint64)
            if v.shape != (T, (T + 63) // 64):
                raise ValueError(f"visibility shape {v.shape} != ({T}, {(T + 63) // 64})")
            toks.append(t), poss.append(np.asarray(positions, np.int32)), vis.append(v.reshape(-1))
            row_start.append(row_start[-1] + T), slots.append(cache.slot)
        N, D = row_start[-1], self.hidden
        want = list(dict.fromkeys(int(i) for i in hidden_layers))
        arrays = {"tokens": np.concatenate(toks), "positions": np.concatenate(poss),
                  "slots": np.asarray(slots, np.int64), "row_start": np.asarray(row_start, np.int64),
                  "visibility": np.concatenate(vis), "hidden_layers": np.asarray(want or [0], np.int64),
                  "logits": np.empty((N, self.vocab), np.float32), "argmax": np.empty(N, np.int32),
                  "hidden": np.empty((N, max(len(want), 1) * D), np.float32)}
        ctype = {np.dtype(np.int32): "int32_t[]", np.dtype(np.int64): "int64_t[]", np.dtype(np.uint64): "uint64_t[]",
                 _F32: "float[]"}
        c = {k: self.lib.ffi.from_buffer(ctype[v.dtype], v) for k, v in arrays.items()}
        a = self.lib.ffi.new("kd_forward_args *")
        a.n_rows, a.tokens, a.positions, a.n_seqs = N, c["tokens"], c["positions"], len(slots)
        a.slots, a.row_start, a.visibility = c["slots"], c["row_start"], c["visibility"]
        a.n_out, a.logits, a.argmax = N, c["logits"], c["argmax"]
        a.n_hidden, a.hidden_layers, a.hidden = len(want), c["hidden_layers"], c["hidden"]
        self.lib.check(_timed(self._fwd, self.handle, a), "kd_model_forward")
        hid = arrays["hidden"]
        return arrays["logits"], arrays["argmax"], {layer: hid[:, j * D:(j + 1) * D] for j, layer in enumerate(want)}


__all__ = ["LIBRARY_CLOCK", "NativeTarget", "NativeLatentCache", "keeps_bf16", "supports"]
