"""quantize_checkpoint: an FP32 HF checkpoint -> the INT4 compressed-tensors layout, readable by other tools."""
import json

import numpy as np
import pytest
from safetensors import safe_open

from kdtree.model import names
from kdtree.checkpoint.safetensors_io import read_file
from kdtree.errors import CheckpointError, ConfigError
from kdtree.checkpoint.quantize import quantize_checkpoint
from kdtree.quant.int4 import Int4Weight, module_is_quantized, quantization_config_json


@pytest.fixture(scope="module")
def int4_checkpoint(fp32_checkpoint, tmp_path_factory, make_quant_cfg):
    dst = tmp_path_factory.mktemp("int4") / "ckpt"
    summary = quantize_checkpoint(fp32_checkpoint, dst, make_quant_cfg("int4_w4a16"))
    return dst, summary


def _all(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(idx["weight_map"].values())):
        out.update(read_file(d / f))
    return idx, out


def test_layout_same_shards_new_index_and_config(fp32_checkpoint, int4_checkpoint, tiny_cfg, make_quant_cfg):
    dst, summary = int4_checkpoint
    src_idx = json.loads((fp32_checkpoint / "model.safetensors.index.json").read_text())
    idx, tensors = _all(dst)
    assert sorted(p.name for p in dst.glob("*.safetensors")) == sorted(set(src_idx["weight_map"].values()))
    for name, shard in src_idx["weight_map"].items():                    # each tensor stays in its shard
        module = name[: -len(".weight")]
        key = f"{module}.weight_packed" if f"{module}.weight_packed" in idx["weight_map"] else name
        assert idx["weight_map"][key] == shard
    assert idx["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values()) == summary["dst_bytes"]
    assert set(idx["weight_map"]) == set(tensors)
    config = json.loads((dst / "config.json").read_text())
    src_config = json.loads((fp32_checkpoint / "config.json").read_text())
    assert config.pop("quantization_config") == quantization_config_json(make_quant_cfg("int4_w4a16"))
    assert config == src_config
    experts = 3 * tiny_cfg.n_routed_experts                              # one MoE layer: routed experts only
    assert summary["quantized_modules"] == experts
    assert (dst / "tokenizer_config.json").read_bytes() == (fp32_checkpoint / "tokenizer_config.json").read_bytes()
    assert not list(dst.parent.glob(".*tmp*"))                           # no temporary directory left behind


def test_drafter_copied_unchanged(fp32_checkpoint, int4_checkpoint):
    dst, _ = int4_checkpoint
    for f in (fp32_checkpoint / "drafter").iterdir():
        assert (dst / "drafter" / f.name).read_bytes() == f.read_bytes()


def test_safetensors_package_sees_format_dtypes_and_shapes(int4_checkpoint, tiny_cfg):
    dst, _ = int4_checkpoint
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    linear = names.target_linear_shapes(tiny_cfg)
    seen = 0
    for shard in sorted(set(idx["weight_map"].values())):
        with safe_open(str(dst / shard), framework="np") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                sl = f.get_slice(key)
                if key.endswith(".weight_packed"):
                    out, n = linear[key[: -len(".weight_packed")]]
                    assert (sl.get_dtype(), sl.get_shape()) == ("I32", [out, -(-n // 8)])
                    seen += 1
                elif key.endswith(".weight_scale"):
                    out, n = linear[key[: -len(".weight_scale")]]
                    assert (sl.get_dtype(), sl.get_shape()) == ("BF16", [out, n // 32])
                elif key.endswith(".weight_shape"):
                    assert sl.get_dtype() in ("I32", "I64") and sl.get_shape() == [2]
                    assert f.get_tensor(key).tolist() == list(linear[key[: -len(".weight_shape")]])
                else:
                    assert sl.get_dtype() == "F32"
    assert seen == 3 * tiny_cfg.n_routed_experts


def _ct_unpack(packed, scale, shape):
    """compressed-tensors' unpack_from_int32 + dequantize, transcribed in torch (the reference tool's math)."""
    import torch

    out, n = (int(v) for v in shape)
    unpacked = torch.zeros((packed.shape[0], packed.shape[1] * 8), dtype=torch.int32)
    for i in range(8):
        unpacked[:, i::8] = (packed >> (4 * i)) & 0xF                    # arithmetic shift, masked
    q = (unpacked[:, :n] - 8).to(torch.int8)
    group = n // scale.shape[1]
    return q.float() * scale.float().repeat_interleave(group, dim=1)


def test_torch_reads_the_files_and_dequantizes_like_compressed_tensors(fp32_checkpoint, int4_checkpoint):
    torch = pytest.importorskip("torch")
    dst, _ = int4_checkpoint
    _, src = _all(fp32_checkpoint)
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    m = "model.layers.1.mlp.experts.5.down_proj"
    with safe_open(str(dst / idx["weight_map"][f"{m}.weight_packed"]), framework="pt") as f:
        packed, scale, shape = (f.get_tensor(f"{m}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape"))
    assert (packed.dtype, scale.dtype) == (torch.int32, torch.bfloat16)
    ref = _ct_unpack(packed, scale, shape).numpy()
    w = src[f"{m}.weight"]
    step = np.repeat(scale.float().numpy(), 32, axis=1)
    assert (np.abs(ref - w) <= 0.5 * step * (1 + 1e-6)).all()            # within half a step, per group
    ours = Int4Weight.from_tensors(m, packed.numpy(), scale, shape.numpy(), 32).dequantize()
    assert np.array_equal(ours, ref)


def test_unquantized_tensors_are_bit_identical(fp32_checkpoint, int4_checkpoint):
    dst, _ = int4_checkpoint
    _, src = _all(fp32_checkpoint)
    _, out = _all(dst)
    for name, a in src.items():
        if name in out:
            assert out[name].dtype == a.dtype and np.array_equal(out[name], a), name
        else:
            assert name.endswith(".weight") and ".experts." in name
            m = name[: -len(".weight")]
            W = Int4Weight.from_tensors(m, out[f"{m}.weight_packed"], out[f"{m}.weight_scale"],
                                        out[f"{m}.weight_shape"], 32)
            assert np.abs(W.dequantize() - a).max() <= 0.5 * W.scale.max() * (1 + 1e-6)


def test_every_linear_with_empty_ignore(fp32_checkpoint, tmp_path, tiny_cfg, make_quant_cfg):
    summary = quantize_checkpoint(fp32_checkpoint, tmp_path / "all", make_quant_cfg("int4_w4a16", ignore=[]))
    assert summary["quantized_modules"] == len(names.target_linear_shapes(tiny_cfg))
    config = json.loads((tmp_path / "all" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == []


def test_refuses_bad_requests_with_one_line(fp32_checkpoint, int4_checkpoint, tmp_path, make_quant_cfg):
    dst, _ = int4_checkpoint
    with pytest.raises(ConfigError, match="quant.method=fp32 has no quantization_config; use quant=int4_w4a16"):
        quantize_checkpoint(fp32_checkpoint, tmp_path / "x", make_quant_cfg("fp32"))
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(dst, tmp_path / "y", make_quant_cfg("int4_w4a16"))
    with pytest.raises(CheckpointError, match="already exists and is not empty; remove it or choose another dst"):
        quantize_checkpoint(fp32_checkpoint, dst, make_quant_cfg("int4_w4a16"))
    with pytest.raises(ConfigError, match=r"in=128 is not a multiple of quant.group_size=48"):
        quantize_checkpoint(fp32_checkpoint, tmp_path / "z", make_quant_cfg("int4_w4a16", group_size=48))
    assert not (tmp_path / "z").exists() and not list(tmp_path.glob(".*"))   # nothing half-written


def test_module_is_quantized_follows_targets_and_ignore(tiny_cfg, make_quant_cfg):
    k2 = make_quant_cfg("int4_w4a16")
    lin = names.target_linear_shapes(tiny_cfg)
    chosen = sorted(m for m in lin if module_is_quantized(m, k2))
    assert chosen == sorted(m for m in lin if ".mlp.experts." in m)     # K2: routed experts only
    assert not module_is_quantized("model.layers.1.mlp.experts.0.up_proj", make_quant_cfg("fp32"))
    assert all(module_is_quantized(m, make_quant_cfg("int4_w4a16", ignore=[])) for m in lin)
    only = make_quant_cfg("int4_w4a16", targets=["re:.*down_proj$"],
                          ignore=["model.layers.1.mlp.experts.7.down_proj"])
    assert module_is_quantized("model.layers.1.mlp.experts.0.down_proj", only)
    assert not module_is_quantized("model.layers.1.mlp.experts.7.down_proj", only)
    assert not module_is_quantized("model.layers.1.mlp.experts.0.up_proj", only)


def test_single_file_checkpoint_stays_single_file(tmp_path, tiny_cfg, make_quant_cfg):
    from kdtree.checkpoint.hf_config import target_config_json
    from kdtree.checkpoint.writer import write_checkpoint

    src = write_checkpoint(tmp_path / "one", names.init_weights(names.target_tensor_shapes(tiny_cfg), seed=2),
                           target_config_json(tiny_cfg), max_shard_bytes=0)   # model.safetensors, no index
    quantize_checkpoint(src, tmp_path / "q", make_quant_cfg("int4_w4a16"))
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="np") as f:
        assert f.get_slice("model.layers.1.mlp.experts.0.up_proj.weight_packed").get_dtype() == "I32"


@pytest.mark.parametrize("strategy", ["mmap", "eager"])
def test_raw_load_returns_the_stored_parts_and_the_default_load_assembles_them(int4_checkpoint, tiny_cfg,
                                                                               make_quant_cfg, strategy):
    from kdtree.checkpoint.loader import load_checkpoint

    dst, _ = int4_checkpoint
    _, stored = _all(dst)
    quant = make_quant_cfg("int4_w4a16")
    raw, _ = load_checkpoint(dst, tiny_cfg, quant, strategy=strategy, raw=True)
    assert set(raw) == set(stored)
    for name, a in stored.items():
        assert raw[name].dtype == a.dtype and np.array_equal(raw[name], a), name
    loaded, _ = load_checkpoint(dst, tiny_cfg, quant, strategy=strategy)
    m = next(n[: -len(".weight_packed")] for n in stored if n.endswith(".weight_packed"))
    W = loaded[f"{m}.weight"]
    assert isinstance(W, Int4Weight)
    assert np.array_equal(W.dequantize(), Int4Weight.from_tensors(m, raw[f"{m}.weight_packed"], raw[f"{m}.weight_scale"],
                                                                  raw[f"{m}.weight_shape"], 32).dequantize())
