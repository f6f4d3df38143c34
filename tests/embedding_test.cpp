// Embeddings: the final hidden states the graphs give (checked against transformers' logits on the
// fixtures, since logits = hidden · lm_headᵀ), checkpoints of a bare decoder, the pooling and its
// reading from a sentence-transformers folder, the embedding scheduler's invariance, the
// /v1/embeddings request and answer, and `kiln serve --embeddings` end to end (raw HTTP and the
// official openai npm client, tests/npm/embeddings_client.mjs).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/embedding.h"
#include "engine/embedding_scheduler.h"
#include "engine/generation.h"
#include "io/pooling_config.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model_test_support.h"
#include "npm_reference.h"
#include "serve_process.h"
#include "server/api_error.h"
#include "server/openai_embeddings.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

// Every position's final hidden state [tokens, hidden], the prompt run in one step.
Tensor prompt_hidden_states(Model& model, const std::vector<int32_t>& prompt) {
  auto cache = model.make_cache(1, static_cast<int64_t>(prompt.size()));
  std::vector<int32_t> rows(prompt.size());
  std::iota(rows.begin(), rows.end(), 0);
  return run_hidden_step(model, *cache, {{0, 0, prompt, false}}, rows);
}

// hidden [T, H] · matrixᵀ for an f32 matrix [V, H], in double: [T, V] as f32.
Tensor times_transposed(const Tensor& hidden, const Tensor& matrix) {
  const int64_t tokens = hidden.dim(0), size = hidden.dim(1), vocab = matrix.dim(0);
  Tensor out = Tensor::empty({tokens, vocab}, DType::F32);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t v = 0; v < vocab; ++v) {
      double sum = 0.0;
      for (int64_t k = 0; k < size; ++k)
        sum += static_cast<double>(hidden.data<float>()[t * size + k]) * matrix.data<float>()[v * size + k];
      out.data<float>()[t * vocab + v] = static_cast<float>(sum);
    }
  return out;
}

std::vector<float> row(const Tensor& rows, int64_t index) {
  const int64_t size = rows.dim(1);
  return {rows.data<float>() + index * size, rows.data<float>() + (index + 1) * size};
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

class FinalHiddenStates : public ::testing::TestWithParam<std::string> {};

// logits = final_hidden · Wᵀ (W the lm_head, or the embedding where tied): the hidden states that
// reproduce transformers' float64 logits at every position are its last_hidden_state.
TEST_P(FinalHiddenStates, TimesTheOutputMatrixGiveTheReferenceLogits) {
  const fs::path fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "f32");
  const Tensor hidden = prompt_hidden_states(*loaded.model, fixture_prompt(fixture));
  ASSERT_EQ(hidden.dim(1), loaded.model->config().hidden_size);
  const Checkpoint checkpoint = Checkpoint::open(fixture / "f32");
  const Tensor output = checkpoint.view(checkpoint.contains("lm_head.weight") ? "lm_head.weight"
                                                                               : "model.embed_tokens.weight");
  const std::vector<double> errors =
      row_relative_errors(times_transposed(hidden, output), read_npy(fixture / "f32/ref_logits_f64.npy"));
  ASSERT_EQ(errors.size(), 300u);
  for (size_t position = 0; position < errors.size(); ++position)
    ASSERT_LE(errors[position], 1e-4) << "position " << position;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FinalHiddenStates, ::testing::Values("llama3-tiny", "qwen3-tiny"));

// A copy of a checkpoint folder's config.json and weights as a bare decoder saves them
// (transformers' Qwen3Model, as Qwen3-Embedding ships): "model." dropped from every name, and
// lm_head.weight left out when `drop_lm_head`.
void write_bare_decoder(const fs::path& from, const fs::path& to, bool drop_lm_head) {
  fs::copy_file(from / "config.json", to / "config.json");
  const Checkpoint checkpoint = Checkpoint::open(from);
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, info] : checkpoint.tensors()) {
    if (drop_lm_head && name == "lm_head.weight") continue;
    const Tensor tensor = checkpoint.view(name);
    SafetensorsEntry entry{name.starts_with("model.") ? name.substr(6) : name, tensor.dtype(), tensor.shape()};
    const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
    entry.bytes.assign(bytes, bytes + tensor.nbytes());
    entries.push_back(std::move(entry));
  }
  write_safetensors(to / "model.safetensors", entries);
}

