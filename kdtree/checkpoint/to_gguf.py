"""A K2-family checkpoint as a GGUF file for llama.cpp's `deepseek2` architecture (F32 or BF16), for the peer benchmark.

    tensors = gguf_tensors(weights, model_cfg)          # [(gguf name, f32 array in llama.cpp's layout)]
    write_gguf(path, weights, model_cfg, tokenizer)     # metadata + vocabulary + tensors

The layout is what llama.cpp's convert_hf_to_gguf.py (DeepseekV2Model) writes for DeepseekV3/Kimi K2:
kv_b_proj split per head into attn_k_b (W_uk transposed, [H, L, nope]) and attn_v_b ([H, v, L]) for the
absorbed MLA form, routed experts stacked into ffn_{gate,up,down}_exps ([E, out, in]), the routing bias as
exp_probs_b, sigmoid gating, YaRN keys (yarn_log_mul = 0.1 * mscale_all_dim, which llama.cpp divides back),
MLA as MQA with one kv head. numpy shapes are row-major; GGUF stores the dims reversed (ggml's ne order).
The vocabulary's ids are the project tokenizer's ids: for the tiny model token i < 256 is byte i (GPT-2 byte
characters, no merges, pre-tokenizer kimi-k2), then bos/eos/mask/pad as control tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, List, Mapping, Tuple

import gguf
import gguf.quants
import numpy as np

from kdtree.errors import CheckpointError, ConfigError
from kdtree.model.names import is_moe_layer

ARCH = "deepseek2"


def _f32(w: Any, name: str) -> np.ndarray:
    """A weight as a C-contiguous float32 array (INT4 weights dequantized: the export is F32)."""
    if hasattr(w, "dequantize"):
        w = w.dequantize()
    if not isinstance(w, np.ndarray):
        raise CheckpointError(f"{name}: expected an array or a quantized weight, got {type(w).__name__}")
    return np.ascontiguousarray(w, dtype=np.float32)


def check_exportable(cfg) -> None:
    """llama.cpp's deepseek2 has no key for these K2 variations; refuse them with the key to change."""
    if int(cfg.moe_layer_freq) != 1:
        raise ConfigError(f"model.moe_layer_freq={cfg.moe_layer_freq}: llama.cpp's deepseek2 runs MoE in every layer "
                          f"after first_k_dense_replace; only moe_layer_freq=1 can be exported to GGUF")
    if str(cfg.scoring_func) != "sigmoid":
        raise ConfigError(f"model.scoring_func={cfg.scoring_func}: the GGUF export writes sigmoid gating (K2); "
                          f"use scoring_func=sigmoid")
    rs = cfg.rope_scaling
    if str(rs.type) == "yarn" and float(rs.factor) > 1.0 and float(rs.mscale) != float(rs.mscale_all_dim):
        raise ConfigError(f"model.rope_scaling.mscale={rs.mscale} != mscale_all_dim={rs.mscale_all_dim}: llama.cpp's "
                          f"deepseek2 has no key for the cos/sin magnitude this gives; only mscale == mscale_all_dim "
                          f"(K2: 1.0 and 1.0) can be exported")


