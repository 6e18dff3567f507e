"""The K2 target's whole forward in one library call (native/src/cpu/kd_forward.c, native/src/cuda/kd_forward.cu).

backend=cpu|cuda: NativeTarget hands the checkpoint's tensors to the library once (pointers into the loaded arrays,
kept alive by the target; INT4 stays packed), and each forward is then ONE C call. The library owns the paged
latent arena (kd_model_pages, sized by the target's PagePool: kdtree/model/pages.py) and grow-only scratch; which
page holds which sequence's rows is the caller's page table, passed with every forward. Python keeps the decode
loop. The drafter's twin is kdtree/backends/native_drafter.py; build_target / build_drafter (kdtree/model/target.py)
choose them.

    target = NativeTarget(cfg, weights, ops)             # registers the weights
    cache = target.new_cache(max_len)                    # pages of the target's pool (PagedCache)
    logits, hiddens = target.forward(tokens, positions, cache, visibility, hidden_layers)

The ABI takes rows of several sequences per forward (kd_forward_args: page tables + lengths + row_start,
block-diagonal visibility). LIBRARY_CLOCK.seconds accumulates the wall time spent inside these calls (and the tree ops) so the
bench can report the share of decode time spent outside the library.
"""
from __future__ import annotations

import functools
import time
import weakref
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from kdtree.errors import ConfigError, NativeError
from kdtree.model.derived import (as_f32, check_context, embed_weight, is_bf16, lm_head_weight, rope_mscale,
                                  route_params,
                                  router_weights, softmax_scale, split_kv_b, transposed_w_uk, weight_getter,
                                  yarn_inv_freq)
from kdtree.model.names import is_moe_layer
from kdtree.backends.native_nccl import attach_nccl
from kdtree.model.pages import DEFAULT_PAGE_ROWS, PagedCache, PagePool
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
    stay uint16 in memory, half the bytes held and streamed per token (W_uk / W_uv too: kv_b_proj's BF16 bits split
    per head; the router gate too; the norms are still widened copies: small). backend=numpy (the reference) and
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
    return hasattr(w, "packed") and hasattr(w, "scale_held") and hasattr(w, "group_size")


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
        """A float array given whole (the embedding table, W_uk^T / W_uv, the router gate): dst.<name>_bf16 for BF16
        bits, else dst.<name> as float32."""
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
        packed = np.ascontiguousarray(w.packed, np.int32)
        dst.packed = self.ptr(packed, "int32_t[]")
        scale = w.scale_held                       # BF16 scales (the checkpoint's) stay BF16: half the scale bytes
        if scale.dtype == np.uint16:
            dst.scales_bf16 = self.ptr(scale, "uint16_t[]")
        else:
            dst.scales = self.ptr(scale)
        dst.n_out, dst.n_in = int(w.shape[0]), int(w.shape[1])
        dst.group = int(w.group_size)
        self.bytes[name] = (int(packed.nbytes + scale.nbytes),   # packed + scales as held
                            int(w.shape[0]) * int(w.shape[1]))

    def mlp(self, dst, m: Any, name: str) -> None:
        self.weight(dst.gate, m.gate, f"{name}.gate_proj")
        self.weight(dst.up, m.up, f"{name}.up_proj")
        self.weight(dst.down, m.down, f"{name}.down_proj")


def _mlp_weights(w: Callable[[str], Any], p: str) -> SimpleNamespace:
    """gate/up/down of the MLP at prefix p (a dense MLP, a routed expert or the shared expert)."""
    return SimpleNamespace(gate=w(f"{p}.gate_proj.weight"), up=w(f"{p}.up_proj.weight"),
                           down=w(f"{p}.down_proj.weight"))


def _timed(fn, *args) -> int:
    t0 = time.perf_counter()
    rc = fn(*args)
    LIBRARY_CLOCK.seconds += time.perf_counter() - t0
    return rc


class NativeLatentCache(PagedCache):
    """A sequence's latent rows in pages of its NativeTarget's arena (the library's; kd_model_pages): length,
    max_len, pages, truncate, keep (kd_cache_keep), read_rows / kv (kd_cache_gather). Made by NativeTarget.new_cache."""

    @property
    def target(self) -> "NativeTarget":
        return self.owner