TEST(BareDecoder, LoadsWithTheWrappedCheckpointsHiddenStatesAndLogits) {
  const fs::path fixture = fixtures_dir() / "qwen3-tiny";
  TempDir bare;
  write_bare_decoder(fixture / "f32", bare.path(), false);
  TestModel wrapped = open_cpu_model(fixture / "f32");
  TestModel unwrapped = open_cpu_model(bare.path());
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  EXPECT_TRUE(same_bits(prompt_hidden_states(*unwrapped.model, prompt), prompt_hidden_states(*wrapped.model, prompt)));
  // Tied: the embedding is its lm_head.
  ASSERT_TRUE(unwrapped.model->computes_logits());
  const std::vector<int32_t> head(prompt.begin(), prompt.begin() + 20);
  EXPECT_TRUE(same_bits(prompt_logits(*unwrapped.model, head, 0), prompt_logits(*wrapped.model, head, 0)));
}

TEST(BareDecoder, UntiedWithoutLmHeadGivesHiddenStatesOnly) {
  const fs::path fixture = fixtures_dir() / "llama3-tiny";
  TempDir bare;
  write_bare_decoder(fixture / "f32", bare.path(), true);
  TestModel wrapped = open_cpu_model(fixture / "f32");
  TestModel headless = open_cpu_model(bare.path());
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  EXPECT_TRUE(same_bits(prompt_hidden_states(*headless.model, prompt), prompt_hidden_states(*wrapped.model, prompt)));
  EXPECT_FALSE(headless.model->computes_logits());
  expect_error_mentions([&] { prompt_logits(*headless.model, {1, 2, 3}, 0); }, {"lm_head.weight", "--embeddings"});
  expect_error_mentions([&] { Scheduler scheduler(*headless.model, {.max_batch = 1, .context_tokens = 64}); },
                        {"lm_head", "--embeddings"});
}

TEST(Pooling, MeanLastTokenAndClsReadTheirRows) {
  const std::vector<std::vector<float>> rows = {{1, 2, 3}, {3, 2, 1}, {5, -4, 2}};
  PooledEmbedding mean(PoolingMode::Mean, 3, 3), last(PoolingMode::LastToken, 3, 3), cls(PoolingMode::Cls, 3, 3);
  for (int64_t position = 0; position < 3; ++position)
    for (PooledEmbedding* pooled : {&mean, &last, &cls})
      if (pooled->reads(position)) pooled->add(position, rows[position]);
  EXPECT_FALSE(last.reads(1));
  EXPECT_FALSE(cls.reads(2));
  EXPECT_EQ(mean.finish(3, false), (std::vector<float>{3, 0, 2}));
  EXPECT_EQ(last.finish(3, false), (std::vector<float>{5, -4, 2}));
  EXPECT_EQ(cls.finish(3, false), (std::vector<float>{1, 2, 3}));
  expect_error_mentions([&] { PooledEmbedding(PoolingMode::Mean, 2, 3).finish(3, false); }, {"0 of its 2 rows"});
  expect_error_mentions([&] { mean.finish(4, false); }, {"dimensions 4"});
}

TEST(Pooling, DimensionsCutBeforeNormalising) {
  PooledEmbedding pooled(PoolingMode::LastToken, 1, 3);
  pooled.add(0, std::vector<float>{3, 4, 12});
  EXPECT_EQ(pooled.finish(3, true), l2_normalized(std::vector<float>{3, 4, 12}));
  const std::vector<float> cut = pooled.finish(2, true);
  ASSERT_EQ(cut.size(), 2u);
  EXPECT_FLOAT_EQ(cut[0], 0.6f);
  EXPECT_FLOAT_EQ(cut[1], 0.8f);
  EXPECT_EQ(pooled.finish(2, false), (std::vector<float>{3, 4}));
  // torch's F.normalize keeps a zero vector zero (its norm is taken as at least 1e-12).
  EXPECT_EQ(l2_normalized(std::vector<float>{0, 0}), (std::vector<float>{0, 0}));
}

// A model folder's sentence-transformers files: modules.json over `modules` (type suffix, path),
// and 1_Pooling/config.json holding `pooling`.
fs::path write_modules(const fs::path& dir, const std::vector<std::pair<std::string, std::string>>& modules,
                       const json& pooling) {
  json list = json::array();
  for (size_t i = 0; i < modules.size(); ++i)
    list.push_back({{"idx", i},
                    {"name", std::to_string(i)},
                    {"path", modules[i].second},
                    {"type", "sentence_transformers.models." + modules[i].first}});
  std::ofstream(dir / "modules.json") << list.dump(2);
  fs::create_directories(dir / "1_Pooling");
  std::ofstream(dir / "1_Pooling" / "config.json") << pooling.dump(2);
  return dir;
}

