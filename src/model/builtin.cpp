// The model families kiln ships with, and the tables read from them. A family joins the engine with
// its file (model/<family>.cpp, defining its FamilySpec) and its line here: the spec function
// declared below and called in the list.
#include "model/family.h"

namespace kiln {

FamilySpec llama_family();    // model/llama.cpp: llama (Llama-2/3, MiniCPM5), qwen2
FamilySpec qwen3_family();    // model/qwen3.cpp: qwen3, on the llama graph code
FamilySpec qwen3_moe_family();    // model/qwen3_moe.cpp: qwen3_moe, on the llama graph code with experts
FamilySpec qwen3_5_family();      // model/qwen3_5.cpp: qwen3_5_text, qwen3_next, the qwen3_5 wrapper
FamilySpec qwen3_5_moe_family();  // model/qwen3_5_moe.cpp: qwen3_5_moe_text and its wrapper, on the hybrid graph

const FamilyList& builtin_families() {
  // The order is the profile ladder's and the order errors list model types in.
  static const FamilyList families(
      {llama_family(), qwen3_family(), qwen3_moe_family(), qwen3_5_family(), qwen3_5_moe_family()});
  return families;
}

const ImplementationRegistry& builtin_registry() {
  static const ImplementationRegistry registry(family_implementations(builtin_families()));
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
