// Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) on the CPU: the ops of spec A.6
// (shared/specs/architectures.md), as free functions the CPU backend exposes.
//
// Rounding model: activations, states and every intermediate are f32; weights (conv, A_log,
// dt_bias, gated-norm gain) are read in their stored dtype (F32, BF16 or F16) and widened exactly.
// Each op rounds once per arithmetic operation in f32, in the order its comment gives — there is no
// intermediate bf16 rounding (a bf16 backend rounds once at the op's output, like the fused
// causal_conv1d / FLA kernels of spec A.6.2 and A.4 #2).
//
// Invariance: every reduction runs in index order inside one task, and tasks are (sequence, head)
// or (token) — so no result bit depends on the thread count, on the other sequences in the batch,
// or on how a sequence's tokens are split across calls (see gated_delta_rule_chunked for the one
// place where the split matters, and the rule that keeps it invariant at multiples of 64).
//
// Per-sequence state lives in caller-owned tensors with one row per cache slot. A span whose
// first_position is 0 starts a fresh sequence: it reads its slot's state as zeros, whatever the
// slot holds, so a reused slot needs no reset.
#pragma once

#include <cstdint>
#include <span>

#include "backend/backend.h"
#include "core/tensor.h"

namespace kiln::cpu {

// Depthwise causal conv fused with SiLU and the conv-state update (spec A.6.2), per channel c:
//   s[t, c] = Σ_{j=0}^{K-1} weight[c, j] · u[t - (K-1) + j, c]   (j ascending, f32)
//   out[t, c] = s / (1 + exp(-s))
// where u is the sequence's input: x rows of its span, preceded by its slot's conv_state rows
// (the previous K-1 inputs; zeros for a span at position 0). Afterwards the slot's conv_state
// holds the last K-1 inputs of the sequence so far (older state rows included when the span has
// fewer than K-1 tokens).
//   x [T, C] f32, weight [C, K] (F32/BF16/F16), conv_state [slots, K-1, C] f32, out [T, C] f32.
void causal_conv1d_silu(const Tensor& x, const Tensor& weight, std::span<const SequenceSpan> spans,
                        Tensor& conv_state, Tensor& out);

// Splits the conv output qkv [T, Hk·dk + Hk·dk + Hv·dv] (q | k | v, head-major, spec A.6.3) into
// contiguous q, k [T, Hk, dk] and v [T, Hv, dv], L2-normalising q and k per head and scaling q:
//   k̂ = k · (1 / sqrt(Σ_i k_i² + 1e-6))       (Σ in index order, f32)
//   q̃ = (q · (1 / sqrt(Σ_i q_i² + 1e-6))) · f32(dk^-½)
void gated_delta_prepare_qkv(const Tensor& qkv, int64_t key_heads, int64_t key_dim, int64_t value_heads,
                             int64_t value_dim, Tensor& q, Tensor& k, Tensor& v);

// The per-token gates (spec A.6.3), in f32:
//   beta = 1 / (1 + exp(-b))
//   g = -exp(A_log) · softplus(a + dt_bias),  softplus(x) = x > 20 ? x : log1p(exp(x))  (torch)
//   b, a [T, Hv] f32; a_log, dt_bias [Hv] (F32/BF16/F16); beta, g [T, Hv] f32.
void gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                       Tensor& beta, Tensor& g);

// The recurrent gated delta rule (spec A.6.4), token by token, for every value head h (key head
// h / (Hv/Hk)), with S the slot's [dk, dv] state:
//   S ← exp(g)·S;  m = Sᵀk (Σ over dk ascending);  δ = (v − m)·β;  S ← S + k δᵀ;  o = Sᵀq
//   q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [slots, Hv, dk, dv]; out [T, Hv, dv].
// Reads each span's state from its slot (zeros at position 0) and leaves the updated state there.
void gated_delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, std::span<const SequenceSpan> spans, Tensor& state,
                                Tensor& out);

// The gated delta rule for prefill: the chunked (WY) form of spec A.6.5 for every whole chunk of
// `chunk` positions that is aligned to an absolute position multiple of `chunk` and lies entirely
// inside the span; the recurrent steps of gated_delta_rule_recurrent for every other token (the
// head of a span that starts mid-chunk, and the tail of one that ends mid-chunk). The choice is a
// pure function of the span's positions, so:
//   - a prefill split at multiples of `chunk` is bit-identical to the one-shot prefill;
//   - an append of fewer than `chunk` tokens is bit-identical to decoding them one at a time;
//   - a sequence's results do not depend on the other sequences of the batch.
// Same tensors as gated_delta_rule_recurrent. Within a chunk of local indices 0..C-1, with
// Γ_ij = exp(g_i + g_{i-1} + … + g_{j+1}) (summed in that order; Γ_ii = 1),
// D_i = exp(g_i + … + g_1 + g_0) and S the state at the chunk start:
//   Δ_i = β_i·(v_i − D_i·Sᵀk_i) − Σ_{j<i} ((β_i·(k_i·k_j))·Γ_ij) · Δ_j     (j ascending)
//   o_i = D_i·Sᵀq_i + Σ_{j≤i} ((q_i·k_j)·Γ_ij) · Δ_j                       (j ascending)
//   S ← D_{C-1}·S + Σ_j (k_j·Γ_{C-1,j}) Δ_jᵀ                                (j ascending)
// which is spec A.6.5 with (I + A)⁻¹ applied by forward substitution to its right-hand side, and
// every dot product over dk in ascending order.
void gated_delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, std::span<const SequenceSpan> spans, Tensor& state,
                              Tensor& out, int64_t chunk = kGatedDeltaChunk);

// The gated RMSNorm of the GDN output (spec A.4 #2), per row of dv = weight.numel() elements:
//   out = ((x · (1 / sqrt(Σ x² / dv + eps))) · w) · (z / (1 + exp(-z)))
// all in f32 with one rounding per operation (FLA's fused form; HF's torch fallback rounds to the
// model dtype after the norm and after ·w, which an f32 model does not see).
//   x, z, out [..., dv] f32 (same shape); weight [dv] (F32/BF16/F16).
void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out);

}  // namespace kiln::cpu
