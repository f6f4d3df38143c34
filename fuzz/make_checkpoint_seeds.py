#!/usr/bin/env python3
"""Writes the checkpoint seeds of the safetensors and load_plan fuzz targets (fuzz/corpus/).

Each load_plan seed is config.json, a NUL byte, then model.safetensors: a miniature of one
checkpoint generation the loader accepts (hidden size 8, one or two layers), small enough for a
fuzzer to mutate quickly, with zero-filled weights. The safetensors seeds are the same files alone
plus hand-made broken ones. Usage: fuzz/make_checkpoint_seeds.py (rewrites the seed files).
"""
import json
import os
import struct

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4, "I32": 4, "F8_E4M3": 1}


def safetensors(tensors, dtype="BF16", metadata=None):
    """tensors: [(name, shape)] or [(name, shape, dtype)] → the bytes of a safetensors file with
    zeroed data (a tensor without its own dtype takes `dtype`)."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, shape, *own in tensors:
        dtype_of = own[0] if own else dtype
        size = DTYPE_BYTES[dtype_of]
        for extent in shape:
            size *= extent
        header[name] = {"dtype": dtype_of, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # writers pad the header to 8 bytes
    return struct.pack("<Q", len(text)) + text + bytes(offset)


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 2, "vocab_size": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
         "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
         "torch_dtype": "bfloat16"}
QWEN3 = dict(LLAMA, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 8,
           "intermediate_size": 16, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 16,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
           "linear_conv_kernel_dim": 4, "linear_key_head_dim": 4, "linear_num_key_heads": 1,
           "linear_num_value_heads": 2, "linear_value_head_dim": 4, "partial_rotary_factor": 0.25,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True},
           "dtype": "bfloat16"}
QWEN3_5_VL = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": dict(QWEN3_5, tie_word_embeddings=False), "tie_word_embeddings": False,
              "vision_config": {"depth": 1, "hidden_size": 4}}


def dense_layer(prefix, config, qk_norm):
    hidden, inter, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = [(prefix + "input_layernorm.weight", [hidden]),
               (prefix + "self_attn.q_proj.weight", [heads * head, hidden]),
               (prefix + "self_attn.k_proj.weight", [kv * head, hidden]),
               (prefix + "self_attn.v_proj.weight", [kv * head, hidden]),
               (prefix + "self_attn.o_proj.weight", [hidden, heads * head]),
               (prefix + "post_attention_layernorm.weight", [hidden]),
               (prefix + "mlp.gate_proj.weight", [inter, hidden]),
               (prefix + "mlp.up_proj.weight", [inter, hidden]),
               (prefix + "mlp.down_proj.weight", [hidden, inter])]
    if qk_norm:
        tensors += [(prefix + "self_attn.q_norm.weight", [head]), (prefix + "self_attn.k_norm.weight", [head])]
    return tensors


def dense_model(config, qk_norm):
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = [("model.embed_tokens.weight", [vocab, hidden])]
    for layer in range(config["num_hidden_layers"]):
        tensors += dense_layer(f"model.layers.{layer}.", config, qk_norm)
    tensors.append(("model.norm.weight", [hidden]))
    if not config["tie_word_embeddings"]:
        tensors.append(("lm_head.weight", [vocab, hidden]))
    return tensors


def hybrid_model(config, prefix="model.", conv="hf", grouped=False):
    """Qwen3.5 text tensors; conv "hf" is [C, 1, K], "mlx" [C, K, 1]; grouped: Qwen3-Next projections."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    kernel = config["linear_conv_kernel_dim"]
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    tensors = [(prefix + "embed_tokens.weight", [vocab, hidden])]
    for layer, kind in enumerate(config["layer_types"]):
        p = f"{prefix}layers.{layer}."
        tensors += [(p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden]),
                    (p + "mlp.gate_proj.weight", [inter, hidden]), (p + "mlp.up_proj.weight", [inter, hidden]),
                    (p + "mlp.down_proj.weight", [hidden, inter])]
        if kind == "linear_attention":
            a = p + "linear_attn."
            tensors += [(a + "A_log", [value_heads]), (a + "dt_bias", [value_heads]),
                        (a + "conv1d.weight", [channels, 1, kernel] if conv == "hf" else [channels, kernel, 1]),
                        (a + "norm.weight", [value_dim]), (a + "out_proj.weight", [hidden, value_heads * value_dim])]
            if grouped:
                tensors += [(a + "in_proj_qkvz.weight", [channels + value_heads * value_dim, hidden]),
                            (a + "in_proj_ba.weight", [2 * value_heads, hidden])]
            else:
                tensors += [(a + "in_proj_qkv.weight", [channels, hidden]),
                            (a + "in_proj_z.weight", [value_heads * value_dim, hidden]),
                            (a + "in_proj_b.weight", [value_heads, hidden]),
                            (a + "in_proj_a.weight", [value_heads, hidden])]
        else:
            s = p + "self_attn."
            tensors += [(s + "q_proj.weight", [2 * heads * head, hidden]), (s + "k_proj.weight", [kv * head, hidden]),
                        (s + "v_proj.weight", [kv * head, hidden]), (s + "o_proj.weight", [hidden, heads * head]),
                        (s + "q_norm.weight", [head]), (s + "k_norm.weight", [head])]
    tensors.append((prefix + "norm.weight", [hidden]))
    return tensors


