"""INT4-W4A16 weights in the compressed-tensors `pack-quantized` layout (the format of Kimi K2's routed experts).

On disk, per quantized Linear module `<m>`:
  `<m>.weight_packed` int32 [out, ceil(in/8)]   nibble k%8 of word k//8 holds q+8 (first element in the lowest nibble)
  `<m>.weight_scale`  bf16  [out, in/group]     symmetric, no zero point: w ~= q * scale, q in -7..7
  `<m>.weight_shape`  int32|int64 [2]           = [out, in]
Words whose top nibble is >= 8 are negative int32, so unpacking reads them as unsigned (never arithmetic shifts).

Edge cases (decided here, tested in tests/quant):
* `in` not a multiple of 8: supported exactly as compressed-tensors' `pack_to_int32` does it: the last word is padded
  with raw nibble 0 (after the +8 offset) and `unpack_int4` drops the padding using `in` from weight_shape.
* `in` not a multiple of group_size: rejected (CheckpointError on load, ConfigError when quantizing) - K2 and the tiny
  model never need it, and a ragged last group is where tools disagree.
* A group of zeros: scale 0 and q 0, so dequantization gives exactly 0 (never 0/0).
* The scale is rounded to bf16 (round-to-nearest-even) BEFORE q is computed, so q is chosen against the scale that
  is stored; |w - q*scale| <= scale/2 for every element.

In memory an `Int4Weight` keeps the packed words and the scales as BF16 bits (the checkpoint's bytes; `.scale` widens
them exactly to float32, `.scale_held` hands the bits to the native kernels), or float32 scales where a value is not a
bfloat16 (hand-built weights). The unpacked q values of recently used weights live in one LRU cache bounded in bytes
(`UNPACKED`, $KDTREE_INT4_CACHE_MB). `matvec`/`linear` compute per group (integer q times x summed over the group,
times the group's scale, summed over groups); an output element never depends on the other rows of x or of the
weight (batch- and row-invariant, bit for bit).
"""
from __future__ import annotations

import os
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import numpy as np

from kdtree.bf16 import bf16_to_f32, f32_to_bf16
from kdtree.errors import CheckpointError, ConfigError

PACK = 8          # 4-bit values per int32 word
QMAX = 7          # symmetric grid -7..7 (nibble 1..15; nibble 0 = -8 is never produced by the quantizer)
OFFSET = 8        # stored nibble = q + 8