def page_args(caches: Sequence[Any]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """kd_forward_args' page tables of these caches: (pages i32[sum n_s], page_start i64[S + 1], lengths i64[S])."""
    tables = [np.asarray(c.pages, np.int32) for c in caches]
    start = np.zeros(len(tables) + 1, np.int64)
    np.cumsum([t.size for t in tables], out=start[1:])
    return (np.concatenate(tables) if tables else np.zeros(0, np.int32), start,
            np.asarray([c.length for c in caches], np.int64))


class NativeTarget:
    """A K2 target whose forward is ONE kd_model_forward call: the checkpoint's tensors (by kdtree/model/names.py's
    names) registered with the library, INT4 kept packed; the derived ones (W_uk^T / W_uv, YaRN, softmax scale,
    routing) from kdtree/model/derived.py, the same functions K2Model calls. The Target protocol
    (kdtree/model/target.py); build_target picks it for backend=cpu, and backend=cuda on a device.

    target = NativeTarget(cfg, weights, ops)             # ops: the NativeOps (decode's tree ops, the drafter's)
    cache = target.new_cache(max_len)                    # pages of its pool (PagedCache)
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
            heads, w_uk, w_uv = split_kv_b(cfg, w, i, keep_bf16=True)   # BF16 as the loader kept it
            reg.table(ly, "w_uk_t", transposed_w_uk(w_uk))
            reg.table(ly, "w_uv", w_uv)
            for key, arr in ((f"{a}.w_uk", reg.keep[-4]), (f"{a}.w_uv", reg.keep[-2])):
                reg.bytes[key] = (int(arr.nbytes), int(arr.size))
            reg.weight(ly.o, w(f"{a}.o_proj.weight"), f"{a}.o_proj")
            ly.heads = heads
            if not is_moe_layer(cfg, i):
                ly.is_moe = 0
                reg.mlp(ly.mlp, _mlp_weights(w, f"{p}.mlp"), f"{p}.mlp")
                continue
            ly.is_moe = 1
            gate, bias = router_weights(w, i, keep_bf16=True)   # BF16 as the loader kept it
            reg.table(ly, "router", gate)
            ly.router_bias = reg.vec(bias)
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
        # reused per call of forward (one sequence): one argument block and its page_start / lengths / row_start
        self._args = ffi.new("kd_forward_args *")
        self._seq = np.zeros(5, np.int64)                  # [page_start 0, page_start 1, length, row_start 0, 1]
        self._seq_c = ffi.from_buffer("int64_t[]", self._seq)
        self._args.n_seqs = 1
        self._args.page_start, self._args.lengths, self._args.row_start = self._seq_c, self._seq_c + 2, self._seq_c + 3
        self._fb = ffi._backend.from_buffer
        self._types = {k: ffi.typeof(f"{k}[]") for k in ("float", "int32_t", "int64_t", "uint64_t")}
        self._fwd = lib.c.kd_model_forward
        self.pages = PagePool(DEFAULT_PAGE_ROWS)           # the ids of the library's paged arena
        self.pages.add_arena(self._resize_arena)
        self.pruned: Optional[np.ndarray] = None          # u8[N] of the last forward_batch with values (1 = pruned)

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

    def new_cache(self, max_len: int, prefix=()) -> NativeLatentCache:
        """A cache of max_len rows: the pages `prefix` mapped first (a prefix cache hit), fresh pages for the rest."""
        check_context(self.cfg, max_len)
        return NativeLatentCache(self, max_len, prefix)

    def reserve_cache_pool(self, rows: int, page_rows: int = DEFAULT_PAGE_ROWS) -> bool:
        """A fixed arena of rows // page_rows pages from now on (PagePool.reserve: a full pool raises CachePoolBusy,
        the scheduler's cue to wait); True."""
        self.pages.reserve(int(rows) // int(page_rows), page_rows)
        return True

    def _resize_arena(self, n_pages: int, page_rows: int) -> None:
        """The pool's size changed (kd_model_pages: the first pages keep their rows at the same page size)."""
        self.lib.check(self.lib.c.kd_model_pages(self.handle, int(n_pages), int(page_rows)), "kd_model_pages")

    def move_rows(self, pages: np.ndarray, start: int, rows: np.ndarray) -> None:
        """Tree compaction: rows `rows` of the sequence whose table is `pages` moved to start.. (kd_cache_keep)."""
        pages = np.ascontiguousarray(pages, np.int32)
        rows = np.ascontiguousarray(rows, np.int64)
        ffi = self.lib.ffi
        rc = self.lib.c.kd_cache_keep(self.handle, ffi.from_buffer("int32_t[]", pages), pages.size, int(start),
                                      ffi.from_buffer("int64_t[]", rows), rows.size)
        if rc:   # the library names what is wrong (bad rows, a page outside the arena, ...); do not guess
            raise ValueError(f"keep(start={start}, rows={rows.tolist()}): {self.lib.last_error()}")

    def gather_rows(self, pages: np.ndarray, start: int, n: int) -> np.ndarray:
        """Rows [start, start + n) of a sequence, every layer: host f32[n_layers, n, L+R] (kd_cache_gather)."""
        pages = np.ascontiguousarray(pages, np.int32)
        out = np.empty((self.n_layers, int(n), self.width), np.float32)
        ffi = self.lib.ffi
        self.lib.check(self.lib.c.kd_cache_gather(self.handle, ffi.from_buffer("int32_t[]", pages), pages.size,
                                                  int(start), int(n), ffi.from_buffer("float[]", out)),
                       "kd_cache_gather")
        return out

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

    def held_arrays(self, min_bytes: int = 0) -> List[np.ndarray]:
        """The arrays the library reads (weights, norms, tables: each memory block once), those of at least
        `min_bytes`: what pipeline=bench_forward's read roof streams (the forward's own pages, not a fresh buffer)."""
        seen, out = set(), []
        for a in self._reg.keep:
            if isinstance(a, np.ndarray) and a.nbytes >= min_bytes and a.ctypes.data not in seen:
                seen.add(a.ctypes.data)
                out.append(a)
        return out

    def off_line_bytes(self) -> int:
        """Bytes of the weights (arrays of >= 1 MiB) that do not start on a 64-byte cache line: a mapped tensor sits
        where its safetensors file put it (the format aligns nothing), and the multi-row kernels read such rows up to
        1.3x slower (kdtree/aligned.py). load.strategy=eager copies them onto lines."""
        return sum(a.nbytes for a in self.held_arrays(1 << 20) if a.ctypes.data % 64)

    @functools.cached_property
    def expert_cost(self) -> Optional[float]:
        """A routed expert's bytes over an AR step's (the dense linears + top_k experts of every MoE layer), as held:
        the tokens a draft row must be expected to commit to be worth one more expert in a layer's stream (expert
        pruning, kd_forward_args.row_value). None where the library cannot prune (CUDA) or the model has no MoE."""
        if self.lib.kind != "cpu":
            return None
        E, k = int(self.cfg.n_routed_experts or 0), int(self.cfg.num_experts_per_tok or 0)
        dense, experts = 0, {}
        for name, (b, _n) in self._reg.bytes.items():
            if ".mlp.experts." in name:                   # model.layers.L.mlp.experts.e.*
                layer = int(name.split(".")[2])
                experts[layer] = experts.get(layer, 0) + b
            else:
                dense += b
        if not experts or not E:
            return None
        per = sum(experts.values()) / E / len(experts)    # one expert of one layer (the layers' mean)
        return float(per / (dense + k * per * len(experts)))

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
        if getattr(cache, "pool", self.pages) is not self.pages:
            raise ValueError(f"forward: the cache ({type(cache).__name__}) was not made by this model's new_cache (its "
                             f"pages index another arena); use model.new_cache(max_len)")
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
        pages = np.ascontiguousarray(cache.pages, np.int32)
        self._seq[1], self._seq[2], self._seq[4] = pages.size, length, T
        a.pages = fb(ty["int32_t"], pages, False)
        a.n_rows, a.tokens, a.positions = T, fb(ty["int32_t"], tokens, False), fb(ty["int32_t"], positions, False)
        a.n_out = T if logits else 0
        a.logits = fb(ty["float"], out, False) if logits else self.lib.ffi.NULL
        a.n_hidden = len(want)
        if want:
            a.hidden_layers, a.hidden = fb(ty["int64_t"], hl, False), fb(ty["float"], hid, False)
        rc = _timed(self._fwd, self.handle, a)
        if rc:
            self.lib.check(rc, "kd_model_forward")
        cache.length = length + T
        return out, {layer: hid[:, j * D:(j + 1) * D] for j, layer in enumerate(want)}


    def forward_batch(self, seqs: Sequence[Tuple[np.ndarray, np.ndarray, NativeLatentCache, Optional[np.ndarray]]],
                      hidden_layers: Iterable[int] = (), values: Optional[Sequence[Optional[np.ndarray]]] = None
                      ) -> Tuple[np.ndarray, np.ndarray, Dict[int, np.ndarray]]:
        """Rows of several sequences in ONE call: seqs = [(tokens i32[T_s], positions i32[T_s], cache, visibility
        u64[T_s, ceil(T_s/64)] | None = causal)], distinct caches. Each row sees its own cache and its own block's
        visible rows (block-diagonal), so its results equal its sequence's forward alone, bit for bit.
        Returns logits f32[N, V], argmax i32[N] and {layer: f32[N, D]}, rows in sequence order.
        values: per sequence f32[T_s] (the tokens each draft row's subtree is expected to commit; inf = keep) or None:
        lossless expert pruning (kd_forward_args.row_value) where expert_cost is known; self.pruned = u8[N] then
        marks the rows pruned (their logits mean nothing), else None."""
        if not seqs:
            raise ValueError("forward_batch: no sequences; pass at least one (tokens, positions, cache, visibility)")
        toks, poss, vis, row_start, caches = [], [], [], [0], []
        for tokens, positions, cache, visibility in seqs:
            if getattr(cache, "pool", self.pages) is not self.pages:
                raise ValueError(f"forward_batch: sequence {len(caches)}'s cache was not made by this model's "
                                 f"new_cache (its pages index another arena); use model.new_cache(max_len)")
            t = np.ascontiguousarray(tokens, np.int32)
            T = t.shape[0]
            if T == 0 or np.shape(positions) != (T,):
                raise ValueError(f"forward_batch: sequence {len(caches)} has tokens {t.shape}, positions "
                                 f"{np.shape(positions)}; expected [T] and [T] with T >= 1")
            if cache.length + T > cache.max_len:
                raise ConfigError(f"latent cache of {cache.max_len} rows cannot hold {cache.length} + {T} tokens; "
                                  f"create it with a larger max_len (prompt + max_new_tokens + tree budget)")
            v = causal_visibility(T) if visibility is None else np.ascontiguousarray(visibility, np.uint64)
            if v.shape != (T, (T + 63) // 64):
                raise ValueError(f"visibility shape {v.shape} != ({T}, {(T + 63) // 64})")
            toks.append(t), poss.append(np.asarray(positions, np.int32)), vis.append(v.reshape(-1))
            row_start.append(row_start[-1] + T), caches.append(cache)
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("forward_batch: two sequences share one cache; give each sequence its own cache")
        N, D = row_start[-1], self.hidden
        want = list(dict.fromkeys(int(i) for i in hidden_layers))
        pages, page_start, lengths = page_args(caches)
        arrays = {"tokens": np.concatenate(toks), "positions": np.concatenate(poss), "pages": pages,
                  "page_start": page_start, "lengths": lengths, "row_start": np.asarray(row_start, np.int64),
                  "visibility": np.concatenate(vis), "hidden_layers": np.asarray(want or [0], np.int64),
                  "logits": np.empty((N, self.vocab), np.float32), "argmax": np.empty(N, np.int32),
                  "hidden": np.empty((N, max(len(want), 1) * D), np.float32)}
        ctype = {np.dtype(np.int32): "int32_t[]", np.dtype(np.int64): "int64_t[]", np.dtype(np.uint64): "uint64_t[]",
                 _F32: "float[]"}
        c = {k: self.lib.ffi.from_buffer(ctype[v.dtype], v) for k, v in arrays.items()}
        a = self.lib.ffi.new("kd_forward_args *")
        a.n_rows, a.tokens, a.positions, a.n_seqs = N, c["tokens"], c["positions"], len(caches)
        a.pages, a.page_start, a.lengths = c["pages"], c["page_start"], c["lengths"]
        a.row_start, a.visibility = c["row_start"], c["visibility"]
        a.n_out, a.logits, a.argmax = N, c["logits"], c["argmax"]
        a.n_hidden, a.hidden_layers, a.hidden = len(want), c["hidden_layers"], c["hidden"]
        cost = self.expert_cost if values is not None and any(v is not None for v in values) else None
        self.pruned = None
        if cost is not None:
            vals = np.concatenate([np.full(T, np.inf, np.float32) if v is None else np.asarray(v, np.float32)
                                   for v, T in zip(values, np.diff(row_start))])
            if vals.shape != (N,):
                raise ValueError(f"forward_batch: values give {vals.shape[0]} rows for {N}; one per row of each "
                                 f"sequence, or None")
            self.pruned = np.zeros(N, np.uint8)
            keep = (vals, self.pruned)              # alive through the call
            a.row_value, a.row_pruned = self.lib.ffi.from_buffer("float[]", vals), self.lib.ffi.from_buffer(
                "uint8_t[]", self.pruned)
            a.expert_cost = cost
        self.lib.check(_timed(self._fwd, self.handle, a), "kd_model_forward")
        if cost is not None:
            del keep
        for cache, T in zip(caches, np.diff(row_start)):
            cache.length += int(T)
        hid = arrays["hidden"]
        return arrays["logits"], arrays["argmax"], {layer: hid[:, j * D:(j + 1) * D] for j, layer in enumerate(want)}


__all__ = ["LIBRARY_CLOCK", "NativeTarget", "NativeLatentCache", "keeps_bf16", "page_args", "supports"]
