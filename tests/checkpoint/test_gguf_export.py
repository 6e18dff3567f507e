"""pipeline=export_gguf writes a GGUF that llama.cpp's deepseek2 reads: read back with the gguf package's reader,
every tensor equals the checkpoint's (kv_b_proj split per head, experts stacked), the metadata is DeepseekV3's,
and the vocabulary's ids are the project tokenizer's. Tiny (byte tokenizer, FP32) and a K2 layout (k26 config
scaled down: tiktoken tokenizer, INT4 routed experts dequantized)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from kdtree.checkpoint.hf_config import drafter_config_json, target_config_json
from kdtree.checkpoint.loader import load_checkpoint
from kdtree.checkpoint.quantize import quantize_checkpoint
from kdtree.checkpoint.to_gguf import _byte_chars
from kdtree.checkpoint.writer import write_checkpoint
from kdtree.engine import resolve_checkpoint
from kdtree.errors import ConfigError
from kdtree.model import names
from kdtree.pipeline.context import StageContext
from kdtree.pipeline.spec import load_pipeline
from kdtree.stages import export_gguf
from tests.tokenizer.test_tokenizers import write_bpe


def _export(cfg, run_dir: Path):
    events = []
    ctx = StageContext(cfg=cfg, run_dir=run_dir, emit=lambda kind, **f: events.append((kind, f)))
    out = export_gguf.run(ctx, export_gguf.ExportGgufConfig(**load_pipeline("export_gguf", cfg).stages[0].params))
    assert events and events[0][0] == "gguf_exported" and events[0][1]["path"] == out["path"]
    return out, gguf.GGUFReader(out["path"])


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(reader) -> dict:
    """name -> (GGUF shape in ggml's ne order, f32 array in numpy order)."""
    out = {}
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        out[t.name] = (tuple(int(d) for d in t.shape), np.array(t.data).reshape(tuple(reversed(t.shape))))
    return out


def _dense(w):
    return w.dequantize() if hasattr(w, "dequantize") else np.asarray(w, np.float32)


def _check_tensors(tensors: dict, weights: dict, m) -> None:
    """Every tensor llama.cpp's deepseek2 loads, with its ggml shape, equal to the checkpoint's weights."""
    H, nope, v, L, R = m.num_attention_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
    D, E, F, Fe, V = m.hidden_size, m.n_routed_experts, m.intermediate_size, m.moe_intermediate_size, m.vocab_size
    want = {"token_embd.weight": ((D, V), "model.embed_tokens.weight"),
            "output_norm.weight": ((D,), "model.norm.weight"),
            "output.weight": ((D, V), "lm_head.weight")}
    for i in range(m.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        want.update({
            f"{b}.attn_norm.weight": ((D,), f"{p}.input_layernorm.weight"),
            f"{b}.attn_q_a_norm.weight": ((m.q_lora_rank,), f"{p}.self_attn.q_a_layernorm.weight"),
            f"{b}.attn_kv_a_norm.weight": ((L,), f"{p}.self_attn.kv_a_layernorm.weight"),
            f"{b}.attn_q_a.weight": ((D, m.q_lora_rank), f"{p}.self_attn.q_a_proj.weight"),
            f"{b}.attn_q_b.weight": ((m.q_lora_rank, H * (nope + R)), f"{p}.self_attn.q_b_proj.weight"),
            f"{b}.attn_kv_a_mqa.weight": ((D, L + R), f"{p}.self_attn.kv_a_proj_with_mqa.weight"),
            f"{b}.attn_output.weight": ((H * v, D), f"{p}.self_attn.o_proj.weight"),
            f"{b}.ffn_norm.weight": ((D,), f"{p}.post_attention_layernorm.weight"),
        })
        # kv_b_proj [H*(nope+v), L]: per head nope k rows then v rows; k_b is stored transposed (absorbed q)
        kv_b = _dense(weights[f"{p}.self_attn.kv_b_proj.weight"]).reshape(H, nope + v, L)
        assert tensors[f"{b}.attn_k_b.weight"][0] == (nope, L, H)
        assert tensors[f"{b}.attn_v_b.weight"][0] == (L, v, H)
        np.testing.assert_array_equal(tensors[f"{b}.attn_k_b.weight"][1].transpose(0, 2, 1), kv_b[:, :nope])
        np.testing.assert_array_equal(tensors[f"{b}.attn_v_b.weight"][1], kv_b[:, nope:])
        if i < m.first_k_dense_replace:
            for proj, shape in (("gate", (D, F)), ("up", (D, F)), ("down", (F, D))):
                want[f"{b}.ffn_{proj}.weight"] = (shape, f"{p}.mlp.{proj}_proj.weight")
            continue
        want[f"{b}.ffn_gate_inp.weight"] = ((D, E), f"{p}.mlp.gate.weight")
        want[f"{b}.exp_probs_b.bias"] = ((E,), f"{p}.mlp.gate.e_score_correction_bias")
        for proj, shape in (("gate", (D, Fe)), ("up", (D, Fe)), ("down", (Fe, D))):
            want[f"{b}.ffn_{proj}_shexp.weight"] = (shape, f"{p}.mlp.shared_experts.{proj}_proj.weight")
            stacked = tensors[f"{b}.ffn_{proj}_exps.weight"]
            assert stacked[0] == shape + (E,)
            for e in range(E):
                np.testing.assert_array_equal(stacked[1][e], _dense(weights[f"{p}.mlp.experts.{e}.{proj}_proj.weight"]))
    for name, (shape, src) in want.items():
        assert tensors[name][0] == shape, name
        np.testing.assert_array_equal(tensors[name][1], _dense(weights[src]), err_msg=name)
    n_moe = m.num_hidden_layers - m.first_k_dense_replace
    assert len(tensors) == len(want) + 2 * m.num_hidden_layers + 3 * n_moe    # k_b, v_b; 3 stacked per MoE layer


def _check_metadata(fields: dict, m, n_vocab: int) -> None:
    a = "deepseek2"
    assert fields["general.architecture"] == a
    expect = {
        f"{a}.block_count": m.num_hidden_layers, f"{a}.context_length": m.max_position_embeddings,
        f"{a}.embedding_length": m.hidden_size, f"{a}.feed_forward_length": m.intermediate_size,
        f"{a}.attention.head_count": m.num_attention_heads, f"{a}.attention.head_count_kv": 1,
        f"{a}.leading_dense_block_count": m.first_k_dense_replace, f"{a}.vocab_size": m.vocab_size,
        f"{a}.attention.q_lora_rank": m.q_lora_rank, f"{a}.attention.kv_lora_rank": m.kv_lora_rank,
        f"{a}.attention.key_length": m.kv_lora_rank + m.qk_rope_head_dim,
        f"{a}.attention.value_length": m.kv_lora_rank,
        f"{a}.attention.key_length_mla": m.qk_nope_head_dim + m.qk_rope_head_dim,
        f"{a}.attention.value_length_mla": m.v_head_dim, f"{a}.rope.dimension_count": m.qk_rope_head_dim,
        f"{a}.expert_feed_forward_length": m.moe_intermediate_size, f"{a}.expert_count": m.n_routed_experts,
        f"{a}.expert_used_count": m.num_experts_per_tok, f"{a}.expert_shared_count": m.n_shared_experts,
        f"{a}.expert_weights_norm": True, f"{a}.expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        f"{a}.rope.scaling.type": "yarn",
        f"{a}.rope.scaling.original_context_length": m.rope_scaling.original_max_position_embeddings,
        "general.file_type": int(gguf.LlamaFileType.ALL_F32),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2",
        "tokenizer.ggml.bos_token_id": m.bos_token_id, "tokenizer.ggml.eos_token_id": m.eos_token_id,
        "tokenizer.ggml.padding_token_id": m.pad_token_id, "tokenizer.ggml.add_bos_token": False,
    }
    for k, v in expect.items():
        assert fields[k] == v, k
    close = {f"{a}.attention.layer_norm_rms_epsilon": m.rms_norm_eps, f"{a}.rope.freq_base": m.rope_theta,
             f"{a}.expert_weights_scale": m.routed_scaling_factor,
             f"{a}.rope.scaling.factor": m.rope_scaling.factor,
             f"{a}.rope.scaling.yarn_beta_fast": m.rope_scaling.beta_fast,
             f"{a}.rope.scaling.yarn_beta_slow": m.rope_scaling.beta_slow,
             f"{a}.rope.scaling.yarn_log_multiplier": 0.1 * m.rope_scaling.mscale_all_dim}   # llama.cpp: / 0.1
    for k, v in close.items():
        assert fields[k] == pytest.approx(v, rel=1e-6), k
    assert len(fields["tokenizer.ggml.tokens"]) == len(fields["tokenizer.ggml.token_type"]) == n_vocab


def test_tiny_export_reads_back_with_the_checkpoint_tensors_and_byte_ids(compose_cfg, tmp_path):
    cfg = compose_cfg("pipeline=export_gguf")
    out, reader = _export(cfg, tmp_path)
    assert out["path"] == str(tmp_path / "tiny-f32.gguf") and out["tensors"] == len(reader.tensors) == 70
    m = cfg.model
    weights, _ = load_checkpoint(resolve_checkpoint(cfg), m, cfg.quant)
    _check_tensors(_tensors(reader), weights, m)
    fields = _fields(reader)
    _check_metadata(fields, m, 260)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert tokens[:256] == _byte_chars() and len(set(tokens)) == 260          # id i < 256 = byte i
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "Ġ" and tokens[10] == "Ċ"  # GPT-2 byte characters
    assert tokens[256:] == ["[BOS]", "[EOS]", "[MASK]", "[PAD]"]
    assert types[:256] == [int(gguf.TokenType.NORMAL)] * 256 and types[256:] == [int(gguf.TokenType.CONTROL)] * 4


def test_export_path_from_the_config(compose_cfg, tmp_path):
    cfg = compose_cfg("pipeline=export_gguf", f"export_gguf.path={tmp_path / 'x' / 'mine.gguf'}")
    out, reader = _export(cfg, tmp_path / "run")
    assert out["path"] == str(tmp_path / "x" / "mine.gguf") and len(reader.tensors) == 70
    assert not list((tmp_path / "x").glob("*.tmp"))


K2_SMALL = ["model=k26", "model.tokenizer=tiktoken", "model.vocab_size=524", "model.hidden_size=64",
            "model.intermediate_size=128", "model.moe_intermediate_size=64", "model.num_hidden_layers=3",
            "model.num_attention_heads=4", "model.num_key_value_heads=4", "model.n_routed_experts=4",
            "model.num_experts_per_tok=2", "model.q_lora_rank=32", "model.kv_lora_rank=32",
            "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
            "model.bos_token_id=268", "model.eos_token_id=269", "model.mask_token_id=522", "model.pad_token_id=523",
            "model.drafter.num_attention_heads=4", "model.drafter.num_key_value_heads=2",
            "model.drafter.head_dim=16", "model.drafter.intermediate_size=64", "model.drafter.num_hidden_layers=1",
            "model.drafter.target_layer_ids=[1]"]


@pytest.fixture
def k2_layout_int4(compose_cfg, tmp_path):
    """A K2-layout checkpoint (k26 config scaled down) with INT4 routed experts and Kimi's tiktoken files."""
    cfg = compose_cfg("pipeline=export_gguf", *K2_SMALL, "quant=int4_w4a16")
    fp32 = tmp_path / "fp32"
    write_checkpoint(fp32, names.init_weights(names.target_tensor_shapes(cfg.model), seed=3),
                     target_config_json(cfg.model), max_shard_bytes=200_000)
    write_checkpoint(fp32 / "drafter", names.init_weights(names.drafter_tensor_shapes(cfg.model), seed=4),
                     drafter_config_json(cfg.model), max_shard_bytes=0)
    ckpt = tmp_path / "int4"
    quantize_checkpoint(fp32, ckpt, cfg.quant)
    assert write_bpe(ckpt / "tiktoken.model") == 268
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "268": {"content": "[BOS]"}, "269": {"content": "[EOS]"}, "522": {"content": "[MASK]"},
        "523": {"content": "[PAD]"}}}))
    return compose_cfg("pipeline=export_gguf", *K2_SMALL, "quant=int4_w4a16", f"model.path={ckpt}")