// sentence-transformers' Pooling config.json with one flag set (as it saves them, all present).
json pooling_config(const std::string& mode, int64_t dimension = 64) {
  json config = {{"word_embedding_dimension", dimension}};
  for (const char* flag : {"pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                           "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                           "pooling_mode_lasttoken"})
    config[flag] = mode == flag;
  config["include_prompt"] = true;
  return config;
}

const std::vector<std::pair<std::string, std::string>> kNormalized = {
    {"Transformer", ""}, {"Pooling", "1_Pooling"}, {"Normalize", "2_Normalize"}};

TEST(PoolingConfig, ReadAsSentenceTransformersReadsTheFolder) {
  TempDir dir;
  const PoolingConfig fallback = read_pooling_config(dir.path(), 64);
  EXPECT_EQ(fallback.mode, PoolingMode::LastToken);
  EXPECT_TRUE(fallback.normalize);
  EXPECT_NE(fallback.source.find("without modules.json"), std::string::npos);

  write_modules(dir.path(), kNormalized, pooling_config("pooling_mode_lasttoken"));
  const PoolingConfig qwen3_embedding = read_pooling_config(dir.path(), 64);
  EXPECT_EQ(qwen3_embedding.mode, PoolingMode::LastToken);
  EXPECT_TRUE(qwen3_embedding.normalize);
  write_modules(dir.path(), {{"Transformer", ""}, {"Pooling", "1_Pooling"}}, pooling_config("pooling_mode_mean_tokens"));
  const PoolingConfig mean = read_pooling_config(dir.path(), 64);
  EXPECT_EQ(mean.mode, PoolingMode::Mean);
  EXPECT_FALSE(mean.normalize);
  write_modules(dir.path(), kNormalized, pooling_config("pooling_mode_cls_token"));
  EXPECT_EQ(read_pooling_config(dir.path(), 64).mode, PoolingMode::Cls);
  EXPECT_EQ(sentence_transformers_module_configs(dir.path() / "modules.json"),
            (std::vector<std::string>{"1_Pooling/config.json", "2_Normalize/config.json"}));
}

TEST(PoolingConfig, WhatKilnCannotHonourIsRefusedNamingTheFileAndField) {
  TempDir dir;
  const auto refused = [&](const std::vector<std::pair<std::string, std::string>>& modules, const json& pooling,
                           const std::vector<std::string>& fragments) {
    write_modules(dir.path(), modules, pooling);
    expect_error_mentions([&] { read_pooling_config(dir.path(), 64); }, fragments);
  };
  refused(kNormalized, pooling_config("pooling_mode_max_tokens"), {"1_Pooling/config.json", "pooling_mode_max_tokens"});
  json both = pooling_config("pooling_mode_mean_tokens");
  both["pooling_mode_cls_token"] = true;
  refused(kNormalized, both, {"pooling_mode_cls_token and pooling_mode_mean_tokens", "concatenate"});
  refused(kNormalized, pooling_config("none"), {"sets no pooling_mode_* flag"});
  refused(kNormalized, pooling_config("pooling_mode_lasttoken", 1024), {"word_embedding_dimension is 1024", "64"});
  refused({{"Transformer", ""}, {"Pooling", "1_Pooling"}, {"Dense", "2_Dense"}},
          pooling_config("pooling_mode_mean_tokens"), {"modules.json", "module 2", "sentence_transformers.models.Dense"});
  refused({{"Pooling", "1_Pooling"}, {"Transformer", ""}}, pooling_config("pooling_mode_mean_tokens"), {"module 0"});
  refused({{"Transformer", ""}, {"Pooling", "../elsewhere"}}, pooling_config("pooling_mode_mean_tokens"),
          {"../elsewhere"});
  std::ofstream(dir.path() / "modules.json") << "{";
  expect_error_mentions([&] { read_pooling_config(dir.path(), 64); }, {"modules.json", "not valid JSON"});
}

