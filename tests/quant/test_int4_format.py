"""INT4 pack/unpack, quantize, and the in-memory Int4Weight (compressed-tensors pack-quantized layout)."""
import numpy as np
import pytest

from kdtree.errors import CheckpointError, ConfigError
from kdtree.bf16 import bf16_to_f32, f32_to_bf16
from kdtree.quant.int4 import Int4Weight, dequantize, pack_int4, quantize_weight, unpack_int4

U = 2 ** 32  # a word written in hex is stored as int32: subtract 2**32 when its top nibble is >= 8

# Known answers, worked out by hand from the rule: nibble = q + 8, element k of a row in bits 4k..4k+3.
KNOWN_Q = np.array([
    [-7, -6, -5, -4, -3, -2, -1, 0],     # nibbles 1..8      -> 0x87654321 (top nibble 8: negative)
    [0, 1, 2, 3, 4, 5, 6, 7],            # nibbles 8..15     -> 0xFEDCBA98
    [7, 7, 7, 7, 7, 7, 7, 7],            # all 15            -> 0xFFFFFFFF = -1
    [-8, -8, -8, -8, -8, -8, -8, -8],    # all 0             -> 0x00000000
    [0, 0, 0, 0, 0, 0, 0, 0],            # all 8             -> 0x88888888
    [-1, 0, 0, 0, 0, 0, 0, 1],           # 7, 8 x6, 9        -> 0x98888887
    [-4, 3, -8, 7, 0, -1, 1, -5],        # 4,B,0,F,8,7,9,3   -> 0x3978F0B4 (positive)
], np.int8)
KNOWN_WORDS = np.array([[0x87654321 - U], [0xFEDCBA98 - U], [-1], [0], [0x88888888 - U], [0x98888887 - U],
                        [0x3978F0B4]], np.int32)


def test_pack_matches_hand_computed_words():
    assert np.array_equal(pack_int4(KNOWN_Q), KNOWN_WORDS)
    assert KNOWN_WORDS.reshape(-1).tolist() == [-2023406815, -19088744, -1, 0, -2004318072, -1735882617, 964227252]


def test_unpack_hand_computed_words_uses_logical_shifts():
    assert np.array_equal(unpack_int4(KNOWN_WORDS, 8), KNOWN_Q)


def test_roundtrip_every_nibble_value_at_every_position():
    vals = np.arange(-8, 8, dtype=np.int8)                               # all 16 nibble values
    q = np.stack([np.roll(vals, r) for r in range(16)])                  # [16, 16]: each value at each slot
    packed = pack_int4(q)
    assert packed.shape == (16, 2) and packed.dtype == np.int32
    assert (packed < 0).any()                                            # top nibble >= 8 -> negative words
    assert np.array_equal(unpack_int4(packed, 16), q)
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(33, 64)).astype(np.int8)
    assert np.array_equal(unpack_int4(pack_int4(q), 64), q)


def test_in_not_multiple_of_8_pads_last_word_with_zero_nibbles():
    q = np.array([[1, 0, 0, 0, 0, 0, 0, 0, -1]], np.int8)              # in = 9 -> 2 words
    packed = pack_int4(q)
    # word 0: nibbles 9,8,8,8,8,8,8,8 = 0x88888889; word 1: nibble 7 then padding nibbles 0 = 0x00000007
    assert packed.tolist() == [[0x88888889 - U, 7]]
    assert np.array_equal(unpack_int4(packed, 9), q)
    with pytest.raises(ValueError, match="cannot hold in_features=17"):
        unpack_int4(packed, 17)


def test_pack_rejects_values_outside_int4():
    with pytest.raises(ValueError, match="-8..7"):
        pack_int4(np.array([[8]], np.int8))


def test_bf16_round_to_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, 1 / 7, -2.5, 0.0, np.inf], np.float32)
    # ties go to the even mantissa; above a tie rounds up; 1/7 = 0x3E124925 -> 0x3E12 (dropped bits < half)
    assert f32_to_bf16(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3E12, 0xC020, 0x0000, 0x7F80]
    assert bf16_to_f32(np.array([0x3F80, 0x3E12, 0xC020], np.uint16)).tolist() == [1.0, 0.142578125, -2.5]
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))


