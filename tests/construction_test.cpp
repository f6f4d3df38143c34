// load_model, the one path that builds a model, with implementations written for these tests: the
// exact-artifact binding, the strict selection, and a construction that fails part-way (run under
// ASan/LSan by scripts/test.sh: suite names Construction*) releasing everything it took while the
// borrowed weights stay valid.
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/backend.h"
#include "io/fingerprint.h"
#include "io/safetensors_writer.h"
#include "model/loader.h"
#include "profile_support.h"
#include "test_support.h"

using namespace kiln;
using kiln::testing::TempDir;

namespace {

constexpr int64_t kVocab = 32;
constexpr int64_t kHidden = 8;

// A Llama config.json with the shapes of the synthetic checkpoint below.
std::string tiny_llama_config(int64_t layers = 1) {
  nlohmann::json config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", kHidden},
      {"intermediate_size", 16},
      {"num_hidden_layers", layers},
      {"num_attention_heads", 2},
      {"num_key_value_heads", 1},
      {"head_dim", 4},
      {"vocab_size", kVocab},
      {"max_position_embeddings", 64},
      {"rms_norm_eps", 1e-5},
      {"hidden_act", "silu"},
      {"rope_theta", 10000.0},
      {"tie_word_embeddings", false},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
  };
  return config.dump(2);
}

SafetensorsEntry f32_entry(const std::string& name, Shape shape) {
  SafetensorsEntry entry;
  entry.name = name;
  entry.dtype = DType::F32;
  entry.shape = std::move(shape);
  entry.bytes.resize(entry.nbytes());
  for (size_t i = 0; i < entry.bytes.size(); ++i) entry.bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  return entry;
}

// The tensors of the synthetic checkpoint and the shapes the test implementations take them with.
const std::vector<std::pair<std::string, Shape>>& tiny_tensors() {
  static const std::vector<std::pair<std::string, Shape>> tensors = {
      {"model.embed_tokens.weight", {kVocab, kHidden}},
      {"model.norm.weight", {kHidden}},
      {"lm_head.weight", {kVocab, kHidden}},
  };
  return tensors;
}

void write_tiny_checkpoint(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << tiny_llama_config();
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, shape] : tiny_tensors()) entries.push_back(f32_entry(name, shape));
  write_safetensors(dir / "model.safetensors", entries);
}

// A tiny checkpoint (write_tiny_checkpoint) in a folder of its own, removed with it.
struct TinyCheckpoint {
  TempDir root;
  std::filesystem::path dir = root.path() / "tiny";
  TinyCheckpoint() { write_tiny_checkpoint(dir); }
};

// A model that holds weights and buffers but never runs: these tests build models, not logits.
class HeldWeightsModel final : public Model {
 public:
  HeldWeightsModel(const ModelConfig& config, Backend& backend) : config_(config), backend_(backend) {}
  const ModelConfig& config() const override { return config_; }
  Backend& backend() const override { return backend_; }
  size_t decode_weight_bytes() const override {
    size_t bytes = 0;
    for (const auto& weight : weights) bytes += weight.nbytes();
    return bytes;
  }
  std::unique_ptr<ModelCache> make_cache(int64_t, int64_t, int64_t) const override {
    fail("the construction tests' model keeps no cache");
  }
  void forward(const BatchLayout&, const Tensor&, ModelCache&, Tensor&) override {
    fail("the construction tests' model does not run");
  }
  void forward_hidden(const BatchLayout&, const Tensor&, ModelCache&, Tensor&) override {
    fail("the construction tests' model does not run");
  }

  std::vector<Tensor> weights;
  std::vector<Tensor> buffers;
  std::shared_ptr<const int> lifetime = std::make_shared<const int>(0);

 private:
  ModelConfig config_;
  Backend& backend_;
};

// Observes what a construction allocated, so a test can check it was all released.
struct ConstructionProbe {
  std::weak_ptr<const int> model_lifetime;
  int constructions = 0;
};

