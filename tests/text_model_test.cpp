// The library's text facade (text/text_model.h): the README's story through TextModel, streamed
// pieces that add up to the result, stop strings, a chat through the model's own template and one on a model without a template.
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/loader.h"
#include "test_support.h"
#include "text/text_model.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

// stories260K opened through TextModel (`model`) on the CPU backend.
class TextModelOnStories260K : public ::testing::Test {
 protected:
  void SetUp() override {
    folder = stories_dir();
    model.emplace(TextModel::open(folder, *cpu));
  }

  std::filesystem::path folder;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::optional<TextModel> model;
};

TEST_F(TextModelOnStories260K, GeneratesTheReferenceStoryAndStreamsItInPieces) {
  const auto ref = nlohmann::json::parse(std::ifstream(folder / "ref_greedy.json"));
  std::vector<int32_t> path = {1};
  for (int32_t id : ref["greedy_ids"].get<std::vector<int32_t>>()) path.push_back(id);
  const std::string story = model->tokenizer().decode(path, true);

  TextOptions options;
  options.max_tokens = 252;  // the reference's 256 steps less the prompt's 4 tokens
  options.sampling.temperature = 0;
  std::string streamed;
  const TextResult result = model->generate("Once upon a time", options, [&](std::string_view text) {
    streamed += text;
    return true;
  });
  EXPECT_EQ("Once upon a time" + result.text, story);
  EXPECT_EQ(streamed, result.text);
  EXPECT_EQ(result.prompt_tokens, 5);  // BOS and 4 tokens
  EXPECT_EQ(result.completion_tokens, 252);
  EXPECT_EQ(result.finish_reason, FinishReason::Length);
}

TEST_F(TextModelOnStories260K, StopsAtAStopStringOrWhenTheCallbackSaysSo) {
  TextOptions options;
  options.sampling.temperature = 0;
  options.stop = {"park"};
  const TextResult stopped = model->generate("Once upon a time", options);
  EXPECT_EQ(stopped.text, ", there was a little girl named Lily. She loved to play outside in the ");
  EXPECT_EQ(stopped.finish_reason, FinishReason::Stop);

  options.stop.clear();
  int pieces = 0;
  const TextResult cut = model->generate("Once upon a time", options, [&](std::string_view) { return ++pieces < 3; });
  EXPECT_EQ(pieces, 3);
  EXPECT_EQ(cut.completion_tokens, 3);
  EXPECT_EQ(cut.finish_reason, FinishReason::Stop);
}

TEST_F(TextModelOnStories260K, ChatsThroughItsOwnTemplate) {
  const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", "Once upon a time"}}};
  TextOptions options;
  options.max_tokens = 8;
  options.sampling.temperature = 0;
  const TextResult answer = model->chat(messages, options);
  // models/stories260K/chat_template.jinja renders a user turn as BOS and its text: the chat
  // continues the story as generate does.
  const TextResult story = model->generate("Once upon a time", options);
  EXPECT_EQ(answer.text, story.text);
  EXPECT_EQ(answer.prompt_tokens, story.prompt_tokens);
}

TEST_F(TextModelOnStories260K, AChatNeedsAChatTemplate) {
  TempDir copy;
  for (const char* file : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    std::filesystem::copy_file(folder / file, copy.path() / file);
  TextModel untemplated = TextModel::open(copy.path(), *cpu);
  const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", "Hi"}}};
  try {
    untemplated.chat(messages, {});
    FAIL() << "the copy has no chat template";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("has no chat template"), std::string::npos) << error.what();
  }

  TextModel templated(load_model(copy.path(), *cpu), copy.path(),
                      "{% for m in messages %}{{ m.content }}{% endfor %}");
  TextOptions options;
  options.max_tokens = 4;
  options.sampling.temperature = 0;
  const TextResult answer = templated.chat(messages, options);
  EXPECT_EQ(answer.completion_tokens, 4);
  EXPECT_EQ(answer.prompt_tokens, static_cast<int64_t>(templated.tokenizer().encode("Hi", false).size()));
}

}  // namespace
