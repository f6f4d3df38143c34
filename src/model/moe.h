// The sparse mixture-of-experts MLP of the qwen3_moe, qwen3_5_moe and qwen3_next graphs
// (transformers' Qwen3MoeSparseMoeBlock, Qwen3_5MoeSparseMoeBlock, Qwen3NextSparseMoeBlock;
// ../shared/specs/architectures.md A.7):
//
//   ℓ = x·W_routerᵀ                        (f32 out)
//   p = softmax(ℓ) over the E experts       (f32)
//   top = the k largest p (equal p: the lower expert id first)
//   w = p_top / Σ p_top  when normalize_top_k, else p_top
//   y = Σ_{e ∈ top, ascending e} w_e · FFN_e(x)           FFN_e: SwiGLU of width Ie
//     + σ(x·w_sharedᵀ) · FFN_shared(x)                    (where a shared expert exists)
//
// The sum runs in f32 in ascending expert id, then the shared expert (transformers adds its bf16
// terms in ascending expert id too; kiln keeps them f32, as it keeps the residual stream, model.h).
//
// Everything runs on the backend, with nothing read back: the router's matmul, the routing
// (Backend::moe_route, backend/moe_routing.h: the same bits on every backend), each token's
// experts' gate/up and down products (Backend::expert_matmul: a token reads only the experts it
// chose) and the weighted sum (Backend::moe_combine). A graph with sparse layers is therefore
// captured as a decode graph like any other.
//
// Invariance: routing is a function of the token's own logits, each expert product's element is
// the bits of the backend's matmul on that row (whose per-element order never depends on its row
// count, whichever kernel runs it), and moe_combine sums a token's terms in a fixed order, so a
// token's output is the same alone, batched, chunked or in a captured step.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/moe_routing.h"
#include "io/config.h"
#include "io/config_fields.h"
#include "io/fingerprint.h"
#include "io/safetensors.h"
#include "model/load_plan.h"
#include "model/synth.h"

namespace kiln {

// One configuration class's MoE fields and their defaults (from its transformers configuration file).
struct MoeFieldDefaults {
  int64_t experts = 0;  // num_experts (transformers v5 writes num_local_experts)
  int64_t experts_per_token = 0;
  int64_t expert_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // 0: the class has no shared expert
  bool normalize_top_k = false;
  bool normalize_field = true;      // false: no norm_topk_prob field, the class always renormalises
  bool sparse_step_fields = true;   // decoder_sparse_step and mlp_only_layers choose the sparse layers;
                                    // false: every layer is sparse
};

// Reads config.moe (checking top-k against the expert count, mlp_only_layers against the layers)
// and requires intermediate_size where a layer is dense. Errors name the field.
void read_moe_fields(const ConfigFields& text, ModelConfig& config, const MoeFieldDefaults& defaults);

// The graph-shaping MoE fields (io/fingerprint.h).
std::vector<GraphShapingField> moe_graph_shaping_fields();

// A sparse layer's weights, on the backend. The experts' matrices are stacked: gate and up
// [E · Ie, H], down [E · H, Ie]; expert e is rows e·N … e·N + N − 1 (Weight::rows).
struct SparseMoeWeights {
  Weight router;  // [E, H]
  Weight gate, up, down;
  Weight shared_gate, shared_up, shared_down;  // undefined without a shared expert
  Weight shared_expert_gate;                    // [1, H]
};

// Takes `prefix` + "mlp." tensors (model/moe.h's canonical names below) from `weights`.
//   mlp.gate.weight [E, H]; mlp.experts.{gate,up}_proj.weight [E, Ie, H]; mlp.experts.down_proj.weight [E, H, Ie];
//   mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, H]
SparseMoeWeights take_sparse_moe(WeightMap& weights, Backend& backend, const std::string& prefix,
                                 const ModelConfig& config);

// out (F32 [T, H]) = the sparse MLP of x ([T, H], activations). With experts_read (U32 [1] on the
// backend), the number of experts whose weights the call reads (the union of its tokens' choices)
// is added to it on the device (Backend::expert_matmul).
void sparse_moe(Backend& ops, const SparseMoeWeights& weights, const MoeConfig& moe, const Tensor& x, Tensor& out,
                Tensor* experts_read);

// Bytes a call reads of the layer when `experts_read` experts have tokens: the router, those
// experts and the shared expert. A batch-1 decode step reads experts_per_token of them.
size_t sparse_moe_bytes(const SparseMoeWeights& weights, const MoeConfig& moe, int64_t experts_read);
// Bytes of one expert's three matrices.
size_t sparse_moe_expert_bytes(const SparseMoeWeights& weights, const MoeConfig& moe);

// The weight bytes a graph's sparse layers read, counted as its forwards run: one experts_read
// counter per sparse layer on the backend (sparse_moe adds each call's experts), read back only
// when asked (Model::weight_bytes_read), which synchronises with the device.
class ExpertReadCounter {
 public:
  ExpertReadCounter() = default;
  ExpertReadCounter(Backend& backend, int64_t sparse_layers);
  // Layer `index`'s counter (sparse layers numbered from 0 in the order they run), or null when
  // there is none.
  Tensor* layer(int64_t index);
  // The experts each sparse layer read since the previous call (the counters wrap at 2³²: they
  // are read as differences, by a caller asking more often than every 2³² experts of a layer).
  std::vector<uint64_t> take();

