#!/usr/bin/env python3
"""Writes a random-weight F16 GGUF of a Llama shape, for llama.cpp's llama-quantize and llama-bench.

Issue 27 compares kiln's quantized decode with llama.cpp on the same shapes; there is no model hub
on the GPU machine, so the peer's models are made here: the Llama-3.1-8B or Llama-3.2-1B shape (or
a tiny one for a CPU check), N(0, 0.02) weights (so quantization meets realistic values), a
synthetic byte-level BPE vocabulary of the full size. llama-bench feeds random token ids, so only
the shapes, not the values or the vocabulary's contents, set its speed.

Uses llama.cpp's own gguf-py (numpy and pyyaml; bundled in its source): pass its folder with
--gguf-py. Tensors are streamed one at a time, so memory stays at the largest tensor (the 8B's
token embedding, 1 GiB).

  python3 bench/write_random_gguf.py --gguf-py /tmp/llama.cpp/gguf-py --shape llama-3.1-8b out.gguf
"""
import argparse
import math
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embedding: bool
    # Llama 3.1/3.2 config.json: rope_theta, rms_norm_eps, max_position_embeddings and the 'llama3'
    # rope_scaling block (factor, low/high_freq_factor, original_max_position_embeddings).
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context_length: int = 131072
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192


SHAPES = {
    "llama-3.1-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                          vocab=128256, tied_embedding=False),
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192,
                          vocab=128256, tied_embedding=True, rope_scaling_factor=32.0),
    # Row lengths are multiples of 256, the block of the K-quants (Q4_K_M), so every type applies.
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000,
                  tied_embedding=True, context_length=4096),
}

# Drawing 8e9 normals takes minutes; tensors are instead cut from one pool of draws at a random
# offset. The pool's length is odd, so consecutive rows and blocks never repeat in step.
POOL_LENGTH = (1 << 24) + 1


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: each byte as a printable character (as in its encoder.py)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def vocabulary(n_vocab):
    """Byte tokens, two merged tokens, fillers, then control tokens (BOS first, EOS second)."""
    n_control = min(256, n_vocab // 4)
    merged = ["to", "tok"]
    n_filler = n_vocab - 256 - len(merged) - n_control
    if n_filler < 0:
        raise SystemExit(f"write_random_gguf: a vocabulary of {n_vocab} tokens is too small (at least 344)")
    tokens = bytes_to_unicode() + merged + [f"tok{i}" for i in range(n_filler)]
    bos = len(tokens)
    tokens += ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(n_control - 2)]
    return tokens, ["t o", "to k"], bos


def llama3_rope_factors(shape):
    """Per-frequency divisors of Llama 3's rope scaling, as convert_hf_to_gguf.py writes them."""
    low_freq_wavelen = shape.rope_original_context / shape.rope_low_freq_factor
    high_freq_wavelen = shape.rope_original_context / shape.rope_high_freq_factor
    factors = []
    for i in range(0, shape.head_dim, 2):
        wavelen = 2 * math.pi * shape.rope_theta ** (i / shape.head_dim)
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(shape.rope_scaling_factor)
        else:
            smooth = ((shape.rope_original_context / wavelen - shape.rope_low_freq_factor)
                      / (shape.rope_high_freq_factor - shape.rope_low_freq_factor))
            factors.append(1.0 / ((1 - smooth) / shape.rope_scaling_factor + smooth))
    return factors


def tensor_shapes(shape):
    """(name, numpy shape, is_matrix) in llama.cpp's GGUF names; numpy order is [out, in]."""
    q_dim = shape.heads * shape.head_dim
    kv_dim = shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, shape.hidden), True
    yield "rope_freqs.weight", (shape.head_dim // 2,), False
    for layer in range(shape.layers):
        prefix = f"blk.{layer}."
        yield prefix + "attn_norm.weight", (shape.hidden,), False
        yield prefix + "attn_q.weight", (q_dim, shape.hidden), True
        yield prefix + "attn_k.weight", (kv_dim, shape.hidden), True
        yield prefix + "attn_v.weight", (kv_dim, shape.hidden), True
        yield prefix + "attn_output.weight", (shape.hidden, q_dim), True
        yield prefix + "ffn_norm.weight", (shape.hidden,), False
        yield prefix + "ffn_gate.weight", (shape.ffn, shape.hidden), True
        yield prefix + "ffn_up.weight", (shape.ffn, shape.hidden), True
        yield prefix + "ffn_down.weight", (shape.hidden, shape.ffn), True
    yield "output_norm.weight", (shape.hidden,), False
    if not shape.tied_embedding:
        yield "output.weight", (shape.vocab, shape.hidden), True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("output")
    args = parser.parse_args()

    sys.path.insert(0, args.gguf_py)
    import numpy as np
    import gguf

    shape = SHAPES[args.shape]
    rng = np.random.default_rng(args.seed)
    pool = (rng.standard_normal(POOL_LENGTH, dtype=np.float32) * 0.02).astype(np.float16)

    writer = gguf.GGUFWriter(args.output, "llama")
    writer.add_name(f"random {args.shape}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(shape.vocab)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    tokens, merges, bos = vocabulary(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * bos + [gguf.TokenType.CONTROL] * (len(tokens) - bos))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(bos + 1)

    shapes = list(tensor_shapes(shape))
    for name, dims, is_matrix in shapes:
        dtype = np.float16 if is_matrix else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, is_matrix in shapes:
        if name == "rope_freqs.weight":
            data = np.array(llama3_rope_factors(shape), dtype=np.float32)
        elif is_matrix:
            start = int(rng.integers(POOL_LENGTH))
            data = np.resize(np.concatenate((pool[start:], pool[:start])), dims)
        else:
            data = np.ones(dims, dtype=np.float32)
        writer.write_tensor_data(data)
    writer.close()


if __name__ == "__main__":
    main()