// An implementation that takes `taken` tensors (all of tiny_tensors() by default), allocates a
// host tensor and a backend buffer, and then, when `fault` is set, throws part-way.
ModelImplementation probing_implementation(ConstructionProbe& probe, bool fault, size_t taken = 3,
                                           std::string id = "llama") {
  ModelImplementation implementation;
  implementation.id = std::move(id);
  implementation.graph = builtin_graph("llama");
  implementation.loop = Loop::Autoregressive;
  implementation.backend = Device::CPU;
  implementation.create = [&probe, fault, taken](WeightMap& weights, const ModelConfig& config,
                                                  const ResolvedProfile&, Backend& backend) -> std::unique_ptr<Model> {
    ++probe.constructions;
    auto model = std::make_unique<HeldWeightsModel>(config, backend);
    probe.model_lifetime = model->lifetime;
    for (size_t i = 0; i < taken; ++i) {
      const auto& [name, shape] = tiny_tensors()[i];
      model->weights.push_back(weights.take(name, shape));
    }
    model->buffers.push_back(Tensor::zeros({1024}, DType::F32));
    model->buffers.push_back(backend.alloc({kVocab, kHidden}, DType::F32));
    if (fault) fail("injected fault after taking {} tensors", taken);
    return model;
  };
  return implementation;
}

LoadOptions options_with(const ImplementationRegistry& registry,
                         const ProfileTable& profiles = builtin_profile_table()) {
  LoadOptions options;
  options.registry = &registry;
  options.profiles = &profiles;
  return options;
}

// Whether this process still maps `file` (a borrowed view kept alive would keep it mapped).
bool process_maps(const std::filesystem::path& file) {
  std::ifstream maps("/proc/self/maps");
  const std::string target = std::filesystem::canonical(file).string();
  std::string line;
  while (std::getline(maps, line))
    if (line.size() >= target.size() && line.compare(line.size() - target.size(), target.size(), target) == 0)
      return true;
  return false;
}

}  // namespace

TEST(Construction, AFaultMidConstructionReleasesEverythingItTook) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  auto backend = make_cpu_backend();
  ConstructionProbe probe;
  const ImplementationRegistry registry({probing_implementation(probe, /*fault=*/true)});

  EXPECT_FAILS_MENTIONING(load_model(dir, *backend, options_with(registry)), "injected fault after taking 3 tensors");
  EXPECT_EQ(probe.constructions, 1);
  EXPECT_TRUE(probe.model_lifetime.expired()) << "the partly built model outlived its failed construction";
  EXPECT_FALSE(process_maps(dir / "model.safetensors")) << "a view of the checkpoint outlived the failed load";
}

TEST(Construction, TheWeightSourceIsOnlyBorrowed) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  auto backend = make_cpu_backend();
  const ModelConfig config = load_model_config(dir);
  const auto resolved = resolve_profile(config, std::nullopt, builtin_profile_table());
  ConstructionProbe probe;
  const ImplementationRegistry registry(
      {probing_implementation(probe, /*fault=*/true), probing_implementation(probe, false, 3, "llama-whole")});

  const Checkpoint checkpoint = Checkpoint::open(dir);
  const LoadPlan plan = identity_plan(checkpoint);
  WeightMap weights(checkpoint, plan);
  const auto failing = registry.select(config, resolved, Device::CPU);
  EXPECT_FAILS_MENTIONING(failing->create(weights, config, resolved, *backend), "injected fault");
  EXPECT_TRUE(probe.model_lifetime.expired());

  // The checkpoint and the weight map the failed construction borrowed are intact: another
  // construction takes every tensor from them, with the stored bytes.
  ModelImplementation whole = probing_implementation(probe, /*fault=*/false);
  auto model = whole.create(weights, config, resolved, *backend);
  ASSERT_NE(model, nullptr);
  EXPECT_NO_THROW(weights.require_all_used());
  const auto& held = static_cast<const HeldWeightsModel&>(*model).weights;
  ASSERT_EQ(held.size(), tiny_tensors().size());
  const Tensor stored = checkpoint.view("lm_head.weight");
  EXPECT_EQ(std::memcmp(held[2].raw(), stored.raw(), stored.nbytes()), 0);
}

