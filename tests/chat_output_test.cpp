// The chat output parser: reasoning and tool calls split from a reply, whole and streamed at every
// split point, in each syntax; malformed calls come back as text.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/chat_output.h"

using namespace kiln;
using json = nlohmann::ordered_json;

namespace {

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "code": {"type": "string"}}}}}
])");

ChatOutput parse_whole(ChatOutputSyntax syntax, const std::string& text, bool in_reasoning = false) {
  ChatOutputParser parser(syntax, kTools, in_reasoning);
  parser.push(text);
  parser.finish();
  return parser.output();
}

// The reply streamed in pieces of `step` bytes, events joined back.
ChatOutput parse_streamed(ChatOutputSyntax syntax, const std::string& text, size_t step, bool in_reasoning = false) {
  ChatOutputParser parser(syntax, kTools, in_reasoning);
  ChatOutput joined;
  auto take = [&](const std::vector<ChatOutputEvent>& events) {
    for (const ChatOutputEvent& event : events) {
      if (event.kind == ChatOutputEvent::Kind::Content) joined.content += event.text;
      if (event.kind == ChatOutputEvent::Kind::Reasoning) joined.reasoning += event.text;
      if (event.kind == ChatOutputEvent::Kind::ToolCall) {
        EXPECT_EQ(event.call_index, joined.tool_calls.size());
        joined.tool_calls.push_back(event.call);
      }
    }
  };
  for (size_t at = 0; at < text.size(); at += step) take(parser.push(text.substr(at, step)));
  take(parser.finish());
  return joined;
}

void expect_same(const ChatOutput& a, const ChatOutput& b, const std::string& what) {
  EXPECT_EQ(a.content, b.content) << what;
  EXPECT_EQ(a.reasoning, b.reasoning) << what;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << what;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << what;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << what;
  }
}

// Whole, and streamed one byte, three bytes and seven bytes at a time: the same split.
ChatOutput parse_every_way(ChatOutputSyntax syntax, const std::string& text, bool in_reasoning = false) {
  const ChatOutput whole = parse_whole(syntax, text, in_reasoning);
  for (size_t step : {1, 3, 7}) expect_same(whole, parse_streamed(syntax, text, step, in_reasoning), "step " + std::to_string(step));
  return whole;
}

constexpr ChatOutputSyntax kQwen3{ToolCallSyntax::Hermes, true};
constexpr ChatOutputSyntax kQwen35{ToolCallSyntax::QwenXml, true};
constexpr ChatOutputSyntax kLlama{ToolCallSyntax::LlamaJson, false};
constexpr ChatOutputSyntax kMiniCpm{ToolCallSyntax::MiniCpmXml, true};

TEST(ChatOutput, HermesCallsAfterReasoningAndText) {
  const ChatOutput out = parse_every_way(kQwen3,
      "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n"
      R"({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}})"
      "\n</tool_call>\n<tool_call>\n"
      R"({"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"})"
      "\n</tool_call>");
  EXPECT_EQ(out.reasoning, "\nThe user wants weather.\n");
  EXPECT_EQ(out.content, "Let me check.\n");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(out.tool_calls[0].arguments), json::parse(R"({"city": "Paris", "days": 2})"));
  EXPECT_EQ(json::parse(out.tool_calls[1].arguments), json::parse(R"({"city": "Rome"})"));
}

TEST(ChatOutput, QwenXmlValuesAreTypedByTheToolSchema) {
  const ChatOutput out = parse_every_way(kQwen35,
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
      "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=code>\n007\n</parameter>\n"
      "<parameter=note>\nmulti\nline\n</parameter>\n</function>\n</tool_call>");
  EXPECT_EQ(out.content, "");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(json::parse(out.tool_calls[0].arguments),
            json::parse(R"({"city": "New York", "days": 3, "metric": true, "hours": [1, 2], "code": "007",
                           "note": "multi\nline"})"));
}

TEST(ChatOutput, MiniCpmXmlCallsWithCdataValuesTypedByTheToolSchema) {
  const ChatOutput out = parse_every_way(kMiniCpm,
      "<think>\nweather first\n</think>\n\nChecking.\n"
      R"(<function name="get_weather"><param name="city">Paris</param><param name="days">2</param>)"
      R"(<param name="code"><![CDATA[a < b & </param></function> "c"]]></param></function>)"
      "\n<function name='get_weather'><param name='note'><![CDATA[two\nlines]]></param></function>");
  EXPECT_EQ(out.reasoning, "\nweather first\n");
  EXPECT_EQ(out.content, "Checking.\n");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(out.tool_calls[0].arguments),
            json::parse(R"({"city": "Paris", "days": 2, "code": "a < b & </param></function> \"c\""})"));
  EXPECT_EQ(json::parse(out.tool_calls[1].arguments), json::parse(R"({"note": "two\nlines"})"));
  const std::string broken = R"(<function name="get_weather"><param name="city">Paris</function>)";
  const ChatOutput text = parse_every_way(kMiniCpm, broken);
  EXPECT_TRUE(text.tool_calls.empty());
  EXPECT_EQ(text.content, broken);
  const std::string unfinished = R"(<function name="get_weather"><param name="city"><![CDATA[Par)";
  EXPECT_EQ(parse_every_way(kMiniCpm, unfinished).content, unfinished);
}