def test_k2_layout_int4_export_dequantizes_and_keeps_tiktoken_ids(k2_layout_int4, tmp_path):
    cfg = k2_layout_int4
    out, reader = _export(cfg, tmp_path / "run")
    m = cfg.model
    weights, _ = load_checkpoint(m.path, m, cfg.quant)
    assert hasattr(weights["model.layers.1.mlp.experts.0.up_proj.weight"], "dequantize")   # INT4 on disk
    _check_tensors(_tensors(reader), weights, m)
    fields = _fields(reader)
    _check_metadata(fields, m, 524)
    assert fields["deepseek2.rope.freq_base"] == 50000.0 and fields["deepseek2.rope.scaling.factor"] == 64.0
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    chars = _byte_chars()
    assert tokens[:256] == chars
    assert tokens[259] == "hello" and tokens[262] == "Ġwor"               # merged ranks as GPT-2 byte strings
    assert tokens[264] == "".join(chars[b] for b in "中文".encode())
    assert tokens[268:270] == ["[BOS]", "[EOS]"] and tokens[522:] == ["[MASK]", "[PAD]"]
    assert tokens[300] == "<|reserved_token_300|>" and types[300] == int(gguf.TokenType.CONTROL)
    assert len(set(tokens)) == 524


def test_unexportable_config_is_one_error(compose_cfg, tmp_path):
    cfg = compose_cfg("pipeline=export_gguf", "model.moe_layer_freq=2")
    with pytest.raises(ConfigError, match="moe_layer_freq=2: llama.cpp's deepseek2 runs MoE in every layer"):
        export_gguf.run(StageContext(cfg=cfg, run_dir=tmp_path), export_gguf.ExportGgufConfig())
    assert not list(tmp_path.iterdir())


