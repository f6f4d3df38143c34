// config.json, optionally followed by a NUL byte and generation_config.json: load_model_config parses
// and validates both (model/family.h, io/config.h), then everything decided from the config alone
// before any weight is read runs on it: profile resolution, implementation selection and the
// tensor-parallel split check (the memory plan needs a checkpoint too: load_plan_fuzz runs it).
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "core/error.h"
#include "fuzz_support.h"
#include "io/config.h"
#include "model/family.h"
#include "model/profile.h"
#include "model/registry.h"

namespace {

void plan_from_config(const kiln::ModelConfig& config) {
  const kiln::ResolvedProfile resolved = kiln::resolve_profile(config, std::nullopt, kiln::builtin_profile_table());
  kiln::check_resolved_profile(config, resolved);
  const auto implementation = kiln::builtin_registry().select(config, resolved, kiln::Device::CPU);
  if (implementation->tensor_parallel.supported()) implementation->tensor_parallel.check(config, 2);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [config, generation_config] = kiln::fuzz::split_at_nul(kiln::fuzz::as_text(data, size));
  const auto& scratch = kiln::fuzz::ScratchDirectory::instance();
  scratch.write("config.json", config);
  if (generation_config.empty())
    std::filesystem::remove(scratch.path() / "generation_config.json");
  else
    scratch.write("generation_config.json", generation_config);
  try {
    plan_from_config(kiln::load_model_config(scratch.path()));
  } catch (const kiln::Error&) {
    // A rejected config is the expected outcome; any other exception or a crash is a finding.
  }
  return 0;
}