// Windows of the fixture prompt: one token, one chunk, and inputs that span two and three
// 64-token chunks.
std::vector<std::vector<int32_t>> scheduler_inputs(const std::vector<int32_t>& prompt) {
  return {{prompt.begin() + 5, prompt.begin() + 6},
          {prompt.begin(), prompt.begin() + 20},
          {prompt.begin() + 10, prompt.begin() + 160},
          {prompt.begin() + 100, prompt.begin() + 170}};
}

// What the input's embedding must be: its hidden states from one forward, pooled and normalised.
std::vector<float> expected_embedding(Model& model, const std::vector<int32_t>& input, PoolingMode mode,
                                      int64_t dimensions) {
  const Tensor hidden = prompt_hidden_states(model, input);
  PooledEmbedding pooled(mode, hidden.dim(0), hidden.dim(1));
  for (int64_t position = 0; position < hidden.dim(0); ++position)
    if (pooled.reads(position)) pooled.add(position, row(hidden, position));
  return pooled.finish(dimensions, true);
}

std::vector<std::vector<float>> wait_for(EmbeddingJob& job) {
  for (int i = 0; i < 600; ++i)
    if (auto embeddings = job.wait(std::chrono::milliseconds(100))) return *embeddings;
  ADD_FAILURE() << "the embeddings did not come within 60 s";
  return {};
}

// Each input alone, all in one request, and each its own request at once (3 slots, so inputs wait
// for slots and start beside others mid-prefill): the same bits, those of its one-shot forward.
TEST(EmbeddingScheduler, AnInputGetsTheSameBitsAloneBatchedOrChunked) {
  const fs::path fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  Model& model = *loaded.model;
  const std::vector<std::vector<int32_t>> inputs = scheduler_inputs(fixture_prompt(fixture));
  for (PoolingMode mode : {PoolingMode::LastToken, PoolingMode::Mean, PoolingMode::Cls}) {
    SCOPED_TRACE(std::string(pooling_mode_name(mode)));
    // Computed while no scheduler runs the model.
    std::vector<std::vector<float>> expected;
    for (const auto& input : inputs) expected.push_back(expected_embedding(model, input, mode, 64));
    const std::vector<float> expected_cut = expected_embedding(model, inputs[2], mode, 16);

    std::vector<std::vector<float>> alone, separately, together, cut;
    {
      EmbeddingScheduler scheduler(model, {.max_batch = 3,
                                           .context_tokens = 256,
                                           .max_queue = 8,
                                           .prefill_chunk = 64,
                                           .pooling = {mode, true, "test"}});
      for (const auto& input : inputs) alone.push_back(wait_for(*scheduler.submit({input}, 64)).at(0));
      together = wait_for(*scheduler.submit(inputs, 64));
      std::vector<std::shared_ptr<EmbeddingJob>> jobs;
      for (const auto& input : inputs) jobs.push_back(scheduler.submit({input}, 64));
      for (const auto& job : jobs) separately.push_back(wait_for(*job).at(0));
      cut = wait_for(*scheduler.submit({inputs[2]}, 16));
    }
    ASSERT_EQ(together.size(), inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_EQ(alone[i], expected[i]) << "input " << i << " alone";
      EXPECT_EQ(together[i], expected[i]) << "input " << i << " in one request";
      EXPECT_EQ(separately[i], expected[i]) << "input " << i << " among other requests";
    }
    EXPECT_EQ(cut.at(0), expected_cut);
  }
}

TEST(EmbeddingScheduler, RefusesWhatItCannotEmbed) {
  TestModel loaded = open_cpu_model(fixtures_dir() / "qwen3-tiny" / "f32");
  EmbeddingScheduler scheduler(*loaded.model, {.max_batch = 1, .context_tokens = 64, .max_queue = 1});
  expect_error_mentions([&] { scheduler.submit({}, 64); }, {"at least one input"});
  expect_error_mentions([&] { scheduler.submit({{1}, {}}, 64); }, {"input 1 is empty"});
  expect_error_mentions([&] { scheduler.submit({std::vector<int32_t>(65, 1)}, 64); }, {"65 tokens", "64"});
  expect_error_mentions([&] { scheduler.submit({{1, 512}}, 64); }, {"token id 512"});
  expect_error_mentions([&] { scheduler.submit({{1}}, 65); }, {"dimensions", "1 to 64"});
}

using server::ApiError;
using server::EmbeddingEncoding;
using server::parse_embedding_request;