def test_bf16_export_keeps_bf16_weights_exactly(compose_cfg, tmp_path):
    """quant=bf16 exports BF16 by default (export_gguf.dtype): every matrix BF16, norms and the routing bias F32,
    the values exactly the BF16 checkpoint's (widened, they equal an F32 export of the same weights)."""
    from kdtree.checkpoint.to_gguf import file_dtype
    out, reader = _export(compose_cfg("pipeline=export_gguf", "quant=bf16"), tmp_path / "bf16")
    assert out["path"].endswith("tiny-bf16.gguf") and out["dtype"] == "bf16" and file_dtype(out["path"]) == "bf16"
    f32, f32_reader = _export(compose_cfg("pipeline=export_gguf", "quant=bf16", "export_gguf.dtype=f32"),
                              tmp_path / "f32")
    assert file_dtype(f32["path"]) == "f32"
    wide = {t.name: np.array(t.data).reshape(tuple(reversed(t.shape))) for t in f32_reader.tensors}
    kinds = set()
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            bits = np.array(t.data).view(np.uint16).reshape(shape).astype(np.uint32) << 16
            got = bits.view(np.float32)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and len(shape) == 1, (t.name, t.tensor_type)
            got = np.array(t.data).reshape(shape)
        kinds.add(t.tensor_type)
        assert np.array_equal(got, wide[t.name]), t.name
    assert kinds == {gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F32}
    assert out["bytes"] < 0.6 * f32["bytes"]
    with pytest.raises(ConfigError, match="export_gguf.dtype=q8 .* use f32 or bf16"):
        _export(compose_cfg("pipeline=export_gguf", "export_gguf.dtype=q8"), tmp_path / "bad")


