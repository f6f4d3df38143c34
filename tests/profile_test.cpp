// Model profiles: every validation rule, engine capabilities, and resolution before any weight
// is read. Each rule's test fails when the rule is removed and checks that the error names the
// profile and what is missing.
#include <type_traits>

#include <gtest/gtest.h>

#include "model/profile.h"
#include "profile_support.h"

using namespace kiln;
using kiln::testing::exact_spec;
using kiln::testing::family_spec;
using kiln::testing::hf_fingerprint;
using kiln::testing::tiny_config;

// --- immutability -------------------------------------------------------------------------------

static_assert(!std::is_default_constructible_v<ModelProfile>, "a profile exists only through build()");
static_assert(std::is_const_v<std::remove_reference_t<decltype(std::declval<ModelProfile&>().capabilities())>>,
              "a built profile exposes no mutable state");
static_assert(std::is_const_v<std::remove_reference_t<decltype(std::declval<ModelProfile&>().execution())>>,
              "a built profile exposes no mutable state");

TEST(ProfileValidation, AValidFamilyProfileBuildsAndKeepsEveryField) {
  ModelProfileSpec spec = family_spec("tiny-llama");
  const ModelProfile profile = ModelProfile::build(spec);
  spec.id = "changed after build";
  EXPECT_EQ(profile.id(), "tiny-llama");
  EXPECT_FALSE(profile.exact_artifact());
  const auto json = profile.to_json();
  EXPECT_EQ(json["id"], "tiny-llama");
  EXPECT_EQ(json["fidelity"]["tier"], "reference_parity");
  EXPECT_EQ(json["fidelity"]["oracle"], "transformers float64 logits");
  EXPECT_EQ(json["execution"]["loader"], "safetensors");
  EXPECT_EQ(json["execution"]["graph"], "llama");
  EXPECT_EQ(json["execution"]["loop"], "autoregressive");
  EXPECT_EQ(json["execution"]["specialization"], "dedicated");
  EXPECT_TRUE(json["execution"]["implementation"].is_null());
  EXPECT_TRUE(json["artifact_fingerprint"].is_null());
  EXPECT_TRUE(json["config_fingerprint"].is_null());
  EXPECT_EQ(json["capabilities"],
            nlohmann::json({"format:safetensors", "graph:llama", "loop:autoregressive", "state:kv_cache"}));
}

TEST(ProfileValidation, IdMustNotBeEmpty) {
  ModelProfileSpec spec = family_spec("");
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "model profile id must not be empty");
  spec.id = "  ";
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "model profile id must not be empty");
}

TEST(ProfileValidation, AFidelityClaimNamesItsOracle) {
  ModelProfileSpec spec = family_spec("no-oracle");
  spec.fidelity = {FidelityTier::ReferenceParity, ""};
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "no-oracle", "reference_parity", "oracle");
  spec.fidelity = {FidelityTier::SelfConsistency, " "};
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "no-oracle", "self_consistency", "oracle");
  spec.fidelity = {FidelityTier::MeasuredOnly, ""};
  EXPECT_NO_THROW(ModelProfile::build(spec));
}

TEST(ProfileValidation, FingerprintsComeTogether) {
  const auto config = tiny_config();
  ModelProfileSpec artifact_only = exact_spec("artifact-only", config, hf_fingerprint());
  artifact_only.config_fingerprint.reset();
  EXPECT_FAILS_MENTIONING(ModelProfile::build(artifact_only), "artifact-only", "together",
                          "has only artifact_fingerprint");
  ModelProfileSpec config_only = exact_spec("config-only", config, hf_fingerprint());
  config_only.artifact_fingerprint.reset();
  config_only.execution.specialization = Specialization::Dedicated;
  EXPECT_FAILS_MENTIONING(ModelProfile::build(config_only), "config-only", "together", "has only config_fingerprint");
  EXPECT_NO_THROW(ModelProfile::build(exact_spec("both", config, hf_fingerprint())));
}

TEST(ProfileValidation, FingerprintsAreWellFormed) {
  const auto config = tiny_config();
  ModelProfileSpec spec = exact_spec("typo", config, "hf:org/tiny@abc");
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "typo", "malformed artifact_fingerprint", "hf:org/tiny@abc");
  spec = exact_spec("typo", config, "sha256:" + std::string(64, 'f'));
  EXPECT_NO_THROW(ModelProfile::build(spec));
  spec.config_fingerprint = "md5:1234";
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "typo", "malformed config_fingerprint", "md5:1234");
}

TEST(ProfileValidation, ArtifactSpecializationNeedsAnArtifact) {
  ModelProfileSpec spec = family_spec("specialised-to-nothing");
  spec.execution.specialization = Specialization::Artifact;
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "specialised-to-nothing", "artifact specialization",
                          "artifact_fingerprint missing");
}