def gguf_tensors(weights: Mapping[str, Any], cfg) -> Iterator[Tuple[str, np.ndarray]]:
    """(GGUF tensor name, f32 array) of every tensor llama.cpp's deepseek2 loads, in file order."""
    check_exportable(cfg)

    def w(name: str) -> np.ndarray:
        if name not in weights:
            raise CheckpointError(f"tensor {name} is missing from the weights of model={cfg.name}; "
                                  f"the checkpoint is incomplete")
        return _f32(weights[name], name)

    H, nope, v, L = (int(cfg.num_attention_heads), int(cfg.qk_nope_head_dim), int(cfg.v_head_dim),
                     int(cfg.kv_lora_rank))
    yield "token_embd.weight", w("model.embed_tokens.weight")                        # [V, D]
    yield "output_norm.weight", w("model.norm.weight")
    if "lm_head.weight" in weights or not cfg.tie_word_embeddings:
        yield "output.weight", w("lm_head.weight")                                    # absent = tied
    for i in range(int(cfg.num_hidden_layers)):
        p, b = f"model.layers.{i}", f"blk.{i}"
        a = f"{p}.self_attn"
        yield f"{b}.attn_norm.weight", w(f"{p}.input_layernorm.weight")
        yield f"{b}.attn_q_a_norm.weight", w(f"{a}.q_a_layernorm.weight")
        yield f"{b}.attn_kv_a_norm.weight", w(f"{a}.kv_a_layernorm.weight")
        yield f"{b}.attn_q_a.weight", w(f"{a}.q_a_proj.weight")
        yield f"{b}.attn_q_b.weight", w(f"{a}.q_b_proj.weight")
        yield f"{b}.attn_kv_a_mqa.weight", w(f"{a}.kv_a_proj_with_mqa.weight")
        kv_b = w(f"{a}.kv_b_proj.weight")                                             # [H*(nope+v), L]
        if kv_b.shape != (H * (nope + v), L):
            raise CheckpointError(f"{a}.kv_b_proj.weight has shape {kv_b.shape}, expected {(H * (nope + v), L)} "
                                  f"for model={cfg.name}")
        kv_b = kv_b.reshape(H, nope + v, L)
        yield f"{b}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))  # [H, L, nope]
        yield f"{b}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:, :])                     # [H, v, L]
        yield f"{b}.attn_output.weight", w(f"{a}.o_proj.weight")
        yield f"{b}.ffn_norm.weight", w(f"{p}.post_attention_layernorm.weight")
        m = f"{p}.mlp"
        if not is_moe_layer(cfg, i):
            for proj in ("gate", "up", "down"):
                yield f"{b}.ffn_{proj}.weight", w(f"{m}.{proj}_proj.weight")
            continue
        yield f"{b}.ffn_gate_inp.weight", w(f"{m}.gate.weight")                       # [E, D]
        yield f"{b}.exp_probs_b.bias", w(f"{m}.gate.e_score_correction_bias")          # [E]
        for proj in ("gate", "up", "down"):                                           # [E, out, in]
            yield f"{b}.ffn_{proj}_exps.weight", np.stack(
                [w(f"{m}.experts.{e}.{proj}_proj.weight") for e in range(int(cfg.n_routed_experts))])
        if int(cfg.n_shared_experts):
            for proj in ("gate", "up", "down"):
                yield f"{b}.ffn_{proj}_shexp.weight", w(f"{m}.shared_experts.{proj}_proj.weight")


def _byte_chars() -> List[str]:
    """GPT-2's byte -> printable unicode character table (what llama.cpp's byte-level BPE vocab holds)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return [table[i] for i in range(256)]


SPECIAL_NAMES = {"bos": "[BOS]", "eos": "[EOS]", "mask": "[MASK]", "pad": "[PAD]"}


def vocabulary(tokenizer, vocab_size: int) -> Tuple[List[str], List[int]]:
    """(token strings, gguf TokenType values) with id i = the project tokenizer's id i, `vocab_size` long."""
    normal, control, unused = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL),
                               int(gguf.TokenType.UNUSED))
    tokens: List[str] = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [unused] * vocab_size
    chars = _byte_chars()
    enc = getattr(tokenizer, "enc", None)
    if enc is None:                                                      # ByteTokenizer: id i < 256 = byte i
        for i in range(256):
            tokens[i], types[i] = chars[i], normal
    else:                                                                # tiktoken: the ranks' bytes
        specials = set(tokenizer.special_ids)
        for i in range(min(enc.n_vocab, vocab_size)):
            if i in specials:
                continue
            try:
                tokens[i] = "".join(chars[c] for c in enc.decode_single_token_bytes(i))
                types[i] = normal
            except KeyError:                                             # a gap in the ranks
                pass
        for name, i in tokenizer.special_tokens.items():
            if i < vocab_size:
                tokens[i], types[i] = name, control
    for kind, name in SPECIAL_NAMES.items():
        i = getattr(tokenizer, f"{kind}_id", None)
        if i is not None and 0 <= i < vocab_size and types[i] != control:
            tokens[i], types[i] = name, control
    seen = set()
    for i, t in enumerate(tokens):                                       # llama.cpp maps text -> id: keep unique
        if t in seen:
            tokens[i], types[i] = f"[DUP{i}]", unused
        seen.add(tokens[i])
    return tokens, types


