// The implementation registry: immutable, strict selection per (implementation, backend), no
// fallback to another implementation or another backend.
#include <memory>

#include <gtest/gtest.h>

#include "model/registry.h"
#include "profile_support.h"

using namespace kiln;
using kiln::testing::exact_spec;
using kiln::testing::family_spec;
using kiln::testing::hf_fingerprint;
using kiln::testing::tiny_config;

namespace {

// An implementation whose factory must never run in these tests: selection alone is under test.
ModelImplementation implementation(std::string id, Graph graph = builtin_graph("llama"), Device backend = Device::CPU) {
  ModelImplementation entry;
  entry.id = std::move(id);
  entry.graph = graph;
  entry.loop = graph == builtin_graph("qwen3_5") ? Loop::HybridRecurrent : Loop::Autoregressive;
  entry.backend = backend;
  entry.create = [](WeightMap&, const ModelConfig&, const ResolvedProfile&, Backend&) -> std::unique_ptr<Model> {
    ADD_FAILURE() << "selection must not construct a model";
    return nullptr;
  };
  return entry;
}

ResolvedProfile resolve_family(const ModelConfig& config) {
  return resolve_profile(config, std::nullopt, builtin_profile_table());
}

// A table with one exact-artifact profile (bound to `config` and hf_fingerprint()) naming
// `implementation`, and the llama family.
ProfileTable table_naming(const ModelConfig& config, const std::string& implementation) {
  ModelProfileSpec spec = exact_spec("tiny@a", config, hf_fingerprint());
  spec.execution.implementation = implementation;
  return ProfileTable({ModelProfile::build(spec)}, {ModelProfile::build(family_spec("family"))});
}

}  // namespace

TEST(Registry, RejectsEmptyIds) {
  EXPECT_FAILS_MENTIONING(ImplementationRegistry({implementation("")}), "model implementation id must not be empty");
  EXPECT_FAILS_MENTIONING(ImplementationRegistry({implementation(" ")}), "model implementation id must not be empty");
}

TEST(Registry, RejectsDuplicatesPerBackend) {
  EXPECT_FAILS_MENTIONING(ImplementationRegistry({implementation("llama"), implementation("llama")}),
                          "duplicate model implementation llama on cpu");
  EXPECT_NO_THROW(ImplementationRegistry(
      {implementation("llama", builtin_graph("llama"), Device::CPU),
       implementation("llama", builtin_graph("llama"), Device::CUDA)}));
}

TEST(Registry, RejectsAnImplementationWithoutFactoryOrWithAnIllegalLoop) {
  auto no_factory = implementation("llama");
  no_factory.create = nullptr;
  EXPECT_FAILS_MENTIONING(ImplementationRegistry({no_factory}), "llama", "no factory");
  auto wrong_loop = implementation("qwen3_5", builtin_graph("qwen3_5"));
  wrong_loop.loop = Loop::Autoregressive;
  EXPECT_FAILS_MENTIONING(ImplementationRegistry({wrong_loop}), "qwen3_5", "loop autoregressive");
}

TEST(Registry, SelectsTheGraphDefault) {
  const ImplementationRegistry registry({implementation("llama"), implementation("qwen3", builtin_graph("qwen3"))});
  const auto config = tiny_config("qwen3");
  const auto selected = registry.select(config, resolve_family(config), Device::CPU);
  EXPECT_EQ(selected->id, "qwen3");
  EXPECT_EQ(selected->graph, builtin_graph("qwen3"));
}

TEST(Registry, AnAbsentImplementationIsAnErrorNotAFallback) {
  const ImplementationRegistry registry({implementation("llama"), implementation("qwen3", builtin_graph("qwen3"))});
  const auto config = tiny_config("qwen3_5_text");
  EXPECT_FAILS_MENTIONING(registry.select(config, resolve_family(config), Device::CPU), "qwen3_5-family",
                          "implementation qwen3_5 on cpu", "refusing to fall back");
}

TEST(Registry, AnotherDeviceIsNeverAQuietFallback) {
  const ImplementationRegistry registry({implementation("llama", builtin_graph("llama"), Device::CPU)});
  const auto config = tiny_config();
  EXPECT_EQ(registry.select(config, resolve_family(config), Device::CPU)->backend, Device::CPU);
  EXPECT_FAILS_MENTIONING(registry.select(config, resolve_family(config), Device::CUDA), "llama-family",
                          "implementation llama on cuda", "registered on cpu", "refusing to fall back");
}

TEST(Registry, ANamedImplementationIsSelectedExactly) {
  const auto config = tiny_config();
  const ProfileTable table = table_naming(config, "llama-tuned");
  const auto resolved = resolve_profile(config, hf_fingerprint(), table);
  ASSERT_TRUE(resolved.exact_artifact);

  const ImplementationRegistry without({implementation("llama")});
  EXPECT_FAILS_MENTIONING(without.select(config, resolved, Device::CPU), "tiny@a", "llama-tuned",
                          "refusing to fall back");
  const ImplementationRegistry with_it({implementation("llama"), implementation("llama-tuned")});
  EXPECT_EQ(with_it.select(config, resolved, Device::CPU)->id, "llama-tuned");
}