TEST(ProfileValidation, ANamedImplementationNeedsAnExactArtifact) {
  ModelProfileSpec spec = family_spec("family-with-code");
  spec.execution.implementation = "llama-fast";
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "family-with-code", "llama-fast", "no artifact_fingerprint");
}

TEST(ProfileValidation, ANamedImplementationNeedsArtifactSpecialization) {
  ModelProfileSpec spec = exact_spec("exact-but-dedicated", tiny_config(), hf_fingerprint());
  spec.execution.specialization = Specialization::Dedicated;
  spec.execution.implementation = "llama-fast";
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "exact-but-dedicated", "llama-fast", "specialization dedicated");
  spec.execution.specialization = Specialization::Artifact;
  EXPECT_NO_THROW(ModelProfile::build(spec));
}

TEST(ProfileValidation, ANamedImplementationIsNotBlank) {
  ModelProfileSpec spec = exact_spec("blank-name", tiny_config(), hf_fingerprint());
  spec.execution.implementation = " ";
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "blank-name", "empty implementation");
}

TEST(ProfileValidation, TheLoopIsLegalForTheGraph) {
  ModelProfileSpec hybrid_on_attention = family_spec("llama-with-recurrence", builtin_graph("llama"));
  hybrid_on_attention.execution.loop = Loop::HybridRecurrent;
  hybrid_on_attention.capabilities = execution_capabilities(hybrid_on_attention.execution);
  EXPECT_FAILS_MENTIONING(ModelProfile::build(hybrid_on_attention), "llama-with-recurrence", "graph llama",
                          "loop hybrid_recurrent");
  ModelProfileSpec attention_on_hybrid = family_spec("qwen3_5-without-state", builtin_graph("qwen3_5"));
  attention_on_hybrid.execution.loop = Loop::Autoregressive;
  attention_on_hybrid.capabilities = execution_capabilities(attention_on_hybrid.execution);
  EXPECT_FAILS_MENTIONING(ModelProfile::build(attention_on_hybrid), "qwen3_5-without-state", "graph qwen3_5",
                          "loop autoregressive");
}

TEST(ProfileValidation, DeclaredCapabilitiesCoverTheExecution) {
  const struct {
    Graph graph;
    Capability dropped;
  } cases[] = {
      {builtin_graph("qwen3_5"), Capability::StateRecurrent},
      {builtin_graph("qwen3_5"), Capability::StateKvCache},
      {builtin_graph("qwen3_5"), graph_capability(builtin_graph("qwen3_5"))},
      {builtin_graph("qwen3_5"), Capability::LoopHybridRecurrent},
      {builtin_graph("llama"), Capability::FormatSafetensors},
      {builtin_graph("qwen3"), graph_capability(builtin_graph("qwen3"))},
      {builtin_graph("llama"), Capability::LoopAutoregressive},
  };
  for (const auto& c : cases) {
    ModelProfileSpec spec = family_spec("under-declared", c.graph);
    spec.capabilities.erase(c.dropped);
    EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "under-declared", std::string(capability_name(c.dropped)));
  }
  ModelProfileSpec extra = family_spec("over-declared");
  extra.capabilities.insert(Capability::BackendCuda);
  EXPECT_NO_THROW(ModelProfile::build(extra));
}

TEST(ProfileValidation, ImplementationIdsDefaultToTheGraph) {
  EXPECT_EQ(implementation_id(ModelProfile::build(family_spec("d", builtin_graph("qwen3")))), "qwen3");
  ModelProfileSpec generic = family_spec("g", builtin_graph("qwen3_5"));
  generic.execution.specialization = Specialization::Generic;
  EXPECT_EQ(implementation_id(ModelProfile::build(generic)), "qwen3_5-generic");
  ModelProfileSpec named = exact_spec("n", tiny_config(), hf_fingerprint());
  named.execution.implementation = "llama-tuned";
  EXPECT_EQ(implementation_id(ModelProfile::build(named)), "llama-tuned");
}

// --- engine capabilities ------------------------------------------------------------------------

TEST(ProfileEngine, AnEngineWithoutTheBackendIsAnErrorNamingIt) {
  const ModelProfile profile = ModelProfile::build(family_spec("tiny-llama"));
  std::set<Capability> engine = execution_capabilities(profile.execution());
  EXPECT_FAILS_MENTIONING(require_engine_capabilities(profile, Device::CUDA, engine), "tiny-llama", "backend:cuda");
  engine.insert(Capability::BackendCuda);
  EXPECT_NO_THROW(require_engine_capabilities(profile, Device::CUDA, engine));
}

