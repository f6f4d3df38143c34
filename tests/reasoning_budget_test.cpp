// The reasoning budget (engine/reasoning_budget.h): its tracker on token sequences, the generation
// core forcing the close on the qwen3-tiny fixture, alone and batched, and kiln serve's
// thinking_token_budget and thinking.budget_tokens on stories260K with a template that opens
// <think>.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/generation.h"
#include "engine/grammar/json_schema.h"
#include "engine/reasoning_budget.h"
#include "engine/scheduler.h"
#include "model_test_support.h"
#include "npm_reference.h"
#include "serve_process.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;
using json = nlohmann::ordered_json;

namespace {

// <think> = 1, </think> = 2 3, forced "\n</think>\n\n" = 9 2 3 9.
ReasoningBudget budget_of(int64_t max_tokens, bool opened_by_prompt) {
  return {{1}, {2, 3}, {9, 2, 3, 9}, max_tokens, opened_by_prompt};
}

// What a request generates when the model would write `model_tokens` in order, each forced token
// taking the place of the model's next one.
std::vector<int32_t> run(const ReasoningBudget& budget, const std::vector<int32_t>& model_tokens) {
  ReasoningBudgetTracker tracker(budget);
  std::vector<int32_t> out;
  for (int32_t token : model_tokens) {
    const int32_t taken = tracker.forced_next().value_or(token);
    out.push_back(taken);
    tracker.accept(taken);
  }
  return out;
}

TEST(ReasoningBudget, ForcesTheCloseAtTheCap) {
  // Opened by the prompt: four reasoning tokens, then the close and its layout, then the answer.
  EXPECT_EQ(run(budget_of(4, true), {5, 6, 7, 8, 50, 51, 52, 53, 54, 55}),
            (std::vector<int32_t>{5, 6, 7, 8, 9, 2, 3, 9, 54, 55}));
  // Budget 0: the close comes first.
  EXPECT_EQ(run(budget_of(0, true), {5, 6, 7, 8, 9}), (std::vector<int32_t>{9, 2, 3, 9, 9}));
  // Opened by the model: counted from its open marker; a budget of 0 closes right after it.
  EXPECT_EQ(run(budget_of(2, false), {5, 1, 6, 7, 8, 50, 51, 52, 53}),
            (std::vector<int32_t>{5, 1, 6, 7, 9, 2, 3, 9, 53}));
  EXPECT_EQ(run(budget_of(0, false), {5, 1, 6, 7, 8, 50}), (std::vector<int32_t>{5, 1, 9, 2, 3, 9}));
  // Never opened: nothing forced.
  EXPECT_EQ(run(budget_of(0, false), {5, 6, 7}), (std::vector<int32_t>{5, 6, 7}));
}

TEST(ReasoningBudget, AReplyThatClosesInTimeIsLeftAlone) {
  EXPECT_EQ(run(budget_of(4, true), {5, 2, 3, 6, 7, 8, 1, 4, 4, 4, 4, 4}),
            (std::vector<int32_t>{5, 2, 3, 6, 7, 8, 1, 4, 4, 4, 4, 4}));
}

TEST(ReasoningBudget, AClosingMarkerBegunAtTheCapIsFinishedNotRepeated) {
  // The cap falls on the first token of a two-token close: forcing goes on with its second.
  EXPECT_EQ(run(budget_of(3, true), {5, 6, 2, 50, 51, 52}), (std::vector<int32_t>{5, 6, 2, 3, 9, 52}));
}

TEST(ReasoningBudget, SaysWhenTheNextTwoTokensAreFree) {
  ReasoningBudgetTracker waiting(budget_of(3, false));
  EXPECT_TRUE(waiting.next_two_free());
  EXPECT_FALSE(ReasoningBudgetTracker(budget_of(0, false)).next_two_free());
  ReasoningBudgetTracker reasoning(budget_of(3, true));
  EXPECT_TRUE(reasoning.next_two_free());   // tokens 1 and 2 of 3: free
  reasoning.accept(5);
  EXPECT_TRUE(reasoning.next_two_free());   // tokens 2 and 3 of 3: free
  reasoning.accept(6);
  EXPECT_FALSE(reasoning.next_two_free());  // token 3 reaches the cap: the one after is forced
  reasoning.accept(7);
  EXPECT_EQ(reasoning.reasoning_tokens(), 3);
  EXPECT_EQ(reasoning.forced_next(), 9);
  EXPECT_FALSE(reasoning.next_two_free());
  for (int32_t token : {9, 2, 3, 9}) reasoning.accept(token);
  EXPECT_FALSE(reasoning.forced_next());
  EXPECT_TRUE(reasoning.next_two_free());
}

TEST(ReasoningBudget, RefusesWhatCannotBeForced) {
  EXPECT_THROW((ReasoningBudget{{}, {2}, {2}, 1, true}.validate(100)), Error);
  EXPECT_THROW((ReasoningBudget{{1}, {2, 3}, {9, 2}, 1, true}.validate(100)), Error);
  EXPECT_THROW((ReasoningBudget{{1}, {2}, {2}, -1, true}.validate(100)), Error);
  EXPECT_THROW((ReasoningBudget{{1}, {200}, {200}, 1, true}.validate(100)), Error);
  EXPECT_NO_THROW(budget_of(0, true).validate(100));
  GenerationRequest request;
  request.prompt = {1, 2};
  request.reasoning_budget = budget_of(1, true);
  request.grammar = std::make_shared<const grammar::CompiledGrammar>(
      grammar::json_object_grammar(), std::make_shared<const grammar::TokenVocabulary>(std::vector<std::string>(100, "a")));
  EXPECT_THROW(bound_request(request, 64, 100), Error);
}

// On a model: the tokens up to the cap are those of the same request without a budget, then the
// forced ones; a reasoning opened by the model's own token counts from there; forced tokens have
// logprob 0 and are their own only alternative; batched, every request equals its solo run.
TEST(ReasoningBudget, TheCoreForcesTheCloseAloneAndBatched) {
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> full_prompt = fixture_prompt(fixture);
  const std::vector<int32_t> prompt(full_prompt.begin(), full_prompt.begin() + 24);
  GenerationOptions options;
  options.max_tokens = 16;
  options.sampling = {0.8f, 40, 1.0f, 0.0f, 7};
  const std::vector<int32_t> free_run = generate(*loaded.model, prompt, options).tokens;
  ASSERT_EQ(free_run.size(), 16u);

  ReasoningBudget budget{{full_prompt[40]}, {full_prompt[41]}, {full_prompt[42], full_prompt[41]}, 5, true};
  options.reasoning_budget = budget;
  const std::vector<int32_t> capped = generate(*loaded.model, prompt, options).tokens;
  EXPECT_EQ(std::vector<int32_t>(capped.begin(), capped.begin() + 5), std::vector<int32_t>(free_run.begin(), free_run.begin() + 5));
  EXPECT_EQ(std::vector<int32_t>(capped.begin() + 5, capped.begin() + 7), budget.forced);

  // The model's own third token opens reasoning: two tokens of it, then the close.
  budget.open = {free_run[2]};
  budget.opened_by_prompt = false;
  budget.max_tokens = 2;
  options.reasoning_budget = budget;
  const std::vector<int32_t> opened = generate(*loaded.model, prompt, options).tokens;
  EXPECT_EQ(std::vector<int32_t>(opened.begin(), opened.begin() + 5), std::vector<int32_t>(free_run.begin(), free_run.begin() + 5));
  EXPECT_EQ(std::vector<int32_t>(opened.begin() + 5, opened.begin() + 7), budget.forced);

  SchedulerOptions scheduler_options;
  scheduler_options.max_batch = 2;
  scheduler_options.context_tokens = 128;
  scheduler_options.prefill_chunk = 64;
  Scheduler scheduler(*loaded.model, scheduler_options);
  GenerationRequest request;
  request.prompt = prompt;
  request.max_tokens = 8;
  request.top_logprobs = 2;
  request.reasoning_budget = ReasoningBudget{{1}, {2}, {3, 2}, 0, true};
  const std::shared_ptr<RequestStream> stream = scheduler.submit(request);
  for (int32_t expected : {3, 2}) {
    const std::optional<TokenEvent> event = stream->next(std::chrono::seconds(30));
    ASSERT_TRUE(event);
    EXPECT_EQ(event->token, expected);
    EXPECT_EQ(event->logprob, 0.0f);
    EXPECT_EQ(event->top_logprobs, (std::vector<std::pair<int32_t, float>>{{expected, 0.0f}}));
  }
  stream->cancel();

  const std::vector<GenerationRequest> requests = budgeted_scheduler_requests(full_prompt, 12);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*loaded.model, requests);
  expect_reasoning_capped(requests, solo);
  expect_solo_results(scheduled_events(*loaded.model, requests, 512), requests, solo);
}