DTYPES = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
QTYPES = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
          "q4_0": gguf.GGMLQuantizationType.Q4_0}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"export_gguf.dtype={dtype} is not a GGUF type this export writes; use f32 or bf16 "
                          f"(bf16: every matrix BF16, norms and biases F32, as convert_hf_to_gguf.py --outtype bf16), "
                          f"or q8_0 / q4_0 (llama.cpp's 8-/4-bit blocks of 32, for the peer's quantized rows)")
    return dtype


def file_dtype(path) -> str:
    """The weight type a GGUF file says it holds (general.file_type): f32, bf16, or llama.cpp's name of another."""
    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "?"
    ft = int(field.parts[field.data[0]][0])
    names = {int(v): k for k, v in DTYPES.items()}
    return names.get(ft) or gguf.LlamaFileType(ft).name.replace("MOSTLY_", "").lower()


def write_metadata(writer, cfg, tokenizer, dtype: str = "f32") -> None:
    """deepseek2 hyper-parameters, as convert_hf_to_gguf.py's DeepseekV2Model writes them, and the vocabulary."""
    writer.add_name(str(cfg.name))
    writer.add_file_type(DTYPES[check_dtype(dtype)])
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(int(cfg.num_attention_heads))
    writer.add_head_count_kv(1)                                          # MLA runs as MQA over the latent
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_vocab_size(int(cfg.vocab_size))
    writer.add_leading_dense_block_count(int(cfg.first_k_dense_replace))
    writer.add_q_lora_rank(int(cfg.q_lora_rank))
    writer.add_kv_lora_rank(int(cfg.kv_lora_rank))
    writer.add_key_length(int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim))
    writer.add_value_length(int(cfg.kv_lora_rank))
    writer.add_key_length_mla(int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim))
    writer.add_value_length_mla(int(cfg.v_head_dim))
    writer.add_rope_dimension_count(int(cfg.qk_rope_head_dim))
    writer.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
    writer.add_expert_count(int(cfg.n_routed_experts))
    writer.add_expert_used_count(int(cfg.num_experts_per_tok))
    writer.add_expert_shared_count(int(cfg.n_shared_experts))
    writer.add_expert_group_count(int(cfg.n_group))
    writer.add_expert_group_used_count(int(cfg.topk_group))
    writer.add_expert_weights_scale(float(cfg.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    rs = cfg.rope_scaling
    if str(rs.type) == "yarn" and float(rs.factor) > 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rs.factor))
        writer.add_rope_scaling_orig_ctx_len(int(rs.original_max_position_embeddings))
        writer.add_rope_scaling_yarn_beta_fast(float(rs.beta_fast))
        writer.add_rope_scaling_yarn_beta_slow(float(rs.beta_slow))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rs.mscale_all_dim))   # llama.cpp divides by 0.1 on load
    tokens, types = vocabulary(tokenizer, int(cfg.vocab_size))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("kimi-k2")                                  # the K2 family's; needs no merges
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(int(cfg.bos_token_id))
    writer.add_eos_token_id(int(cfg.eos_token_id))
    writer.add_pad_token_id(int(cfg.pad_token_id))
    writer.add_add_bos_token(False)                                      # kdtree's prompts carry no bos


def write_gguf(path, weights: Mapping[str, Any], cfg, tokenizer,
               progress: Callable[[str], None] = lambda name: None, dtype: str = "f32") -> dict:
    """Write the GGUF file at `path` (a temp name renamed in); -> {"path", "tensors", "bytes", "dtype"}.
    dtype bf16: every matrix rounded to BF16 (exact for weights that were BF16: quant=bf16, K2.6's non-experts);
    q8_0 / q4_0: every matrix whose rows are whole blocks of 32 in llama.cpp's block format (the others F32).
    1-D tensors (norms, the routing bias) stay F32, as llama.cpp's converter writes them."""
    check_dtype(dtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    write_metadata(writer, cfg, tokenizer, dtype)
    n = 0
    for name, array in gguf_tensors(weights, cfg):
        q = QTYPES.get(dtype)
        if q is not None and array.ndim >= 2 and array.shape[-1] % gguf.GGML_QUANT_SIZES[q][0] == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, q), raw_dtype=q)
        else:
            writer.add_tensor(name, array)
        progress(name)
        n += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return {"path": str(path), "tensors": n, "bytes": path.stat().st_size, "dtype": dtype}