// The param of the 400 (or other ApiError) parsing `body` gives.
std::string refused_param(const json& body, int expected_status = 400) {
  try {
    parse_embedding_request(body, "emb", 512, 64);
  } catch (const ApiError& error) {
    EXPECT_EQ(error.status(), expected_status) << body.dump() << ": " << error.what();
    return error.param();
  }
  ADD_FAILURE() << "accepted " << body.dump();
  return "";
}

TEST(EmbeddingRequest, TakesEveryInputFormOfTheOpenAiApi) {
  const auto parse = [](json input, json extra = json::object()) {
    json body = {{"model", "emb"}, {"input", std::move(input)}};
    body.update(extra);
    return parse_embedding_request(body, "emb", 512, 64);
  };
  const auto one = parse("a story");
  ASSERT_EQ(one.inputs.size(), 1u);
  EXPECT_EQ(one.inputs[0].text, "a story");
  EXPECT_EQ(one.inputs[0].param, "input");
  EXPECT_EQ(one.encoding, EmbeddingEncoding::Float);
  EXPECT_FALSE(one.dimensions);
  const auto texts = parse({"a", "b"}, {{"encoding_format", "base64"}, {"dimensions", 8}, {"user", "u"}});
  ASSERT_EQ(texts.inputs.size(), 2u);
  EXPECT_EQ(texts.inputs[1].text, "b");
  EXPECT_EQ(texts.inputs[1].param, "input[1]");
  EXPECT_EQ(texts.encoding, EmbeddingEncoding::Base64);
  EXPECT_EQ(texts.dimensions, 8);
  const auto ids = parse({1, 2, 3});
  ASSERT_EQ(ids.inputs.size(), 1u);
  EXPECT_FALSE(ids.inputs[0].text);
  EXPECT_EQ(ids.inputs[0].ids, (std::vector<int32_t>{1, 2, 3}));
  const auto id_lists = parse({{1, 2}, {3}});
  ASSERT_EQ(id_lists.inputs.size(), 2u);
  EXPECT_EQ(id_lists.inputs[1].ids, (std::vector<int32_t>{3}));
  EXPECT_EQ(parse("x", {{"encoding_format", "float"}}).encoding, EmbeddingEncoding::Float);
}

TEST(EmbeddingRequest, RefusesBadInputNamingTheField) {
  const json ok = {{"model", "emb"}, {"input", "a"}};
  const auto with = [&](const std::string& key, json value) {
    json body = ok;
    body[key] = std::move(value);
    return body;
  };
  EXPECT_EQ(refused_param({{"model", "emb"}}), "input");
  EXPECT_EQ(refused_param(with("input", "")), "input");
  EXPECT_EQ(refused_param(with("input", json::array())), "input");
  EXPECT_EQ(refused_param(with("input", 5)), "input");
  EXPECT_EQ(refused_param(with("input", {"a", ""})), "input[1]");
  EXPECT_EQ(refused_param(with("input", {"a", 1})), "input[1]");
  EXPECT_EQ(refused_param(with("input", {1, "a"})), "input[1]");
  EXPECT_EQ(refused_param(with("input", {1, 512})), "input[1]");
  EXPECT_EQ(refused_param(with("input", {1, -1})), "input[1]");
  EXPECT_EQ(refused_param(with("input", {json::array({1}), json::array()})), "input[1]");
  EXPECT_EQ(refused_param(with("input", {json::array({1}), "a"})), "input[1]");
  EXPECT_EQ(refused_param(with("input", {json::array({1, 2.5})})), "input[0][1]");
  EXPECT_EQ(refused_param(with("input", {json::object()})), "input[0]");
  EXPECT_EQ(refused_param(with("input", json(std::vector<std::string>(server::kMaxEmbeddingInputs + 1, "a")))),
            "input");
  EXPECT_EQ(refused_param(with("encoding_format", "int8")), "encoding_format");
  EXPECT_EQ(refused_param(with("encoding_format", 1)), "encoding_format");
  EXPECT_EQ(refused_param(with("dimensions", 0)), "dimensions");
  EXPECT_EQ(refused_param(with("dimensions", 65)), "dimensions");
  EXPECT_EQ(refused_param(with("dimensions", 1.5)), "dimensions");
  EXPECT_EQ(refused_param(with("user", 1)), "user");
  EXPECT_EQ(refused_param(with("truncate", true)), "truncate");
  EXPECT_EQ(refused_param(with("model", "other"), 404), "model");
}