def test_cached_export_is_reused_until_the_checkpoint_changes(compose_cfg, tmp_path):
    """bench_peer's exports (export_gguf.cached_export): written once into <cache_dir>/gguf, not into each run dir;
    a later run reuses the file; a checkpoint file that changes makes a new export, and the stale one is removed."""
    import os
    import shutil

    ckpt = tmp_path / "cached_export_ckpt"
    shutil.copytree(resolve_checkpoint(compose_cfg("pipeline=export_gguf")), ckpt)
    cfg = compose_cfg("pipeline=export_gguf", f"model.path={ckpt}")
    events = []

    def ctx(run):
        (tmp_path / run).mkdir()
        return StageContext(cfg=cfg, run_dir=tmp_path / run, emit=lambda kind, **f: events.append(kind))

    first = export_gguf.cached_export(ctx("run1"))
    path = Path(first["path"])
    assert first["reused"] is False and path.is_file() and path.parent.name == "gguf"
    assert path.name.startswith("tiny-cached_export_ckpt-") and path.name.endswith("-f32.gguf")
    assert not list((tmp_path / "run1").iterdir())                       # nothing written into the run dir
    assert len(gguf.GGUFReader(str(path)).tensors) == 70
    again = export_gguf.cached_export(ctx("run2"))
    assert again["reused"] is True and again["path"] == first["path"] and again["bytes"] == path.stat().st_size
    assert events == ["gguf_exported", "gguf_reused"]
    shard = next(ckpt.glob("model-*.safetensors"))
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))          # the checkpoint changed
    third = export_gguf.cached_export(ctx("run3"))
    assert third["reused"] is False and third["path"] != first["path"] and Path(third["path"]).is_file()
    assert not path.exists()                                              # the stale export is gone
    assert export_gguf.cached_export(ctx("run4"), "bf16")["path"].endswith("-bf16.gguf")
    assert Path(third["path"]).is_file()                                  # another type: the f32 one stays