# Quantized miniatures: every input width 32 (one group of 32, one 128x128 FP8 block).
LLAMA_32 = dict(LLAMA, hidden_size=32, intermediate_size=32, head_dim=8)
GROUP = 32


def quantized(tensors, method):
    """The dense tensors with every 2-D Linear (and, for MLX, the embedding and head) quantized."""
    out = []
    for name, shape in tensors:
        rows, columns = shape if len(shape) == 2 else (0, 0)
        module = name[: -len(".weight")]
        linear = ".layers." in name and len(shape) == 2
        if method == "mlx" and len(shape) == 2:
            bits = 8 if module == "model.embed_tokens" else 4  # the per-module entry of QUANTIZATION["mlx"]
            out += [(name, [rows, columns * bits // 32], "U32"), (module + ".scales", [rows, columns // GROUP]),
                    (module + ".biases", [rows, columns // GROUP])]
        elif method == "fp8" and linear:
            out += [(name, shape, "F8_E4M3"), (name + "_scale_inv", [1, 1], "F32")]
        elif method == "awq" and linear:
            out += [(module + ".qweight", [columns, rows // 8], "I32"),
                    (module + ".qzeros", [columns // GROUP, rows // 8], "I32"),
                    (module + ".scales", [columns // GROUP, rows], "F16")]
        elif method == "gptq" and linear:
            out += [(module + ".qweight", [columns // 8, rows], "I32"),
                    (module + ".qzeros", [columns // GROUP, rows // 8], "I32"),
                    (module + ".scales", [columns // GROUP, rows], "F16"), (module + ".g_idx", [columns], "I32")]
        else:
            out.append((name, shape))
    return out


QUANTIZATION = {
    "mlx": {"quantization": {"group_size": GROUP, "bits": 4, "model.embed_tokens": {"group_size": GROUP, "bits": 8}}},
    "fp8": {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}},
    "awq": {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                                    "zero_point": True}},
    "gptq": {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                     "sym": True}},
}


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    with open(os.path.join(CORPUS, target, name), "wb") as out:
        out.write(data)


def main():
    text_vl = QWEN3_5_VL["text_config"]
    models = {
        "llama-bf16": (LLAMA, safetensors(dense_model(LLAMA, False), metadata={"format": "pt"})),
        "llama-f32": (LLAMA, safetensors(dense_model(LLAMA, False), "F32")),
        "qwen3-f16": (QWEN3, safetensors(dense_model(QWEN3, True), "F16")),
        "qwen3_5-text": (QWEN3_5, safetensors(hybrid_model(QWEN3_5))),
        "qwen3_5-vl-mtp": (QWEN3_5_VL, safetensors(
            hybrid_model(text_vl, "model.language_model.") + [("lm_head.weight", [16, 8]),
                                                              ("model.visual.blocks.0.attn.qkv.weight", [12, 4]),
                                                              ("mtp.fc.weight", [8, 16])])),
        "qwen3_5-mlx": (QWEN3_5_VL, safetensors(
            hybrid_model(text_vl, "language_model.model.", conv="mlx") +
            [("language_model.lm_head.weight", [16, 8]), ("vision_tower.blocks.0.norm1.weight", [4])])),
        "qwen3_next": (dict(QWEN3_5, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"]),
                       safetensors(hybrid_model(QWEN3_5, grouped=True))),
    }
    for method, fields in QUANTIZATION.items():
        config = dict(LLAMA_32, **fields)
        models["llama-" + method] = (config, safetensors(quantized(dense_model(LLAMA_32, False), method)))
    for name, (config, checkpoint) in models.items():
        write("load_plan", name, json.dumps(config).encode() + b"\0" + checkpoint)
        write("safetensors", name, checkpoint)

    # Broken files: each names the flaw the reader must report.
    good = models["llama-f32"][1]
    header_length = struct.unpack("<Q", good[:8])[0]
    write("safetensors", "truncated-header", good[: 8 + header_length // 2])
    write("safetensors", "truncated-data", good[: len(good) - 5])
    write("safetensors", "length-past-end", struct.pack("<Q", 1 << 40) + b"{}")
    write("safetensors", "short-file", b"\x10\x00\x00")
    write("safetensors", "empty-header", struct.pack("<Q", 2) + b"{}")

    def header_only(header):
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + bytes(16)

    write("safetensors", "huge-offsets", header_only(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551608, 18446744073709551615]}}))
    write("safetensors", "wrong-dtype", header_only({"a": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}))
    write("safetensors", "zero-extent", header_only(
        {"a": {"dtype": "BF16", "shape": [0, 4611686018427387904, 4], "data_offsets": [0, 0]}}))
    write("safetensors", "overlap", header_only({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}))
    write("safetensors", "nested-json", struct.pack("<Q", 2000) + b"[" * 1000 + b"]" * 1000)


if __name__ == "__main__":
    main()