# ---------------------------------------------------------------------------------------------- pack / unpack
def pack_int4(q: np.ndarray) -> np.ndarray:
    """q int8[out, in] in -8..7 -> int32[out, ceil(in/8)]; the last word is padded with raw nibble 0."""
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"pack_int4 expects a 2-D array [out, in], got shape {list(q.shape)}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"pack_int4 values must lie in -8..7, got min {q.min()} max {q.max()}")
    out, n = q.shape
    words = -(-n // PACK)
    nib = np.zeros((out, words * PACK), np.uint32)                           # [out, words*8], padding = nibble 0
    nib[:, :n] = (q.astype(np.int32) + OFFSET).astype(np.uint32)
    nib = nib.reshape(out, words, PACK)
    packed = np.zeros((out, words), np.uint32)
    for k in range(PACK):
        packed |= nib[:, :, k] << np.uint32(4 * k)
    return packed.view(np.int32)


def unpack_int4(packed: np.ndarray, in_features: int) -> np.ndarray:
    """int32[out, ceil(in/8)] -> int8[out, in_features]; padding nibbles are dropped.

    Works on the unsigned little-endian bytes of each word (low nibble = even element, high = odd), so the sign bit
    of a negative word is just bit 3 of its top nibble: the same as logical shifts on a uint32 view.
    """
    packed = np.ascontiguousarray(packed)
    if packed.dtype not in (np.int32, np.uint32) or packed.ndim != 2:
        raise ValueError(f"unpack_int4 expects int32[out, words], got {packed.dtype}{list(packed.shape)}")
    if packed.shape[1] != -(-in_features // PACK):
        raise ValueError(f"unpack_int4: {packed.shape[1]} words per row cannot hold in_features={in_features} "
                         f"(needs ceil({in_features}/8) = {-(-in_features // PACK)})")
    b = packed.astype("<i4", copy=False).view(np.uint8)                    # [out, 4*words], little-endian bytes
    nib = np.empty((b.shape[0], b.shape[1] * 2), np.uint8)                 # byte j holds elements 2j (low), 2j+1
    np.bitwise_and(b, 0xF, out=nib[:, 0::2])
    np.right_shift(b, 4, out=nib[:, 1::2])
    q = nib[:, :in_features].view(np.int8) - np.int8(OFFSET)
    return q


# ---------------------------------------------------------------------------------------------- quantize
def quantize_weight(w: np.ndarray, group_size: int, name: str = "weight"
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w f32[out, in] -> (packed int32[out, ceil(in/8)], scale bf16-bits uint16[out, in/g], shape int32[2])."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ConfigError(f"cannot quantize {name}: expected a 2-D [out, in] weight, got shape {list(w.shape)}")
    out, n = w.shape
    if group_size <= 0 or n % group_size:
        raise ConfigError(f"cannot quantize {name} [{out}, {n}]: in={n} is not a multiple of quant.group_size="
                          f"{group_size}; add the module to quant.ignore or pick a group_size dividing {n}")
    if not np.isfinite(w).all():
        raise ConfigError(f"cannot quantize {name}: it holds NaN/inf values; fix the source checkpoint")
    g = w.reshape(out, n // group_size, group_size)                         # [out, G, g]
    scale_u16 = f32_to_bf16(np.abs(g).max(axis=2) / np.float32(QMAX))       # [out, G]
    scale = bf16_to_f32(scale_u16)
    safe = np.where(scale > 0, scale, np.float32(1.0))                      # zero group: q = 0, dequant 0
    q = np.clip(np.round(g / safe[:, :, None]), -QMAX, QMAX)
    q = np.where(scale[:, :, None] > 0, q, 0).astype(np.int8).reshape(out, n)
    return pack_int4(q), scale_u16, np.array([out, n], np.int32)


def dequantize(packed: np.ndarray, scale: np.ndarray, shape) -> np.ndarray:
    """-> f32[out, in]; scale is bf16 bits (uint16) or float32 [out, in/g] (g = in / scale columns)."""
    out, n = (int(s) for s in np.asarray(shape).reshape(-1))
    scale = _scale_f32(scale)
    if scale.ndim != 2 or scale.shape[0] != out or scale.shape[1] == 0 or n % scale.shape[1]:
        raise ValueError(f"dequantize: scale shape {list(scale.shape)} does not fit weight shape [{out}, {n}]")
    q = unpack_int4(packed, n).astype(np.float32)
    return q * np.repeat(scale, n // scale.shape[1], axis=1)


def _scale_held(scale) -> np.ndarray:
    """The scales as an Int4Weight holds them: BF16 bits (uint16) as given, or float32 values narrowed to their
    BF16 bits when every one is a bfloat16 value (exact: 2 bytes a scale, not 4), else float32."""
    if isinstance(scale, np.ndarray) and scale.dtype == np.uint16:
        return np.ascontiguousarray(scale)
    f = np.ascontiguousarray(_scale_f32(scale), np.float32)
    if f.size and not (f.view(np.uint32) & np.uint32(0xFFFF)).any():
        return np.ascontiguousarray((f.view(np.uint32) >> np.uint32(16)).astype(np.uint16))
    return f


def _scale_f32(scale) -> np.ndarray:
    """bf16 bits (uint16/int16), float16/32 numpy, or a torch tensor -> float32 numpy."""
    if hasattr(scale, "detach"):                                            # torch tensor, no torch import needed
        import torch
        t = scale.detach().cpu()
        scale = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.float().numpy()
    scale = np.asarray(scale)
    if scale.dtype in (np.uint16, np.int16):
        return bf16_to_f32(scale)
    return scale.astype(np.float32, copy=False)   # float32 already (e.g. the loader widened it): no copy


# ---------------------------------------------------------------------------------------------- the weight
class Int4Weight:
    """A packed W4A16 Linear weight: packed int32[out, ceil(in/8)], scales [out, in/g] held as BF16 bits (float32 when
    they are not bfloat16 values; `.scale` is always float32), shape (out, in)."""

    __slots__ = ("packed", "_scale", "shape", "group_size", "__weakref__")

    def __init__(self, packed: np.ndarray, scale: np.ndarray, shape, group_size: int):
        self.packed = np.ascontiguousarray(packed, dtype=np.int32)           # [out, ceil(in/8)]
        self._scale = _scale_held(scale)                                     # [out, in/g]: bf16 bits or f32
        self.shape = (int(shape[0]), int(shape[1]))
        self.group_size = int(group_size)
        _check(self, "Int4Weight")

    @classmethod
    def from_tensors(cls, name: str, packed, scale_raw, shape_tensor, group_size: int) -> "Int4Weight":
        """Validate the three on-disk tensors of module `name` (None = missing) and build the weight.

        name: the module (`model.layers.1.mlp.experts.0.up_proj`; a trailing `.weight` is dropped) - errors name
        its tensors. scale_raw: bf16 bits (uint16), float32/float16, or a torch bf16 tensor. shape_tensor: the
        weight_shape tensor (int32/int64 [2]) or a tuple (out, in).
        """
        name = name[: -len(".weight")] if name.endswith(".weight") else name
        for suffix, t in (("weight_packed", packed), ("weight_scale", scale_raw), ("weight_shape", shape_tensor)):
            if t is None:
                raise CheckpointError(f"{name}.{suffix} is missing; an INT4 module needs weight_packed, "
                                      f"weight_scale and weight_shape (re-run the quantize pipeline)")
        packed = np.asarray(packed)
        if packed.dtype != np.int32 or packed.ndim != 2:
            raise CheckpointError(f"{name}.weight_packed is {packed.dtype}{list(packed.shape)}; expected int32 "
                                  f"[out, ceil(in/8)] (compressed-tensors pack-quantized)")
        shp = np.asarray(shape_tensor)
        if shp.dtype not in (np.int32, np.int64) or shp.shape != (2,) or (shp <= 0).any():
            raise CheckpointError(f"{name}.weight_shape is {shp.dtype}{list(shp.shape)} = {shp.tolist()}; "
                                  f"expected int32/int64 [2] = [out, in] with positive values")
        out, n = int(shp[0]), int(shp[1])
        if packed.shape != (out, -(-n // PACK)):
            raise CheckpointError(f"{name}.weight_shape [{out}, {n}] disagrees with weight_packed "
                                  f"{list(packed.shape)}; expected weight_packed [{out}, {-(-n // PACK)}]")
        if group_size <= 0 or n % group_size:
            raise CheckpointError(f"{name}: in={n} is not a multiple of group_size={group_size}; ragged groups "
                                  f"are not supported (check quant.group_size against the checkpoint's config.json)")
        scale = _scale_f32(scale_raw)
        want = (out, n // group_size)
        if scale.shape != want:
            raise CheckpointError(f"{name}.weight_scale shape {list(scale.shape)} does not match group_size="
                                  f"{group_size} for weight_shape [{out}, {n}]; expected {list(want)} (check "
                                  f"quant.group_size against the checkpoint's quantization_config)")
        if not np.isfinite(scale).all():
            raise CheckpointError(f"{name}.weight_scale holds NaN/inf; the checkpoint is corrupt, re-quantize it")
        bits = isinstance(scale_raw, np.ndarray) and scale_raw.dtype == np.uint16
        return cls(packed, scale_raw if bits else scale, (out, n), group_size)   # BF16 bits kept as they are

    @property
    def scale(self) -> np.ndarray:
        """float32 [out, in/g]: the scales' values (widened exactly from the BF16 bits where those are held)."""
        return bf16_to_f32(self._scale) if self._scale.dtype == np.uint16 else self._scale

    @property
    def scale_held(self) -> np.ndarray:
        """[out, in/g] the scales as held and as the native kernels take them: BF16 bits (uint16) when every one is a
        bfloat16 value (a compressed-tensors checkpoint's, this quantizer's), else float32."""
        return self._scale

    @property
    def nbytes(self) -> int:
        """Resident bytes: packed words + scales as held (2 bytes each when BF16, else 4)."""
        return self.packed.nbytes + self._scale.nbytes

    def dequantize(self) -> np.ndarray:
        """-> f32[out, in] (a fresh array; the weight itself stays packed)."""
        return dequantize(self.packed, self.scale, self.shape)

    def linear(self, x: np.ndarray) -> np.ndarray:
        """x f32[T, in] -> f32[T, out] (W4A16 reference).

        y[t, o] = sum over groups j of scale[o, j] * (sum over k in group j of q[o, k] x[t, k]). Row t is one
        einsum (the group dots, a fixed-order sum of g products per [o, j]) then a pairwise sum over the G groups
        of a contiguous last axis: the same calls for every row whatever T or out, so bit-identical under
        batching and row slicing (tested). q comes unpacked from UNPACKED (unpacking costs ~10x the product).
        """
        x = np.asarray(x, dtype=np.float32)
        out, n = self.shape
        if x.ndim != 2 or x.shape[1] != n:
            raise ValueError(f"Int4Weight[{out}, {n}].linear expects x [T, {n}], got {list(x.shape)}")
        G, g = n // self.group_size, self.group_size
        q = UNPACKED.get(self)                                                     # [out, G, g] f32, cached
        scale = self.scale
        y = np.empty((x.shape[0], out), np.float32)
        for t in range(x.shape[0]):
            part = np.einsum("ojk,jk->oj", q, x[t].reshape(G, g))                  # [out, G]: group dots
            part *= scale                                                          # x scale[o, j]
            y[t] = part.sum(axis=-1)                                               # [out]: over groups
        return y

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """x f32[in] -> f32[out] (W4A16 reference)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"Int4Weight.matvec expects x [in], got {list(x.shape)}; use .linear for [T, in]")
        return self.linear(x[None, :])[0]

    def rows(self, s: slice) -> "Int4Weight":
        """Output rows `s` (tensor parallel, column-parallel layers): a copy that owns its memory."""
        start, stop = _bounds(s, self.shape[0], "rows")
        return Int4Weight(self.packed[start:stop].copy(), self._scale[start:stop].copy(),
                          (stop - start, self.shape[1]), self.group_size)

    def cols(self, s: slice) -> "Int4Weight":
        """Input columns `s` (row-parallel layers); start and stop must lie on group boundaries."""
        out, n = self.shape
        start, stop = _bounds(s, n, "cols")
        g = self.group_size
        if start % g or stop % g:
            raise ValueError(f"Int4Weight[{out}, {n}].cols({start}:{stop}): bounds must be multiples of "
                             f"group_size={g} (a scale covers {g} columns); choose a tp that splits whole groups")
        if start % PACK == 0 and (stop % PACK == 0 or stop == n):
            packed = self.packed[:, start // PACK: -(-stop // PACK)].copy()  # whole words: no repacking
        else:
            packed = pack_int4(unpack_int4(self.packed, n)[:, start:stop])
        return Int4Weight(packed, self._scale[:, start // g: stop // g].copy(), (out, stop - start), g)

    def __repr__(self) -> str:
        return f"Int4Weight(shape={self.shape}, group_size={self.group_size}, nbytes={self.nbytes})"


class UnpackedCache:
    """The unpacked q values (float32 [out, G, g]) of recently used Int4Weights, at most `limit_bytes` in all.

    Unpacking is ~12x the cost of the product itself (a [2048, 7168] expert: 150 ms vs 12 ms), so a forward
    would spend most of its time re-unpacking the same weights. Least recently used entries are dropped past
    the limit ($KDTREE_INT4_CACHE_MB, 2048 MiB by default; 0 = never cache); an entry dies with its weight.
    The arithmetic is the same whether q comes from the cache or not (bit-identical results).
    """

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self.entries: "OrderedDict[int, tuple]" = OrderedDict()   # id(weight) -> (weakref, q)
        self.nbytes = 0
        self.lock = threading.Lock()

    def get(self, w: "Int4Weight") -> np.ndarray:
        key = id(w)
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None and hit[0]() is w:
                self.entries.move_to_end(key)
                return hit[1]
        out, n = w.shape
        q = unpack_int4(w.packed, n).astype(np.float32).reshape(out, n // w.group_size, w.group_size)
        if q.nbytes > self.limit:
            return q
        with self.lock:
            self._drop(key)
            self.entries[key] = (weakref.ref(w, lambda _r, k=key: self.forget(k)), q)
            self.nbytes += q.nbytes
            while self.nbytes > self.limit:
                self._drop(next(iter(self.entries)))
        return q

    def forget(self, key: int) -> None:
        with self.lock:
            self._drop(key)

    def _drop(self, key: int) -> None:
        hit = self.entries.pop(key, None)
        if hit is not None:
            self.nbytes -= hit[1].nbytes


UNPACKED = UnpackedCache(int(float(os.environ.get("KDTREE_INT4_CACHE_MB", "2048")) * 2 ** 20))


def _check(w: Int4Weight, name: str) -> None:
    out, n = w.shape
    g = w.group_size
    if g <= 0 or n % g or w.packed.shape != (out, -(-n // PACK)) or w._scale.shape != (out, n // g):
        raise ValueError(f"{name}: inconsistent packed {list(w.packed.shape)} / scale {list(w._scale.shape)} for "
                         f"shape [{out}, {n}] and group_size={g}")


def _bounds(s: slice, size: int, what: str) -> Tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1 or stop <= start:
        raise ValueError(f"Int4Weight.{what}({s}): need a non-empty slice with step 1 within 0..{size}")
    return start, stop


# ---------------------------------------------------------------------------------------------- config
def _get(cfg: Any, key: str, default=None):
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors matching: "re:<regex>" is re.match (anchored at the start), else the exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def module_is_quantized(module_name: str, quant_cfg) -> bool:
    """Is Linear module `module_name` (e.g. model.layers.1.mlp.experts.0.up_proj) stored as INT4 under quant_cfg?

    targets: "Linear" matches every Linear (callers pass Linear module names only), other entries are exact names
    or "re:" regexes; ignore entries (exact or "re:") win over targets.
    """
    if _get(quant_cfg, "method", "fp32") != "int4_w4a16":
        return False
    targets = list(_get(quant_cfg, "targets", ["Linear"]) or [])
    if not any(t == "Linear" or _matches(module_name, t) for t in targets):
        return False
    return not any(_matches(module_name, p) for p in (_get(quant_cfg, "ignore", []) or []))


def _check_cfg(quant_cfg) -> None:
    method = _get(quant_cfg, "method", "fp32")
    if method != "int4_w4a16":
        raise ConfigError(f"quant.method={method} has no quantization_config; use quant=int4_w4a16")
    if int(_get(quant_cfg, "num_bits", 4)) != 4:
        raise ConfigError(f"quant.num_bits={_get(quant_cfg, 'num_bits')} is not supported; int4_w4a16 needs 4")
    if not bool(_get(quant_cfg, "symmetric", True)):
        raise ConfigError("quant.symmetric=false is not supported (pack-quantized here has no zero point); use true")
    if int(_get(quant_cfg, "group_size", 32)) <= 0:
        raise ConfigError(f"quant.group_size={_get(quant_cfg, 'group_size')} must be a positive integer, e.g. 32")


def quantization_config_json(quant_cfg) -> Dict[str, Any]:
    """The config.json `quantization_config` block (Kimi K2's compressed-tensors layout)."""
    _check_cfg(quant_cfg)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": [str(t) for t in (_get(quant_cfg, "targets", ["Linear"]) or [])],
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": int(_get(quant_cfg, "group_size", 32)), "dynamic": False,
                    "observer": "minmax", "actorder": None,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": [str(p) for p in (_get(quant_cfg, "ignore", []) or [])],
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
    }