// stories260K with a template that opens <think> in the generation prompt and writes reasoning as
// Qwen3's does ("<think>\n…\n</think>\n\n"): the forced close is "\n</think>\n\n", in the
// tokens of a vocabulary without a <think> token.
class ReasoningBudgetServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kiln_binary())) return;
    temp_ = new TempDir;
    const auto template_path = temp_->path() / "think.jinja";
    write_text_file(template_path,
                    "{%- for message in messages %}{{ message.role }}: {% if message.reasoning_content %}<think>\n"
                    "{{ message.reasoning_content }}\n</think>\n\n{% endif %}{{ message.content }}\n{% endfor %}"
                    "assistant: <think>\n");
    server_ = new ServeProcess(stories_arguments(stories_dir(), {"--chat-template", template_path.string()}));
  }
  static void TearDownTestSuite() {
    delete server_;
    delete temp_;
  }
  void SetUp() override {
    KILN_REQUIRE_STORIES(dir);
    ASSERT_NE(server_->port(), 0) << "kiln serve did not start:\n" << server_->log();
  }
  static TempDir* temp_;
  static ServeProcess* server_;
};
TempDir* ReasoningBudgetServer::temp_ = nullptr;
ServeProcess* ReasoningBudgetServer::server_ = nullptr;

// The reply's tokens (logprobs): `budget` sampled ones, then the forced close (logprob exactly 0,
// which no sampled token has here), then the answer; its reasoning is the first tokens' text with
// the close's line break, its content the text after the close.
TEST_F(ReasoningBudgetServer, ReasoningStopsAtTheBudgetAndTheAnswerFollows) {
  for (int budget : {0, 6}) {
    SCOPED_TRACE(budget);
    auto response = post(server_->port(), "/v1/chat/completions",
                         chat_body("Once upon a time", 40,
                                   {{"temperature", 0.8}, {"seed", 3}, {"ignore_eos", true}, {"logprobs", true},
                                    {"thinking_token_budget", budget}}));
    ASSERT_TRUE(response);
    ASSERT_EQ(response->status, 200) << response->body;
    const json choice = json::parse(response->body)["choices"][0];
    const json& tokens = choice["logprobs"]["content"];
    ASSERT_EQ(tokens.size(), 40u);
    std::string reasoning, text;
    size_t forced = 0;
    for (size_t index = 0; index < tokens.size(); ++index) {
      const bool is_forced = tokens[index]["logprob"].get<double>() == 0.0;
      if (index < static_cast<size_t>(budget)) {
        EXPECT_FALSE(is_forced) << index;
        reasoning += tokens[index]["token"].get<std::string>();
      } else if (index == static_cast<size_t>(budget) + forced && is_forced) {
        ++forced;
      } else {
        EXPECT_FALSE(is_forced) << index;
      }
      text += tokens[index]["token"].get<std::string>();
    }
    // "\n</think>\n\n" in stories' vocabulary, a character or two a token.
    EXPECT_GE(forced, 5u);
    EXPECT_EQ(choice["message"]["reasoning_content"].get<std::string>(), reasoning + "\n");
    const std::string content = choice["message"]["content"];
    EXPECT_FALSE(content.empty());
    EXPECT_EQ(text, reasoning + "\n</think>\n\n" + content);
  }
}