def test_quantize_known_answer():
    w = np.array([
        [7.0, -7.0, 3.4, -1.0, 0.0, 0.4, 1.6, 2.5],    # max 7 -> scale 1.0 (0x3F80); 2.5 rounds half-even to 2
        [0.0] * 8,                                     # zero group -> scale 0, q 0 (nibbles 8)
        [1.0, -1.0, 0.5, 0, 0, 0, 0, 0],               # scale bf16(1/7) = 0.142578125; 0.5/s = 3.51 -> 4
    ], np.float32)
    packed, scale, shape = quantize_weight(w, group_size=8)
    # row 0 q = 7,-7,3,-1,0,0,2,2 -> nibbles F,1,B,7,8,8,A,A -> 0xAA887B1F
    # row 2 q = 7,-7,4,0,0,0,0,0  -> nibbles F,1,C,8,8,8,8,8 -> 0x88888C1F
    assert packed.tolist() == [[0xAA887B1F - U], [0x88888888 - U], [0x88888C1F - U]]
    assert scale.dtype == np.uint16 and scale.tolist() == [[0x3F80], [0x0000], [0x3E12]]
    assert shape.dtype == np.int32 and shape.tolist() == [3, 8]
    deq = dequantize(packed, scale, shape)
    assert deq[1].tolist() == [0.0] * 8 and not np.isnan(deq).any()
    assert deq[0].tolist() == [7, -7, 3, -1, 0, 0, 2, 2]


@pytest.mark.parametrize("group_size", [32, 8, 128])
def test_dequantized_within_half_step_per_group(group_size):
    rng = np.random.default_rng(group_size)
    w = rng.normal(0, 1, size=(24, 256)).astype(np.float32)
    w[0, :group_size] = 0.0                                              # a zero group
    w[1] *= 1e-30                                                        # tiny (near-subnormal) scales
    w[2] *= 1e30                                                         # huge scales
    w[3, 5] = 100.0                                                      # an outlier in one group
    packed, scale, shape = quantize_weight(w, group_size)
    s = np.repeat(bf16_to_f32(scale), group_size, axis=1)                # [out, in] step of each element
    err = np.abs(dequantize(packed, scale, shape) - w)
    assert (err <= 0.5 * s * (1 + 1e-6) + 1e-45).all()
    assert np.isfinite(dequantize(packed, scale, shape)).all()
    q = unpack_int4(packed, 256)
    assert q.min() >= -7 and q.max() <= 7                                # grid -7..7: nibble 0 never written