TEST(Construction, AnUnusedCheckpointTensorFailsTheLoadAndReleasesTheModel) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  auto backend = make_cpu_backend();
  ConstructionProbe probe;
  const ImplementationRegistry registry({probing_implementation(probe, /*fault=*/false, /*taken=*/2)});
  EXPECT_FAILS_MENTIONING(load_model(dir, *backend, options_with(registry)), "lm_head.weight");
  EXPECT_EQ(probe.constructions, 1);
  EXPECT_TRUE(probe.model_lifetime.expired());
}

TEST(LoadModel, BuildsWithTheSelectedImplementationAndKeepsItsBinding) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  auto backend = make_cpu_backend();
  ConstructionProbe probe;
  std::unique_ptr<ModelPlan> plan;
  {
    const ImplementationRegistry registry({probing_implementation(probe, /*fault=*/false)});
    plan = std::make_unique<ModelPlan>(plan_model(dir, Device::CPU, true, options_with(registry)));
  }
  // The registry is gone; the plan's binding is not, and builds the model.
  EXPECT_EQ(plan->implementation->id, "llama");
  EXPECT_EQ(plan->resolved.profile.id(), "llama-family");
  EXPECT_FALSE(plan->resolved.exact_artifact);
  EXPECT_EQ(plan->load_plan.tensors.size(), tiny_tensors().size());
  EXPECT_EQ(probe.constructions, 0) << "planning constructs nothing";
  const auto model = build_model(*plan, *backend);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(probe.constructions, 1);
  EXPECT_FALSE(probe.model_lifetime.expired());
  EXPECT_EQ(model->config().model_type, "llama");
}

TEST(LoadModel, ConvertsTheWeightsToTheRequestedDtype) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  auto backend = make_cpu_backend();
  ConstructionProbe probe;
  const ImplementationRegistry registry({probing_implementation(probe, /*fault=*/false)});
  LoadOptions options = options_with(registry);
  options.dtype = DType::BF16;
  const auto model = load_model(dir, *backend, options);
  const Checkpoint checkpoint = Checkpoint::open(dir);
  const auto& held = static_cast<const HeldWeightsModel&>(*model).weights;
  ASSERT_EQ(held.size(), tiny_tensors().size());
  for (size_t i = 0; i < held.size(); ++i) {
    const Tensor stored = checkpoint.view(tiny_tensors()[i].first);
    ASSERT_EQ(held[i].dtype(), DType::BF16);
    for (int64_t j = 0; j < stored.numel(); ++j)
      ASSERT_EQ(held[i].data<const uint16_t>()[j], f32_to_bf16(stored.data<const float>()[j])) << i << ", " << j;
  }
  // Weights already in the requested dtype are not copied.
  const ModelPlan plan = plan_model(dir, Device::CPU, true, options_with(registry));
  const auto as_stored = build_model(plan, *backend, DType::F32);
  const auto& views = static_cast<const HeldWeightsModel&>(*as_stored).weights;
  EXPECT_EQ(views[0].raw(), plan.checkpoint.view(tiny_tensors()[0].first).raw());
}

TEST(LoadModel, AnEmptyRegistryIsAClearErrorBeforeAnyWeightIsRead) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  auto backend = make_cpu_backend();
  const ImplementationRegistry empty;
  EXPECT_FAILS_MENTIONING(load_model(dir, *backend, options_with(empty)), "llama-family", "graph:llama", "cpu");
  EXPECT_FAILS_MENTIONING(plan_model(dir, Device::CUDA, /*backend_present=*/false, options_with(empty)),
                          "llama-family", "backend:cuda");
}

TEST(LoadModel, AGraphWithoutSanitizerIsAnError) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  ConstructionProbe probe;
  const ImplementationRegistry registry({probing_implementation(probe, /*fault=*/false)});
  const SanitizerTable no_sanitizers;
  LoadOptions options = options_with(registry);
  options.sanitizers = &no_sanitizers;
  EXPECT_FAILS_MENTIONING(plan_model(dir, Device::CPU, true, options), "llama-family", "graph llama",
                          "no checkpoint sanitizer");
  EXPECT_EQ(probe.constructions, 0);
}