TEST(ChatOutput, APromptEndingInsideThinkOpensTheReplyAsReasoning) {
  EXPECT_TRUE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_TRUE(prompt_opens_reasoning("<think>a</think> earlier turn <think>\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n"));
}

TEST(ChatOutput, ReasoningOpenedByThePromptEndsAtItsClosingTag) {
  const ChatOutput out = parse_every_way(kQwen35, "weighing options\n</think>\n\nThe answer is 4.", true);
  EXPECT_EQ(out.reasoning, "weighing options\n");
  EXPECT_EQ(out.content, "The answer is 4.");
}

TEST(ChatOutput, LlamaJsonReplyIsACall) {
  const ChatOutput call = parse_every_way(kLlama, R"( {"name": "get_weather", "parameters": {"city": "Oslo"}})");
  ASSERT_EQ(call.tool_calls.size(), 1u);
  EXPECT_EQ(json::parse(call.tool_calls[0].arguments), json::parse(R"({"city": "Oslo"})"));
  EXPECT_EQ(call.content, "");
  const ChatOutput text = parse_every_way(kLlama, "It is sunny {mostly}.");
  EXPECT_TRUE(text.tool_calls.empty());
  EXPECT_EQ(text.content, "It is sunny {mostly}.");
}

TEST(ChatOutput, MalformedOrUnfinishedCallsComeBackAsText) {
  const std::string bad_json = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
  ChatOutput out = parse_every_way(kQwen3, bad_json);
  EXPECT_TRUE(out.tool_calls.empty());
  EXPECT_EQ(out.content, bad_json);
  const std::string unfinished = "Sure.<tool_call>\n{\"name\": \"get_weather\"";
  out = parse_every_way(kQwen3, unfinished);
  EXPECT_TRUE(out.tool_calls.empty());
  EXPECT_EQ(out.content, unfinished);
  const std::string bad_xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>";
  out = parse_every_way(kQwen35, bad_xml);
  EXPECT_TRUE(out.tool_calls.empty());
  EXPECT_EQ(out.content, bad_xml);
  // A reply that is not JSON after all.
  out = parse_every_way(kLlama, "{not json");
  EXPECT_EQ(out.content, "{not json");
}

TEST(ChatOutput, TextThatOnlyLooksLikeAMarkerStaysText) {
  const ChatOutput out = parse_every_way(kQwen3, "a <tool and <think b < c <tool_cal");
  EXPECT_EQ(out.content, "a <tool and <think b < c <tool_cal");
  EXPECT_TRUE(out.tool_calls.empty());
  // Without a tool syntax, a <tool_call> is text.
  const ChatOutput plain = parse_every_way({ToolCallSyntax::None, false}, "<tool_call>{}</tool_call><think>x</think>");
  EXPECT_EQ(plain.content, "<tool_call>{}</tool_call><think>x</think>");
}

TEST(ChatOutput, SyntaxComesFromTheChatTemplate) {
  const ChatOutputSyntax qwen3 = chat_output_syntax(
      "{%- if tools %}...<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>"
      "{%- endif %}{{- '<think>\\n\\n</think>\\n\\n' }}");
  EXPECT_EQ(qwen3.tool_calls, ToolCallSyntax::Hermes);
  EXPECT_TRUE(qwen3.reasoning);
  EXPECT_EQ(chat_output_syntax("<tool_call>\\n<function=example_function_name>\\n<parameter=x>").tool_calls,
            ToolCallSyntax::QwenXml);
  EXPECT_EQ(chat_output_syntax("{{- '<|python_tag|>' }}").tool_calls, ToolCallSyntax::LlamaJson);
  // MiniCPM5's template (openbmb/MiniCPM5-1B) describes its calls in these words.
  EXPECT_EQ(chat_output_syntax("return an XML object within <function ... </function> using:\\n<function "
                               "name=\"function-name\"><param name=\"param-name\">param-value</param></function>")
                .tool_calls,
            ToolCallSyntax::MiniCpmXml);
  const ChatOutputSyntax plain = chat_output_syntax("{% for m in messages %}{{ m.content }}{% endfor %}");
  EXPECT_EQ(plain.tool_calls, ToolCallSyntax::None);
  EXPECT_FALSE(plain.reasoning);
  EXPECT_STREQ(tool_call_syntax_name(ToolCallSyntax::QwenXml), "qwen_xml");
  EXPECT_STREQ(tool_call_syntax_name(ToolCallSyntax::MiniCpmXml), "minicpm_xml");
}

}  // namespace