def test_quantize_rejects_ragged_groups_and_nan():
    with pytest.raises(ConfigError, match=r"up_proj \[4, 40\]: in=40 is not a multiple of quant.group_size=32"):
        quantize_weight(np.ones((4, 40), np.float32), 32, name="model.layers.1.mlp.experts.0.up_proj")
    bad = np.ones((2, 32), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(ConfigError, match="NaN"):
        quantize_weight(bad, 32, name="x")


def _weight(out=48, n=128, g=32, seed=0):
    w = np.random.default_rng(seed).normal(size=(out, n)).astype(np.float32)
    p, s, shp = quantize_weight(w, g)
    return Int4Weight.from_tensors("m", p, s, shp, g), w


def test_from_tensors_keeps_weight_packed_with_bf16_scale_bits():
    W, w = _weight()
    assert W.shape == (48, 128) and W.packed.dtype == np.int32 and W.scale.dtype == np.float32
    assert W.scale_held.dtype == np.uint16 and np.array_equal(bf16_to_f32(W.scale_held), W.scale)
    assert W.nbytes == 48 * 16 * 4 + 48 * 4 * 2                          # packed words + BF16 scales, as on disk
    assert W.rows(slice(0, 8)).scale_held.shape == (8, 4) and W.cols(slice(32, 96)).scale_held.shape == (48, 2)
    assert W.rows(slice(0, 8)).scale_held.dtype == W.cols(slice(32, 96)).scale_held.dtype == np.uint16
    odd = Int4Weight(W.packed, W.scale * np.float32(1 + 2 ** -20), W.shape, 32)   # not bfloat16 values: kept f32
    assert odd.scale_held.dtype == np.float32 and odd.nbytes == 48 * 16 * 4 + 48 * 4 * 4
    assert np.abs(W.dequantize() - w).max() <= 0.5 * W.scale.max() * (1 + 1e-6)


def test_from_tensors_accepts_int64_shape_and_torch_bf16_scale():
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    p, s, shp = quantize_weight(w, 32)
    scale_t = torch.from_numpy(s.view(np.int16)).view(torch.bfloat16)
    W = Int4Weight.from_tensors("m", p, scale_t, shp.astype(np.int64), 32)
    assert np.array_equal(W.scale, bf16_to_f32(s))


@pytest.mark.parametrize("case, message", [
    ("missing_scale", r"experts.3.down_proj.weight_scale is missing"),
    ("missing_shape", r"experts.3.down_proj.weight_shape is missing"),
    ("scale_group",
     r"experts.3.down_proj.weight_scale shape \[16, 2\] does not match group_size=32 .*expected \[16, 4\]"),
    ("shape_vs_packed", r"experts.3.down_proj.weight_shape \[16, 256\] disagrees with weight_packed \[16, 16\]"),
    ("packed_dtype", r"experts.3.down_proj.weight_packed is int64\[16, 16\]; expected int32"),
    ("ragged", r"experts.3.down_proj: in=128 is not a multiple of group_size=48"),
    ("nan_scale", r"experts.3.down_proj.weight_scale holds NaN"),
])
def test_bad_int4_tensors_raise_one_clear_line(case, message):
    name = "model.layers.1.mlp.experts.3.down_proj"
    p, s, shp = quantize_weight(np.random.default_rng(2).normal(size=(16, 128)).astype(np.float32), 32)
    g = 32
    if case == "missing_scale":
        s = None
    elif case == "missing_shape":
        shp = None
    elif case == "scale_group":
        s = s[:, :2]
    elif case == "shape_vs_packed":
        shp = np.array([16, 256], np.int32)
    elif case == "packed_dtype":
        p = p.astype(np.int64)
    elif case == "ragged":
        g = 48
    elif case == "nan_scale":
        s = s.copy()
        s[0, 0] = 0x7FC0
    with pytest.raises(CheckpointError, match=message) as e:
        Int4Weight.from_tensors(name, p, s, shp, g)
    assert "\n" not in str(e.value)


def test_matvec_equals_dequantized_gemv():
    W, _ = _weight(out=40, n=256, seed=3)
    x = np.random.default_rng(4).normal(size=256).astype(np.float32)
    y = W.matvec(x)
    assert y.dtype == np.float32 and y.shape == (40,)
    np.testing.assert_allclose(y, W.dequantize() @ x, rtol=1e-5, atol=1e-5)
    assert np.array_equal(W.matvec(x), y)                                # deterministic


def test_matvec_is_row_and_batch_invariant():
    W, _ = _weight(out=64, n=256, seed=5)
    x = np.random.default_rng(6).normal(size=(7, 256)).astype(np.float32)
    full = W.linear(x)
    assert np.array_equal(full, np.stack([W.matvec(v) for v in x]))      # T rows == T separate GEMVs, bitwise
    assert np.array_equal(W.rows(slice(9, 30)).linear(x), full[:, 9:30])  # a row never depends on other rows
    assert np.array_equal(W.linear(x[3:4]), full[3:4])
    for i in (0, 17, 63):                                                # single-row weights: degenerate shapes
        assert np.array_equal(W.rows(slice(i, i + 1)).linear(x), full[:, i:i + 1])
    one_group = W.cols(slice(32, 64))                                    # in == group_size
    ref = one_group.linear(x[:, 32:64])
    assert np.array_equal(one_group.rows(slice(5, 6)).linear(x[2:3, 32:64]), ref[2:3, 5:6])


def test_rows_and_cols_slices_for_tensor_parallel():
    W, _ = _weight(out=32, n=256, g=32, seed=7)
    deq = W.dequantize()
    r = W.rows(slice(8, 16))
    assert r.shape == (8, 256) and np.array_equal(r.dequantize(), deq[8:16])
    assert not np.shares_memory(r.packed, W.packed)                      # a rank's slice owns its memory
    c = W.cols(slice(64, 128))
    assert c.shape == (32, 64) and c.scale.shape == (32, 2) and np.array_equal(c.dequantize(), deq[:, 64:128])
    parts = [W.cols(slice(i * 64, (i + 1) * 64)) for i in range(4)]      # tp=4 row-parallel split
    x = np.random.default_rng(8).normal(size=256).astype(np.float32)
    np.testing.assert_allclose(sum(p.matvec(x[i * 64:(i + 1) * 64]) for i, p in enumerate(parts)), W.matvec(x),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiples of group_size=32"):
        W.cols(slice(0, 48))


def test_cols_with_group_size_not_multiple_of_8_repacks():
    w = np.random.default_rng(9).normal(size=(4, 24)).astype(np.float32)
    p, s, shp = quantize_weight(w, 4)
    W = Int4Weight.from_tensors("m", p, s, shp, 4)
    c = W.cols(slice(4, 20))                                             # starts mid-word
    assert c.packed.shape == (4, 2) and np.array_equal(c.dequantize(), W.dequantize()[:, 4:20])


def test_from_tensors_takes_the_loaders_arguments():
    # the loader passes "<module>.weight", float32 scales and the logical shape as a tuple
    w = np.random.default_rng(10).normal(size=(8, 64)).astype(np.float32)
    p, s, _ = quantize_weight(w, 32)
    W = Int4Weight.from_tensors("model.layers.1.mlp.experts.0.up_proj.weight", p, bf16_to_f32(s), (8, 64), 32)
    assert W.shape == (8, 64)
    with pytest.raises(CheckpointError, match=r"^model.layers.1.mlp.experts.0.up_proj.weight_scale is missing"):
        Int4Weight.from_tensors("model.layers.1.mlp.experts.0.up_proj.weight", p, None, (8, 64), 32)


def test_unpacked_weights_are_cached_within_a_byte_limit_and_give_the_same_bits():
    """The numpy reference unpacks a weight once, not at every call; the cache never exceeds its limit, drops the
    least recently used weight first and forgets a weight that is gone. Cached or not, the result is bit-identical."""
    import gc

    from kdtree.quant.int4 import UnpackedCache
    import kdtree.quant.int4 as int4

    rng = np.random.default_rng(3)
    ws = [Int4Weight.from_tensors("w", *quantize_weight(rng.normal(size=(64, 128)).astype(np.float32), 32), 32)
          for _ in range(3)]
    x = rng.normal(size=(3, 128)).astype(np.float32)
    q_bytes = 64 * 128 * 4                                     # float32 q of one weight
    cold = [w.linear(x) for w in ws]
    saved, int4.UNPACKED = int4.UNPACKED, UnpackedCache(2 * q_bytes)
    try:
        for w, want in zip(ws, cold):
            assert np.array_equal(w.linear(x), want)
            assert int4.UNPACKED.nbytes <= 2 * q_bytes
        assert int4.UNPACKED.get(ws[2]) is int4.UNPACKED.get(ws[2])  # a hit returns the cached array
        assert len(int4.UNPACKED.entries) == 2 and id(ws[0]) not in int4.UNPACKED.entries   # LRU went first
        del ws[2], w                                          # the loop variable held it too
        gc.collect()
        assert len(int4.UNPACKED.entries) == 1 and int4.UNPACKED.nbytes == q_bytes
    finally:
        int4.UNPACKED = saved