TEST(LoadModel, AnExactArtifactProfileBindsItsNamedImplementation) {
  TempDir root;
  const std::string commit(40, 'e');
  const auto snapshot = root.path() / "hub" / "models--org--tiny" / "snapshots" / commit;
  write_tiny_checkpoint(snapshot);
  const ModelConfig config = load_model_config(snapshot);

  ModelProfileSpec spec = kiln::testing::exact_spec("org/tiny@e", config, "hf:org/tiny@" + commit);
  spec.execution.implementation = "llama-tiny";
  const ProfileTable profiles({ModelProfile::build(spec)}, builtin_profile_table().families());
  ConstructionProbe probe;
  auto backend = make_cpu_backend();

  const ImplementationRegistry default_only({probing_implementation(probe, false)});
  EXPECT_FAILS_MENTIONING(load_model(snapshot, *backend, options_with(default_only, profiles)), "org/tiny@e",
                          "llama-tiny", "refusing to fall back");
  EXPECT_EQ(probe.constructions, 0);

  const auto registry = default_only.with({probing_implementation(probe, false, 3, "llama-tiny")});
  const ModelPlan plan = plan_model(snapshot, Device::CPU, true, options_with(registry, profiles));
  EXPECT_EQ(plan.implementation->id, "llama-tiny");
  EXPECT_TRUE(plan.resolved.exact_artifact);
  EXPECT_EQ(plan.resolved.artifact_fingerprint, "hf:org/tiny@" + commit);
  EXPECT_NE(build_model(plan, *backend), nullptr);

  // The same artifact with an edited config: refused, not loaded as the family.
  std::ofstream(snapshot / "config.json") << tiny_llama_config(/*layers=*/2);
  EXPECT_FAILS_MENTIONING(load_model(snapshot, *backend, options_with(registry, profiles)), "org/tiny@e",
                          "refusing to fall back");
}

TEST(LoadModel, TheConstructionSeamRefusesAnImplementationThatNoLongerMatchesTheProfile) {
  TempDir root;
  const std::string commit(40, 'e');
  const auto snapshot = root.path() / "hub" / "models--org--tiny" / "snapshots" / commit;
  write_tiny_checkpoint(snapshot);
  ModelProfileSpec spec = kiln::testing::exact_spec("org/tiny@e", load_model_config(snapshot), "hf:org/tiny@" + commit);
  spec.execution.implementation = "llama-tiny";
  const ProfileTable profiles({ModelProfile::build(spec)}, builtin_profile_table().families());
  ConstructionProbe probe;
  const ImplementationRegistry registry(
      {probing_implementation(probe, false), probing_implementation(probe, false, 3, "llama-tiny")});
  const ModelPlan selected = plan_model(snapshot, Device::CPU, true, options_with(registry, profiles));
  ASSERT_EQ(selected.implementation->id, "llama-tiny");
  auto backend = make_cpu_backend();

  // Handed another implementation than the one the profile names: refused where it is built.
  ModelPlan swapped = plan_model(snapshot, Device::CPU, true, options_with(registry, profiles));
  swapped.implementation = std::make_shared<const ModelImplementation>(probing_implementation(probe, false));
  EXPECT_FAILS_MENTIONING(build_model(swapped, *backend), "org/tiny@e", "requires implementation llama-tiny",
                          "bound to implementation llama", "refusing to fall back");

  // The named implementation, but for another backend.
  ModelImplementation elsewhere = probing_implementation(probe, false, 3, "llama-tiny");
  elsewhere.backend = Device::CUDA;
  swapped.implementation = std::make_shared<const ModelImplementation>(elsewhere);
  EXPECT_FAILS_MENTIONING(build_model(swapped, *backend), "org/tiny@e", "llama-tiny on cuda");

  // The named implementation on this backend, but built for another graph.
  ModelImplementation other_graph = probing_implementation(probe, false, 3, "llama-tiny");
  other_graph.graph = builtin_graph("qwen3_5");
  swapped.implementation = std::make_shared<const ModelImplementation>(other_graph);
  EXPECT_FAILS_MENTIONING(build_model(swapped, *backend), "org/tiny@e", "is incompatible with model profile");
  EXPECT_EQ(probe.constructions, 0) << "nothing is constructed from a mismatched pair";

  EXPECT_NE(build_model(selected, *backend), nullptr);
}

