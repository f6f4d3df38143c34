// The implementations and checkpoint sanitizers kiln ships with. A family graph joins the engine
// by adding its implementations (one per backend it runs on) and its sanitizer here.
#include "model/llama.h"
#include "model/loader.h"
#include "model/registry.h"

namespace kiln {
namespace {

// The dense graph (model/llama.cpp) serves both the llama and the qwen3 graph: it is written
// against the Backend interface alone, so it runs on every backend.
std::vector<ModelImplementation> dense_implementations() {
  std::vector<ModelImplementation> implementations;
  for (Graph graph : {Graph::Llama, Graph::Qwen3})
    for (Device device : {Device::CPU, Device::CUDA})
      implementations.push_back({std::string(graph_name(graph)), graph, Loader::Safetensors, Loop::Autoregressive,
                                 device,
                                 [](WeightMap& weights, const ModelConfig& config, const ResolvedProfile&,
                                    Backend& backend) { return make_llama_model(weights, config, backend); }});
  return implementations;
}

}  // namespace

const ImplementationRegistry& builtin_registry() {
  static const ImplementationRegistry registry(dense_implementations());
  return registry;
}

const SanitizerTable& builtin_sanitizers() {
  // Llama-family and Qwen3 checkpoints are stored under the graph's canonical names.
  static const SanitizerTable sanitizers({
      {Graph::Llama, [](const Checkpoint& checkpoint, const ModelConfig&) { return identity_plan(checkpoint); }},
      {Graph::Qwen3, [](const Checkpoint& checkpoint, const ModelConfig&) { return identity_plan(checkpoint); }},
  });
  return sanitizers;
}

}  // namespace kiln