TEST(EmbeddingResponse, Base64IsTheLittleEndianFloatBytes) {
  // Python: base64.b64encode(struct.pack('<2f', 1.0, -2.0)), and so on.
  EXPECT_EQ(server::base64_f32(std::vector<float>{1.0f}), "AACAPw==");
  EXPECT_EQ(server::base64_f32(std::vector<float>{1.0f, -2.0f}), "AACAPwAAAMA=");
  EXPECT_EQ(server::base64_f32(std::vector<float>{0.5f, 0.25f, -0.125f}), "AAAAPwAAgD4AAAC+");
  EXPECT_EQ(server::base64_f32(std::vector<float>{}), "");
  const json body = server::embeddings_body({{0.5f, 0.25f}, {1.0f}}, EmbeddingEncoding::Float, "emb", 7);
  EXPECT_EQ(body, json::parse(R"({"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,0.25]},
      {"object":"embedding","index":1,"embedding":[1.0]}],"model":"emb","usage":{"prompt_tokens":7,"total_tokens":7}})"));
  EXPECT_EQ(server::embeddings_body({{1.0f}}, EmbeddingEncoding::Base64, "emb", 1)["data"][0]["embedding"], "AACAPw==");
}

// A copy of stories260K that declares sentence-transformers mean pooling with normalisation.
void write_embedding_stories(const fs::path& dir, const json& pooling) {
  for (const char* file : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(stories_dir() / file, dir / file);
  write_modules(dir, kNormalized, pooling);
}

TEST(EmbeddingServerStart, RefusesAPoolingItCannotComputeBeforeListening) {
  KILN_REQUIRE_STORIES(stories);
  TempDir dir;
  write_embedding_stories(dir.path(), pooling_config("pooling_mode_max_tokens"));
  expect_one_line_error(
      {fmt::format("serve --embeddings --port 0 --model {}", dir.path().string()), "pooling_mode_max_tokens"});
}

// One `kiln serve --embeddings` for every case below.
class EmbeddingServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kiln_binary())) return;
    model_ = new TempDir();
    write_embedding_stories(model_->path(), pooling_config("pooling_mode_mean_tokens"));
    server_ = new ServeProcess({"--embeddings", "--model", model_->path().string(), "--served-model-name", "emb",
                                "--max-batch", "4", "--max-context", "256"});
  }
  static void TearDownTestSuite() {
    delete server_;
    delete model_;
    server_ = nullptr;
    model_ = nullptr;
  }
  void SetUp() override {
    KILN_REQUIRE_STORIES(dir);
    ASSERT_NE(server_->port(), 0) << "kiln serve --embeddings did not start:\n" << server_->log();
    port_ = server_->port();
  }

  // The answer to a request that must succeed.
  json embed(json body) const {
    body["model"] = "emb";
    auto response = post(port_, "/v1/embeddings", body);
    if (!response) {
      ADD_FAILURE() << "no answer to " << body.dump();
      return json();
    }
    EXPECT_EQ(response->status, 200) << response->body;
    return json::parse(response->body);
  }

  static std::vector<float> floats(const json& embedding) { return embedding.get<std::vector<float>>(); }

  static TempDir* model_;
  static ServeProcess* server_;
  uint16_t port_ = 0;
};
TempDir* EmbeddingServer::model_ = nullptr;
ServeProcess* EmbeddingServer::server_ = nullptr;