TEST(LoadModel, AHashedArtifactIsExactWhenAProfileIsBoundToIt) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  const auto fingerprint = content_fingerprint(dir, tiny.root.path() / "memo.json");
  const kiln::testing::ScopedEnv memo("KILN_ARTIFACT_HASH_MEMO", (tiny.root.path() / "memo.json").string());
  const ProfileTable profiles(
      {ModelProfile::build(kiln::testing::exact_spec("hashed", load_model_config(dir), fingerprint))},
                              builtin_profile_table().families());
  ConstructionProbe probe;
  const ImplementationRegistry registry({probing_implementation(probe, false)});

  LoadOptions options = options_with(registry, profiles);
  EXPECT_FALSE(plan_model(dir, Device::CPU, true, options).resolved.exact_artifact);
  options.hash_artifact = true;
  const ModelPlan plan = plan_model(dir, Device::CPU, true, options);
  EXPECT_TRUE(plan.resolved.exact_artifact);
  EXPECT_EQ(plan.resolved.profile.id(), "hashed");
}

TEST(LoadModel, ThePlanReportHasEveryField) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  ConstructionProbe probe;
  const ImplementationRegistry registry({probing_implementation(probe, false)});
  const auto report = plan_model(dir, Device::CPU, true, options_with(registry)).to_json();
  EXPECT_EQ(report["model_type"], "llama");
  EXPECT_EQ(report["profile"]["id"], "llama-family");
  EXPECT_TRUE(report["artifact_fingerprint"].is_null());
  EXPECT_EQ(report["config_fingerprint"], config_fingerprint(load_model_config(dir)));
  EXPECT_EQ(report["exact_artifact"], false);
  EXPECT_EQ(report["implementation"], "llama");
  EXPECT_EQ(report["capabilities"]["required"],
            nlohmann::json({"format:safetensors", "graph:llama", "loop:autoregressive", "state:kv_cache",
                            "backend:cpu"}));
  EXPECT_EQ(report["parameters"], 2 * kVocab * kHidden + kHidden);
  EXPECT_EQ(report["bytes_by_dtype"], nlohmann::json({{"F32", 4 * (2 * kVocab * kHidden + kHidden)}}));
  EXPECT_EQ(report["load_plan"]["tensors"].size(), tiny_tensors().size());
  EXPECT_EQ(probe.constructions, 0);
}

TEST(LoadModel, APlanBuildsOnlyOnItsOwnDevice) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  ConstructionProbe probe;
  ModelImplementation on_cuda = probing_implementation(probe, /*fault=*/false);
  on_cuda.backend = Device::CUDA;
  const ImplementationRegistry registry({on_cuda});
  const ModelPlan plan = plan_model(dir, Device::CUDA, /*backend_present=*/true, options_with(registry));
  auto cpu = make_cpu_backend();
  EXPECT_FAILS_MENTIONING(build_model(plan, *cpu), "llama-family", "planned for cuda", "backend is cpu");
  EXPECT_EQ(probe.constructions, 0);
}

TEST(LoadModel, AnImplementationThatReturnsNoModelIsAnError) {
  const TinyCheckpoint tiny;
  const std::filesystem::path& dir = tiny.dir;
  ModelImplementation empty_handed;
  empty_handed.id = "llama";
  empty_handed.graph = builtin_graph("llama");
  empty_handed.create = [](WeightMap&, const ModelConfig&, const ResolvedProfile&, Backend&) {
    return std::unique_ptr<Model>();
  };
  const ImplementationRegistry registry({empty_handed});
  auto backend = make_cpu_backend();
  EXPECT_FAILS_MENTIONING(load_model(dir, *backend, options_with(registry)), "implementation llama",
                          "returned no model", "llama-family");
}
