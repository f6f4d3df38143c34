// The model families kiln ships with, and the tables read from them. A family joins the engine with
// its file (model/<family>.cpp, defining its FamilySpec) and its line here: the spec function
// declared below and called in the list.
#include <map>
#include <string>
#include <vector>

#include "model/family.h"
#include "model/llama.h"
#include "model/qwen3_5.h"

namespace kiln {

FamilySpec llama_family();    // model/llama.cpp: llama (Llama-2/3, MiniCPM5), qwen2
FamilySpec qwen3_family();    // model/qwen3.cpp: qwen3, on the llama graph code
FamilySpec qwen3_5_family();  // model/qwen3_5.cpp: qwen3_5_text, qwen3_next, the qwen3_5 wrapper

const FamilyList& builtin_families() {
  // The order is the profile ladder's and the order errors list model types in.
  static const FamilyList families({llama_family(), qwen3_family(), qwen3_5_family()});
  return families;
}

namespace {

// What each graph allocates (engine/memory_plan.h), attached to its implementations by graph name
// (issue 26 item 4 replaces these hand-kept lists with a dry run).
struct MemoryLists {
  ModelImplementation::CacheTensorBytes cache_tensor_bytes;
  ModelImplementation::StepTensorBytes step_tensor_bytes;
};

const std::map<std::string, MemoryLists>& memory_lists() {
  static const std::map<std::string, MemoryLists> lists = {
      {"llama", {llama_cache_tensor_bytes, llama_step_tensor_bytes}},
      {"qwen3", {llama_cache_tensor_bytes, llama_step_tensor_bytes}},
      {"qwen3_5", {qwen3_5_cache_tensor_bytes, qwen3_5_step_tensor_bytes}},
  };
  return lists;
}

}  // namespace

const ImplementationRegistry& builtin_registry() {
  static const ImplementationRegistry registry([] {
    std::vector<ModelImplementation> implementations = family_implementations(builtin_families());
    for (ModelImplementation& implementation : implementations) {
      const auto lists = memory_lists().find(implementation.id);
      if (lists == memory_lists().end()) continue;  // the registry refuses it, naming the implementation
      implementation.cache_tensor_bytes = lists->second.cache_tensor_bytes;
      implementation.step_tensor_bytes = lists->second.step_tensor_bytes;
    }
    return implementations;
  }());
  return registry;
}

const SanitizerTable& builtin_sanitizers() {
  static const SanitizerTable sanitizers = family_sanitizers(builtin_families());
  return sanitizers;
}

const ProfileTable& builtin_profile_table() {
  static const ProfileTable table = family_profiles(builtin_families());
  return table;
}

}  // namespace kiln