 private:
  Backend* backend_ = nullptr;
  Tensor counts_;                  // U32 [sparse layers] on the backend
  std::vector<Tensor> layers_;     // a [1] view of counts_ per layer
  std::vector<uint32_t> taken_;    // what the previous take read
};

// A checkpoint tensor under the canonical name a sanitizer gave it.
struct CheckpointTensor {
  std::string name;  // in the checkpoint
  const TensorInfo* info = nullptr;
};

// The load plan of sparse layer `layer`'s experts, from any of the three layouts checkpoints store
// them in (names after the family's renaming, under the graph's `model.layers.{layer}.mlp.`):
//   per expert   experts.{e}.{gate,up,down}_proj.weight   (Qwen3-MoE / Qwen3-Next on the Hub, save_pretrained)
//   fused        experts.gate_up_proj [E, 2·Ie, H] (gate rows first), experts.down_proj [E, H, Ie]
//                                                          (transformers v5's in-memory form, Qwen3.5-MoE on the Hub)
//   mlx-lm       switch_mlp.{gate,up,down}_proj.weight [E, …] (stacked)
// onto the stacks take_sparse_moe takes. Every canonical name it plans from is added to `consumed`.
// Fails naming the layer and the tensor on a missing expert or router, an expert index past
// num_experts, two layouts in one layer, a router whose rows are not num_experts, or a misshapen
// expert tensor.
std::vector<PlannedTensor> plan_experts(const std::map<std::string, CheckpointTensor>& canonical, int64_t layer,
                                        const ModelConfig& config, std::set<std::string>& consumed);
// The same for the sparse layer whose canonical names begin with `prefix` ("model.layers.3.",
// "mtp.layers.0."), called `layer` in errors ("layer 3", "MTP layer 0").
std::vector<PlannedTensor> plan_experts(const std::map<std::string, CheckpointTensor>& canonical,
                                        const std::string& prefix, const std::string& layer, const ModelConfig& config,
                                        std::set<std::string>& consumed);

// A checkpoint already under canonical names but for its experts (Qwen3-MoE): the identity plan
// with each sparse layer's experts planned by plan_experts.
LoadPlan plan_moe_checkpoint(const std::map<std::string, TensorInfo>& tensors, const ModelConfig& config);

// The checkpoint tensors of a sparse layer's MLP for `kiln synth`: per expert, or fused (v5).
enum class ExpertLayout { PerExpert, Fused };
std::vector<SynthTensor> sparse_moe_synth_layout(const std::string& prefix, const ModelConfig& config,
                                                 ExpertLayout layout);

}  // namespace kiln