TEST(Registry, AnIncompatibleImplementationIsAnError) {
  const auto config = tiny_config();
  const auto resolved = resolve_profile(config, hf_fingerprint(), table_naming(config, "tuned"));
  // Registered under the name the profile asks for, but built for another graph.
  const ImplementationRegistry registry({implementation("tuned", builtin_graph("qwen3"))});
  EXPECT_FAILS_MENTIONING(registry.select(config, resolved, Device::CPU), "model implementation tuned", "tiny@a",
                          "graph qwen3", "graph llama", "refusing to fall back");
}

TEST(Registry, SelectionRevalidatesTheResolvedProfile) {
  const ImplementationRegistry registry({implementation("llama")});
  const auto config = tiny_config();
  auto tampered = resolve_family(config);
  tampered.exact_artifact = true;
  EXPECT_FAILS_MENTIONING(registry.select(config, tampered, Device::CPU), "llama-family", "exact");
  auto edited = config;
  edited.num_hidden_layers = 2;
  EXPECT_FAILS_MENTIONING(registry.select(edited, resolve_family(config), Device::CPU), "llama-family",
                          config_fingerprint(edited));
}

TEST(Registry, WithReturnsANewRegistryAndKeepsBindings) {
  const auto config = tiny_config();
  const auto qwen3 = tiny_config("qwen3");
  std::shared_ptr<const ModelImplementation> bound;
  std::unique_ptr<ImplementationRegistry> extended;
  {
    const ImplementationRegistry original({implementation("llama")});
    bound = original.select(config, resolve_family(config), Device::CPU);
    extended =
        std::make_unique<ImplementationRegistry>(original.with({implementation("qwen3", builtin_graph("qwen3"))}));
    EXPECT_EQ(original.size(), 1u);
    EXPECT_FAILS_MENTIONING(original.select(qwen3, resolve_family(qwen3), Device::CPU), "implementation qwen3");
    EXPECT_FAILS_MENTIONING(original.with({implementation("llama")}), "duplicate model implementation llama");
  }
  // The original registry is gone; the binding it handed out lives on, and is the very entry the
  // new registry holds.
  EXPECT_EQ(bound->id, "llama");
  EXPECT_EQ(extended->size(), 2u);
  EXPECT_EQ(extended->select(config, resolve_family(config), Device::CPU), bound);
  EXPECT_EQ(extended->select(qwen3, resolve_family(qwen3), Device::CPU)->id, "qwen3");
}

TEST(Registry, CapabilitiesComeFromTheImplementationsOfADevice) {
  const ImplementationRegistry registry(
      {implementation("llama", builtin_graph("llama"), Device::CPU),
       implementation("qwen3_5", builtin_graph("qwen3_5"), Device::CUDA)});
  EXPECT_EQ(registry.capabilities(Device::CPU),
            (std::set<Capability>{graph_capability(builtin_graph("llama")), Capability::LoopAutoregressive,
                                  Capability::StateKvCache}));
  EXPECT_EQ(registry.capabilities(Device::CUDA),
            (std::set<Capability>{graph_capability(builtin_graph("qwen3_5")), Capability::LoopHybridRecurrent,
                                  Capability::StateKvCache, Capability::StateRecurrent}));
  const auto cuda_without_backend = engine_capabilities(registry, Device::CUDA, /*backend_present=*/false);
  EXPECT_FALSE(cuda_without_backend.count(Capability::BackendCuda));
  EXPECT_TRUE(cuda_without_backend.count(Capability::FormatSafetensors));
  EXPECT_TRUE(engine_capabilities(registry, Device::CUDA, true).count(Capability::BackendCuda));

  // A qwen3_5 model on the CPU: the engine there has no qwen3_5 graph, and the error says so.
  const auto config = tiny_config("qwen3_5_text");
  const auto resolved = resolve_family(config);
  EXPECT_FAILS_MENTIONING(
      require_engine_capabilities(resolved.profile, Device::CPU, engine_capabilities(registry, Device::CPU, true)),
      "qwen3_5-family", "graph:qwen3_5", "cpu");
  EXPECT_FAILS_MENTIONING(
      require_engine_capabilities(resolved.profile, Device::CUDA, engine_capabilities(registry, Device::CUDA, false)),
      "qwen3_5-family", "backend:cuda");
  EXPECT_NO_THROW(
      require_engine_capabilities(resolved.profile, Device::CUDA, engine_capabilities(registry, Device::CUDA, true)));
}

TEST(Registry, TheBuiltinRegistryServesEveryGraphOnEveryBackend) {
  const struct {
    const char* model_type;
    const char* implementation;
  } cases[] = {{"llama", "llama"}, {"qwen2", "llama"}, {"qwen3", "qwen3"}};
  for (Device device : {Device::CPU, Device::CUDA}) {
    for (const auto& c : cases) {
      const auto config = tiny_config(c.model_type);
      const auto selected = builtin_registry().select(config, resolve_family(config), device);
      EXPECT_EQ(selected->id, c.implementation) << c.model_type;
      EXPECT_EQ(selected->backend, device) << c.model_type;
    }
  }
  const auto hybrid = tiny_config("qwen3_5_text");
  for (Device device : {Device::CPU, Device::CUDA}) {
    const auto selected = builtin_registry().select(hybrid, resolve_family(hybrid), device);
    EXPECT_EQ(selected->id, "qwen3_5");
    EXPECT_EQ(selected->backend, device);
  }
}