TEST(ProfileEngine, EveryRequiredCapabilityMustBePresent) {
  const ModelProfile profile = ModelProfile::build(family_spec("tiny-qwen3_5", builtin_graph("qwen3_5")));
  for (Capability missing : profile.capabilities()) {
    std::set<Capability> engine = profile.capabilities();
    engine.insert(Capability::BackendCpu);
    engine.erase(missing);
    EXPECT_FAILS_MENTIONING(require_engine_capabilities(profile, Device::CPU, engine), "tiny-qwen3_5",
                            std::string(capability_name(missing)), "cpu");
  }
}

TEST(ProfileEngine, ADeclaredBackendRequirementIsHonoured) {
  ModelProfileSpec spec = family_spec("cuda-only");
  spec.capabilities.insert(Capability::BackendCuda);
  const ModelProfile profile = ModelProfile::build(spec);
  std::set<Capability> engine = profile.capabilities();
  engine.erase(Capability::BackendCuda);
  engine.insert(Capability::BackendCpu);
  EXPECT_FAILS_MENTIONING(require_engine_capabilities(profile, Device::CPU, engine), "cuda-only", "backend:cuda");
}

// --- the profile table --------------------------------------------------------------------------

TEST(ProfileTable, RejectsDuplicateIds) {
  EXPECT_FAILS_MENTIONING(ProfileTable({}, {ModelProfile::build(family_spec("twice")),
                                            ModelProfile::build(family_spec("twice", builtin_graph("qwen3")))}),
                          "duplicate model profile twice");
  const auto config = tiny_config();
  EXPECT_FAILS_MENTIONING(ProfileTable({ModelProfile::build(exact_spec("twice", config, hf_fingerprint()))},
                                       {ModelProfile::build(family_spec("twice"))}),
                          "duplicate model profile twice");
}

TEST(ProfileTable, ExactAndFamilyProfilesStayInTheirLists) {
  const auto config = tiny_config();
  EXPECT_FAILS_MENTIONING(ProfileTable({ModelProfile::build(family_spec("not-exact"))}, {}), "not-exact",
                          "binds no artifact_fingerprint");
  EXPECT_FAILS_MENTIONING(ProfileTable({}, {ModelProfile::build(exact_spec("exact", config, hf_fingerprint()))}),
                          "exact", "family profile", hf_fingerprint());
}

TEST(ProfileTable, OneProfilePerArtifact) {
  const auto config = tiny_config();
  EXPECT_FAILS_MENTIONING(ProfileTable({ModelProfile::build(exact_spec("first", config, hf_fingerprint())),
                                        ModelProfile::build(exact_spec("second", config, hf_fingerprint()))},
                                       {}),
                          "first", "second", hf_fingerprint());
}

// --- resolution ---------------------------------------------------------------------------------

TEST(ProfileResolution, TheBuiltinLadderCoversEverySupportedModelType) {
  const struct {
    const char* model_type;
    const char* profile;
    Graph graph;
  } cases[] = {
      {"llama", "llama-family", builtin_graph("llama")},
      {"qwen2", "llama-family", builtin_graph("llama")},
      {"qwen3", "qwen3-family", builtin_graph("qwen3")},
      {"qwen3_5_text", "qwen3_5-family", builtin_graph("qwen3_5")},
      {"qwen3_next", "qwen3_5-family", builtin_graph("qwen3_5")},
  };
  for (const auto& c : cases) {
    const auto resolved = resolve_profile(tiny_config(c.model_type), std::nullopt, builtin_profile_table());
    EXPECT_EQ(resolved.profile.id(), c.profile) << c.model_type;
    EXPECT_EQ(resolved.profile.execution().graph, c.graph) << c.model_type;
    EXPECT_FALSE(resolved.exact_artifact);
    EXPECT_EQ(resolved.config_fingerprint, config_fingerprint(tiny_config(c.model_type)));
  }
  for (const auto& model_type : supported_model_types())
    EXPECT_NO_THROW(resolve_profile(tiny_config(model_type), std::nullopt, builtin_profile_table())) << model_type;
}

TEST(ProfileResolution, AnUnknownModelTypeListsTheSupportedFamilies) {
  auto config = tiny_config();
  config.model_type = "gpt_neox";
  EXPECT_FAILS_MENTIONING(resolve_profile(config, std::nullopt, builtin_profile_table()), "/models/tiny/config.json",
                          "gpt_neox", "llama-family (llama, qwen2)", "qwen3-family (qwen3)",
                          "qwen3_5-family (qwen3_5_text, qwen3_next)");
}

TEST(ProfileResolution, TheLadderIsOrdered) {
  const ProfileTable table({}, {ModelProfile::build(family_spec("first")), ModelProfile::build(family_spec("second"))});
  EXPECT_EQ(resolve_profile(tiny_config(), std::nullopt, table).profile.id(), "first");
}