TEST_F(ReasoningBudgetServer, AnthropicBudgetTokensEndsTheThinkingBlock) {
  auto response = post(server_->port(), "/v1/messages",
                       {{"model", "stories260K"},
                        {"max_tokens", 40},
                        {"temperature", 0.7},
                        {"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                        {"thinking", {{"type", "enabled"}, {"budget_tokens", 4}}}});
  ASSERT_TRUE(response);
  ASSERT_EQ(response->status, 200) << response->body;
  const json content = json::parse(response->body)["content"];
  ASSERT_GE(content.size(), 1u) << content;
  EXPECT_EQ(content[0]["type"], "thinking");
  // Four tokens of stories' vocabulary and the forced line break: a few characters, not the forty
  // tokens the reply ran to.
  EXPECT_LE(content[0]["thinking"].get<std::string>().size(), 40u) << content;
  EXPECT_TRUE(content[0]["thinking"].get<std::string>().ends_with("\n")) << content;
}

TEST_F(ReasoningBudgetServer, BadBudgetsAre400sNamingTheField) {
  const auto error_of = [&](const std::string& path, const json& body) {
    auto response = post(server_->port(), path, body);
    EXPECT_TRUE(response);
    EXPECT_EQ(response->status, 400) << response->body;
    return json::parse(response->body)["error"];
  };
  for (const json& value : {json(-1), json("8"), json(1.5)})
    EXPECT_EQ(error_of("/v1/chat/completions", chat_body("Hi", 5, {{"thinking_token_budget", value}}))["param"],
              "thinking_token_budget");
  EXPECT_EQ(error_of("/v1/chat/completions",
                     chat_body("Hi", 5, {{"thinking_token_budget", 2}, {"response_format", {{"type", "json_object"}}}}))["param"],
            "thinking_token_budget");
  const json anthropic = {{"model", "stories260K"}, {"max_tokens", 5}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  json disabled = anthropic;
  disabled["thinking"] = {{"type", "disabled"}, {"budget_tokens", 2}};
  EXPECT_NE(error_of("/v1/messages", disabled)["message"].get<std::string>().find("thinking.budget_tokens"),
            std::string::npos);
  json negative = anthropic;
  negative["thinking"] = {{"type", "enabled"}, {"budget_tokens", -3}};
  EXPECT_NE(error_of("/v1/messages", negative)["message"].get<std::string>().find("thinking.budget_tokens"),
            std::string::npos);
}

}  // namespace