TEST_F(EmbeddingServer, AnswersAsOpenAiDoesWhateverTheInputForm) {
  EXPECT_NE(server_->log().find("mean pooling, L2-normalised"), std::string::npos) << server_->log();
  const std::string story = "Once upon a time";
  const json one = embed({{"input", story}});
  EXPECT_EQ(one["object"], "list");
  EXPECT_EQ(one["model"], "emb");
  ASSERT_EQ(one["data"].size(), 1u);
  EXPECT_EQ(one["data"][0]["object"], "embedding");
  EXPECT_EQ(one["data"][0]["index"], 0);
  const std::vector<float> alone = floats(one["data"][0]["embedding"]);
  ASSERT_EQ(alone.size(), 64u);
  EXPECT_NEAR(std::sqrt(std::inner_product(alone.begin(), alone.end(), alone.begin(), 0.0)), 1.0, 1e-6);

  // The tokenizer's specials (stories260K's BOS) are counted, as they are embedded.
  auto tokenized = post(port_, "/tokenize", {{"prompt", story}});
  ASSERT_TRUE(tokenized);
  const std::vector<int32_t> ids = json::parse(tokenized->body)["tokens"].get<std::vector<int32_t>>();
  EXPECT_EQ(one["usage"], json({{"prompt_tokens", ids.size()}, {"total_tokens", ids.size()}}));

  const json batch = embed({{"input", {story, "The cat sat on the mat.", story}}});
  ASSERT_EQ(batch["data"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(batch["data"][i]["index"], i);
  EXPECT_EQ(floats(batch["data"][0]["embedding"]), alone);
  EXPECT_EQ(floats(batch["data"][2]["embedding"]), alone);
  EXPECT_NE(floats(batch["data"][1]["embedding"]), alone);
  EXPECT_GT(batch["usage"]["prompt_tokens"].get<size_t>(), 2 * ids.size());

  EXPECT_EQ(floats(embed({{"input", ids}})["data"][0]["embedding"]), alone);
  const json id_lists = embed({{"input", {ids, ids}}});
  EXPECT_EQ(floats(id_lists["data"][1]["embedding"]), alone);

  const std::string encoded = embed({{"input", story}, {"encoding_format", "base64"}})["data"][0]["embedding"];
  EXPECT_EQ(encoded, server::base64_f32(alone));

  const std::vector<float> cut = floats(embed({{"input", story}, {"dimensions", 8}})["data"][0]["embedding"]);
  ASSERT_EQ(cut.size(), 8u);
  const std::vector<float> expected = l2_normalized(std::vector<float>(alone.begin(), alone.begin() + 8));
  for (size_t i = 0; i < cut.size(); ++i) EXPECT_NEAR(cut[i], expected[i], 1e-6) << i;
}

TEST_F(EmbeddingServer, BadRequestsGetA400AndTheServerGoesOn) {
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"model", "emb"}, {"input", ""}}, "input"},
      {{{"model", "emb"}, {"input", json::array()}}, "input"},
      {{{"model", "emb"}, {"input", {{1, 2}, "a"}}}, "input[1]"},
      {{{"model", "emb"}, {"input", std::vector<int32_t>(300, 5)}}, "input"},
      {{{"model", "emb"}, {"input", {"a", std::string(2000, 'a')}}}, "input[1]"},
      {{{"model", "emb"}, {"input", "a"}, {"dimensions", 65}}, "dimensions"},
      {{{"model", "emb"}, {"input", "a"}, {"encoding_format", "binary"}}, "encoding_format"},
  };
  for (const auto& [body, param] : cases) {
    auto response = post(port_, "/v1/embeddings", body);
    ASSERT_TRUE(response);
    EXPECT_EQ(response->status, 400) << body.dump().substr(0, 200) << "\n" << response->body;
    const json error = json::parse(response->body);
    EXPECT_EQ(error["error"]["param"], param) << response->body;
    EXPECT_FALSE(error["error"]["message"].get<std::string>().empty());
  }
  auto chat = post(port_, "/v1/chat/completions", chat_body("hi", 4));
  ASSERT_TRUE(chat);
  EXPECT_EQ(chat->status, 400) << chat->body;
  EXPECT_EQ(json::parse(chat->body)["error"]["code"], "generation_not_served") << chat->body;
  auto page = http_exchange(port_, "GET", "/", "");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 404) << page->body;
  EXPECT_EQ(json::parse(page->body)["error"]["code"], "generation_not_served") << page->body;
  EXPECT_EQ(embed({{"input", "still serving"}})["data"].size(), 1u);
  EXPECT_GE(metric_value(port_, "kiln_prompt_tokens_total"), 1);
}

TEST_F(EmbeddingServer, TheOfficialOpenAiClientGetsTheSameEmbeddings) {
  const fs::path npm_cache = npm_cache_dir();
  if (run_command("command -v node").exit_code != 0) GTEST_SKIP() << "node is not installed";
  if (!fs::exists(npm_cache / "node_modules/openai"))
    GTEST_SKIP() << "the openai npm client is not installed in " << npm_cache << " (scripts/setup.sh installs it)";
  const auto result = run_command(fmt::format(
      "cd {} && KILN_BASE_URL=http://127.0.0.1:{} KILN_MODEL=emb KILN_NPM_CACHE={} timeout 60 node "
      "tests/npm/embeddings_client.mjs",
      source_dir().string(), port_, npm_cache.string()));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("# fail 0"), std::string::npos) << result.output;
}

}  // namespace