TEST(ProfileResolution, AnExactArtifactProfileWins) {
  const auto config = tiny_config();
  const ProfileTable table({ModelProfile::build(exact_spec("tiny@a", config, hf_fingerprint('a')))},
                           {ModelProfile::build(family_spec("family"))});
  const auto exact = resolve_profile(config, hf_fingerprint('a'), table);
  EXPECT_EQ(exact.profile.id(), "tiny@a");
  EXPECT_TRUE(exact.exact_artifact);
  EXPECT_EQ(exact.artifact_fingerprint, hf_fingerprint('a'));
  const auto other = resolve_profile(config, hf_fingerprint('b'), table);
  EXPECT_EQ(other.profile.id(), "family");
  EXPECT_FALSE(other.exact_artifact);
  EXPECT_EQ(other.artifact_fingerprint, hf_fingerprint('b'));
  const auto unidentified = resolve_profile(config, std::nullopt, table);
  EXPECT_EQ(unidentified.profile.id(), "family");
  EXPECT_FALSE(unidentified.exact_artifact);
}

TEST(ProfileResolution, AnExactArtifactWithAnotherConfigRefusesToFallBack) {
  const auto bound = tiny_config();
  auto edited = bound;
  edited.num_hidden_layers = 3;
  const ProfileTable table({ModelProfile::build(exact_spec("tiny@a", bound, hf_fingerprint('a')))},
                           {ModelProfile::build(family_spec("family"))});
  EXPECT_FAILS_MENTIONING(resolve_profile(edited, hf_fingerprint('a'), table), "tiny@a", config_fingerprint(bound),
                          config_fingerprint(edited), "refusing to fall back");
}

TEST(ProfileResolution, AnExactArtifactWhoseGraphRejectsTheConfigRefusesToFallBack) {
  const auto config = tiny_config("llama");
  // Bound to this very config, but declaring the qwen3 graph, which does not accept llama.
  const ProfileTable table(
      {ModelProfile::build(exact_spec("wrong-graph", config, hf_fingerprint(), builtin_graph("qwen3")))},
                           {ModelProfile::build(family_spec("family"))});
  EXPECT_FAILS_MENTIONING(resolve_profile(config, hf_fingerprint(), table), "wrong-graph", "graph qwen3", "llama",
                          "refusing to fall back");
}

// --- re-validation at the construction seam -----------------------------------------------------

TEST(ProfileRevalidation, AResolvedProfileMustMatchTheConfigItBuilds) {
  const auto config = tiny_config();
  const auto resolved = resolve_profile(config, std::nullopt, builtin_profile_table());
  EXPECT_NO_THROW(check_resolved_profile(config, resolved));

  auto edited = config;
  edited.hidden_size = 96;
  EXPECT_FAILS_MENTIONING(check_resolved_profile(edited, resolved), "llama-family", config_fingerprint(edited));

  auto other_family = resolved;
  other_family.profile = ModelProfile::build(family_spec("qwen3-only", builtin_graph("qwen3")));
  EXPECT_FAILS_MENTIONING(check_resolved_profile(config, other_family), "qwen3-only", "graph qwen3", "llama");
}

TEST(ProfileRevalidation, TheExactFlagMatchesTheProfile) {
  const auto config = tiny_config();
  auto family = resolve_profile(config, std::nullopt, builtin_profile_table());
  family.exact_artifact = true;
  EXPECT_FAILS_MENTIONING(check_resolved_profile(config, family), "llama-family", "not an exact-artifact profile");

  const ProfileTable table({ModelProfile::build(exact_spec("tiny@a", config, hf_fingerprint('a')))},
                           {ModelProfile::build(family_spec("family"))});
  auto exact = resolve_profile(config, hf_fingerprint('a'), table);
  EXPECT_NO_THROW(check_resolved_profile(config, exact));
  auto unflagged = exact;
  unflagged.exact_artifact = false;
  EXPECT_FAILS_MENTIONING(check_resolved_profile(config, unflagged), "tiny@a", "resolved as not exact");
  auto other_artifact = exact;
  other_artifact.artifact_fingerprint = hf_fingerprint('b');
  EXPECT_FAILS_MENTIONING(check_resolved_profile(config, other_artifact), "tiny@a", "does not match artifact",
                          hf_fingerprint('b'));
  // Resolved for an edited config: consistent with it, but not with the config the profile binds.
  auto edited = config;
  edited.vocab_size = 512;
  auto rebound = exact;
  rebound.config_fingerprint = config_fingerprint(edited);
  EXPECT_FAILS_MENTIONING(check_resolved_profile(edited, rebound), "tiny@a", "does not match artifact",
                          config_fingerprint(config));
}
