#!/usr/bin/env python3
"""Which bf16 rounding points make a Qwen3.5 row lose accuracy (docs/numerics.md).

Runs the first three layers of ../shared/fixtures/tiny/qwen3_5-text-tiny (its Gated DeltaNet layers)
in float64 with numpy, once exactly (the truth: it matches kiln's f32 CPU path to 1e-6) and once per
set of rounding points, rounding the named tensors to bf16 where kiln's CUDA bf16 path does:
  in      every matmul input (the tensor-core operands)
  proj    the GDN in-projection and MLP gate/up outputs
  conv    the conv + SiLU output
  beta    β = sigmoid(b) (torch rounds it; kiln keeps it f32)
  core    the recurrence output
  gn      the gated RMSNorm's three roundings
  swiglu  silu(gate) before the product
and prints each run's mean and worst per-row error (max|Δlogit| / max|logit|) and the error at a row.

Usage: qwen3_5_rounding_emulation.py [SHARED_DIR] [--row N]   (numpy only; a few seconds)
"""
import argparse
import json
import os
import struct

import numpy as np

POINTS = ["in", "proj", "conv", "beta", "core", "gn", "swiglu"]


def load_bf16_safetensors(path):
    blob = open(path, "rb").read()
    header_len = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + header_len])
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "BF16":
            raise SystemExit(f"{path}: {name} is {info['dtype']}, expected BF16")
        start, end = info["data_offsets"]
        raw = np.frombuffer(blob[8 + header_len + start : 8 + header_len + end], dtype=np.uint16)
        tensors[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"]).astype(np.float64)
    return tensors


def to_bf16(x):
    """Round to the nearest bf16, ties to even (through f32, as the kernels do)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


class Emulation:
    def __init__(self, fixture):
        self.w = load_bf16_safetensors(f"{fixture}/bf16/model.safetensors")
        self.config = json.load(open(f"{fixture}/bf16/config.json"))
        self.ids = json.load(open(f"{fixture}/ref.json"))["prompt_ids"]
        self.prefix = next(k for k in self.w if k.endswith("embed_tokens.weight"))[: -len("embed_tokens.weight")]
        self.layers = self.config["layer_types"].index("full_attention")  # the leading GDN layers

    def logits(self, rounded):
        c, w, p = self.config, self.w, self.prefix
        r = lambda point, x: to_bf16(x) if point in rounded else x
        eps = c["rms_norm_eps"]
        rms_norm_zc = lambda x, gain: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + gain)
        silu = lambda x: x / (1 + np.exp(-x))
        hk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
        hv, dv = c["linear_num_value_heads"], c["linear_value_head_dim"]
        taps = c["linear_conv_kernel_dim"]
        h = w[p + "embed_tokens.weight"][self.ids]
        tokens = h.shape[0]
        for i in range(self.layers):
            a = f"{p}layers.{i}.linear_attn."
            x = r("in", rms_norm_zc(h, w[f"{p}layers.{i}.input_layernorm.weight"]))
            qkv = r("proj", x @ w[a + "in_proj_qkv.weight"].T)
            z = r("proj", x @ w[a + "in_proj_z.weight"].T).reshape(tokens, hv, dv)
            b = r("proj", x @ w[a + "in_proj_b.weight"].T)
            alpha_in = r("proj", x @ w[a + "in_proj_a.weight"].T)
            kernel = w[a + "conv1d.weight"][:, 0, :]
            padded = np.vstack([np.zeros((taps - 1, qkv.shape[1])), qkv])
            conv = r("conv", silu(sum(kernel[:, j] * padded[j : j + tokens] for j in range(taps))))
            q = conv[:, : hk * dk].reshape(tokens, hk, dk)
            k = conv[:, hk * dk : 2 * hk * dk].reshape(tokens, hk, dk)
            v = conv[:, 2 * hk * dk :].reshape(tokens, hv, dv)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk**-0.5
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            beta = r("beta", 1 / (1 + np.exp(-b)))
            g = -np.exp(w[a + "A_log"]) * np.log1p(np.exp(alpha_in + w[a + "dt_bias"]))
            state = np.zeros((hv, dk, dv))
            core = np.zeros((tokens, hv, dv))
            group = hv // hk
            for t in range(tokens):
                for head in range(hv):
                    key = k[t, head // group]
                    state[head] *= np.exp(g[t, head])
                    state[head] += np.outer(key, beta[t, head] * (v[t, head] - state[head].T @ key))
                    core[t, head] = state[head].T @ q[t, head // group]
            core = r("core", core)
            normed = r("gn", core / np.sqrt((core * core).mean(-1, keepdims=True) + eps))
            gated = r("gn", r("gn", w[a + "norm.weight"] * normed) * silu(z))
            h = h + r("in", gated.reshape(tokens, -1)) @ w[a + "out_proj.weight"].T
            m = f"{p}layers.{i}.mlp."
            x = r("in", rms_norm_zc(h, w[f"{p}layers.{i}.post_attention_layernorm.weight"]))
            gate = r("proj", x @ w[m + "gate_proj.weight"].T)
            up = r("proj", x @ w[m + "up_proj.weight"].T)
            h = h + r("in", r("swiglu", silu(gate)) * up) @ w[m + "down_proj.weight"].T
        y = r("in", rms_norm_zc(h, w[p + "norm.weight"]))
        return y @ w[p + "embed_tokens.weight"].T


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shared", nargs="?", default=os.environ.get("KILN_SHARED_DIR", f"{here}/../../shared"))
    parser.add_argument("--row", type=int, default=187)
    args = parser.parse_args()
    fixture = f"{args.shared}/fixtures/tiny/qwen3_5-text-tiny"
    if not os.path.isdir(fixture):
        raise SystemExit(f"no fixture at {fixture}: pass the shared folder")
    emulation = Emulation(fixture)
    truth = emulation.logits(set())
    scale = np.abs(truth).max(1)
    print(f"first {emulation.layers} layers of qwen3_5-text-tiny; error = max|Δlogit| / max|logit| per row")
    runs = [("all", set(POINTS))] + [(f"all but {point}", set(POINTS) - {point}) for point in POINTS]
    for label, rounded in runs:
        error = np.abs(emulation.logits(rounded) - truth).max(1) / scale
        print(f"{label:16s} mean {error.mean():.5f}  row {args.row} {error[args.row]:.4f}  "
              f"worst {error.max():.4f} (row {error.argmax()})")


if __name__ == "__main__":
    main()
