// The implementations and checkpoint sanitizers kiln ships with. A family graph joins the engine
// by adding its implementations (one per backend it runs on) and its sanitizer here.
#include "model/llama.h"
#include "model/loader.h"
#include "model/qwen3_5.h"
#include "model/qwen3_5_checkpoint.h"
#include "model/registry.h"

namespace kiln {
namespace {

// The dense graph (model/llama.cpp) serves both the llama and the qwen3 graph: it is written
// against the Backend interface alone, so it runs on every backend. Every graph here splits over
// tensor-parallel ranks (model/tensor_parallel.h).
std::vector<ModelImplementation> builtin_implementations() {
  std::vector<ModelImplementation> implementations;
  for (Graph graph : {Graph::Llama, Graph::Qwen3})
    for (Device device : {Device::CPU, Device::CUDA})
      implementations.push_back(
          {std::string(graph_name(graph)), graph, Loader::Safetensors, Loop::Autoregressive, device,
           [](WeightMap& weights, const ModelConfig& config, const ResolvedProfile&, Backend& backend) {
             return make_llama_model(weights, config, backend);
           },
           TensorParallelSupport{check_llama_tensor_parallel, llama_tensor_shard,
                                 [](WeightMap& weights, const ModelConfig& config, const ResolvedProfile&,
                                    Backend& backend, const TensorParallelRank& rank) {
                                   return make_llama_model(weights, config, backend, rank);
                                 }}});
  // The hybrid graph (model/qwen3_5.cpp) needs the backend's HybridOps: the CPU and CUDA have them.
  for (Device device : {Device::CPU, Device::CUDA})
    implementations.push_back(
        {std::string(graph_name(Graph::Qwen3_5)), Graph::Qwen3_5, Loader::Safetensors, Loop::HybridRecurrent, device,
         [](WeightMap& weights, const ModelConfig& config, const ResolvedProfile&, Backend& backend) {
           return make_qwen3_5_model(weights, config, backend);
         },
         TensorParallelSupport{check_qwen3_5_tensor_parallel, qwen3_5_tensor_shard,
                               [](WeightMap& weights, const ModelConfig& config, const ResolvedProfile&,
                                  Backend& backend, const TensorParallelRank& rank) {
                                 return make_qwen3_5_model(weights, config, backend, rank);
                               }}});
  return implementations;
}

}  // namespace

const ImplementationRegistry& builtin_registry() {
  static const ImplementationRegistry registry(builtin_implementations());
  return registry;
}

const SanitizerTable& builtin_sanitizers() {
  // Llama-family and Qwen3 checkpoints are stored under the graph's canonical names.
  static const SanitizerTable sanitizers({
      {Graph::Llama, [](const Checkpoint& checkpoint, const ModelConfig&) { return identity_plan(checkpoint); }},
      {Graph::Qwen3, [](const Checkpoint& checkpoint, const ModelConfig&) { return identity_plan(checkpoint); }},
      // Qwen3.5 ships in two checkpoint generations (and Qwen3-Next in a third row layout).
      {Graph::Qwen3_5, [](const Checkpoint& checkpoint, const ModelConfig& config) {
         return plan_qwen3_5_checkpoint(checkpoint.tensors(), config);
       }},
  });
  return sanitizers;
}

}  // namespace kiln
