// The chat output parser: reasoning and tool calls split from a reply, whole and streamed at every
// split point, in each syntax (a call's arguments streamed in pieces that join to the whole
// reply's); malformed calls come back as text whole, and end where they broke when streamed.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <random>

#include "text/chat_output.h"
#include "text/json_scanner.h"

using namespace kiln;
using json = nlohmann::ordered_json;

namespace {

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "code": {"type": "string"}}}}}
])");

ChatOutput parse_whole(ChatOutputSyntax syntax, const std::string& text, bool in_reasoning = false) {
  return ChatOutputParser(syntax, kTools, in_reasoning).parse(text);
}

// The reply streamed in pieces whose sizes `next_size` gives, its events joined back. Each call's
// events come in order (its start, pieces of its arguments, its end) and say what the parser's
// output says.
ChatOutput parse_streamed(ChatOutputSyntax syntax, const std::string& text, const std::function<size_t()>& next_size,
                          bool in_reasoning = false) {
  ChatOutputParser parser(syntax, kTools, in_reasoning);
  ChatOutput joined;
  bool call_open = false;
  auto take = [&](const std::vector<ChatOutputEvent>& events) {
    for (const ChatOutputEvent& event : events) {
      switch (event.kind) {
        case ChatOutputEvent::Kind::Content: joined.content += event.text; break;
        case ChatOutputEvent::Kind::Reasoning: joined.reasoning += event.text; break;
        case ChatOutputEvent::Kind::ToolCallStart:
          EXPECT_FALSE(call_open);
          EXPECT_EQ(event.call_index, joined.tool_calls.size());
          joined.tool_calls.push_back({event.text, "", false});
          call_open = true;
          break;
        case ChatOutputEvent::Kind::ToolCallArguments:
          EXPECT_TRUE(call_open);
          EXPECT_FALSE(event.text.empty());
          EXPECT_EQ(event.call_index + 1, joined.tool_calls.size());
          joined.tool_calls.back().arguments += event.text;
          break;
        case ChatOutputEvent::Kind::ToolCallEnd:
          EXPECT_TRUE(call_open);
          EXPECT_EQ(event.call_index + 1, joined.tool_calls.size());
          joined.tool_calls.back().complete = parser.output().tool_calls[event.call_index].complete;
          call_open = false;
          break;
      }
    }
  };
  for (size_t at = 0; at < text.size();) {
    const size_t size = next_size();
    take(parser.push(text.substr(at, size)));
    at += size;
  }
  take(parser.finish());
  EXPECT_FALSE(call_open);
  EXPECT_EQ(joined.content, parser.output().content);
  EXPECT_EQ(joined.reasoning, parser.output().reasoning);
  EXPECT_EQ(joined.tool_calls.size(), parser.output().tool_calls.size());
  return joined;
}

ChatOutput parse_streamed(ChatOutputSyntax syntax, const std::string& text, size_t step, bool in_reasoning = false) {
  return parse_streamed(syntax, text, [step] { return step; }, in_reasoning);
}

void expect_same(const ChatOutput& a, const ChatOutput& b, const std::string& what) {
  EXPECT_EQ(a.content, b.content) << what;
  EXPECT_EQ(a.reasoning, b.reasoning) << what;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << what;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << what;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << what;
    EXPECT_EQ(a.tool_calls[i].complete, b.tool_calls[i].complete) << what;
  }
}

// Whole, and streamed one byte, three bytes and seven bytes at a time and in random cuts: the same
// split, and each call's arguments streamed are the whole reply's.
ChatOutput parse_every_way(ChatOutputSyntax syntax, const std::string& text, bool in_reasoning = false) {
  const ChatOutput whole = parse_whole(syntax, text, in_reasoning);
  for (size_t step : {1, 3, 7}) expect_same(whole, parse_streamed(syntax, text, step, in_reasoning), "step " + std::to_string(step));
  std::mt19937 random(static_cast<uint32_t>(text.size()));
  for (int cut = 0; cut < 20; ++cut)
    expect_same(whole, parse_streamed(syntax, text, [&] { return size_t{1} + random() % 16; }, in_reasoning),
                "random cut " + std::to_string(cut));
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

// A malformed call: as text when the reply is parsed whole; streamed, a call whose start went out
// (its name was read) and that ends where its text stopped being one, the rest of it dropped.
void expect_malformed(ChatOutputSyntax syntax, const std::string& text, const std::string& streamed_content,
                      const std::string& streamed_arguments) {
  SCOPED_TRACE(text);
  const ChatOutput whole = parse_whole(syntax, text);
  EXPECT_TRUE(whole.tool_calls.empty());
  EXPECT_EQ(whole.content, text);
  std::mt19937 random(7);
  for (int cut = 0; cut < 10; ++cut) {
    const ChatOutput streamed = parse_streamed(syntax, text, [&] { return size_t{1} + random() % 8; });
    EXPECT_EQ(streamed.content, streamed_content);
    ASSERT_EQ(streamed.tool_calls.size(), 1u);
    EXPECT_EQ(streamed.tool_calls[0].name, "get_weather");
    EXPECT_EQ(streamed.tool_calls[0].arguments, streamed_arguments);
    EXPECT_FALSE(streamed.tool_calls[0].complete);
  }
}

TEST(ChatOutput, MalformedOrUnfinishedCallsComeBackAsTextWholeAndEndWhereTheyBrokeStreamed) {
  expect_malformed(kQwen3, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>", "",
                   "{\"city\":");
  // Cut short: what was read of the arguments.
  expect_malformed(kQwen3, "Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa", "Sure.",
                   "{\"city\":\"Pa");
  // Text after a broken call's closing marker is read again as usual.
  expect_malformed(kQwen3, "<tool_call>{\"name\": \"get_weather\", \"arguments\": 5}</tool_call> ok", "ok", "");
  expect_malformed(kQwen35, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
                   "", "{");
  expect_malformed(kQwen35,
                   "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\nstray</function>\n</tool_call>",
                   "", "{\"days\":2");
  expect_malformed(kMiniCpm, R"(<function name="get_weather"><param name="city">Paris</function>)", "", "{");
  expect_malformed(kMiniCpm, R"(<function name="get_weather"><param name="city"><![CDATA[Par)", "", "{");
  expect_malformed(kLlama, R"({"name": "get_weather", "parameters": {"city": "Oslo"}} and more)", "",
                   R"({"city":"Oslo"})");
  // Broken before its name was read: text either way.
  for (const std::string text : {"Sure.<tool_call>\n{\"name\": \"get_wea", "<tool_call>\n[1]</tool_call>"}) {
    const ChatOutput out = parse_every_way(kQwen3, text);
    EXPECT_TRUE(out.tool_calls.empty());
    EXPECT_EQ(out.content, text);
  }
  const ChatOutput not_json = parse_every_way(kLlama, "{not json");
  EXPECT_EQ(not_json.content, "{not json");
}

TEST(ChatOutput, ACallStartsOnceItsNameIsReadAndItsArgumentsStreamAsTheyArrive) {
  ChatOutputParser hermes(kQwen3, kTools);
  std::vector<ChatOutputEvent> events = hermes.push("<tool_call>\n{\"name\": \"get_weather\"");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, ChatOutputEvent::Kind::ToolCallStart);
  EXPECT_EQ(events[0].text, "get_weather");
  events = hermes.push(", \"arguments\": {\"city\": \"Par");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, ChatOutputEvent::Kind::ToolCallArguments);
  EXPECT_EQ(events[0].text, "{\"city\":\"Par");
  // The end of the arguments, then what may be the closing marker, held back until it is.
  events = hermes.push("is\"}}\n</tool_");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].text, "is\"}");
  events = hermes.push("call>");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, ChatOutputEvent::Kind::ToolCallEnd);
  EXPECT_TRUE(hermes.output().tool_calls[0].complete);

  // Qwen XML: "{" with the name, then each parameter once it closes.
  ChatOutputParser xml(kQwen35, kTools);
  events = xml.push("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=city>\nRo");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].text, "get_weather");
  EXPECT_EQ(events[1].text, "{\"days\":3");
  events = xml.push("me\n</parameter>\n</function>\n</tool_call>");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].text, ",\"city\":\"Rome\"}");
  EXPECT_EQ(events[1].kind, ChatOutputEvent::Kind::ToolCallEnd);
}

TEST(ChatOutput, ArgumentsAreTheModelsJsonWithoutLayoutInEverySyntax) {
  // Escapes and numbers as the model wrote them; arguments quoted as a string, and a call without
  // any, still give an object.
  const ChatOutput hermes = parse_every_way(kQwen3,
      "<tool_call>\n{\"arguments\": {\"city\" : \"S\\u00e3o \\\"P\\\"\", \"hours\": [ 1.50, -2e3 ], \"x\": {\"y\": null}},\n"
      " \"name\": \"get_weather\"}\n</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"parameters\": "
      "\"{ \\\"city\\\": \\\"Rome\\\" }\"}</tool_call><tool_call>{\"name\":\"get_weather\"}</tool_call>");
  ASSERT_EQ(hermes.tool_calls.size(), 3u);
  EXPECT_EQ(hermes.tool_calls[0].arguments, R"({"city":"S\u00e3o \"P\"","hours":[1.50,-2e3],"x":{"y":null}})");
  EXPECT_EQ(hermes.tool_calls[1].arguments, R"({"city":"Rome"})");
  EXPECT_EQ(hermes.tool_calls[2].arguments, "{}");
  for (const ToolCall& call : hermes.tool_calls) EXPECT_TRUE(call.complete);
  // A closing marker cut short by the end of the reply leaves a whole call whole.
  const ChatOutput cut = parse_every_way(kQwen3, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_");
  ASSERT_EQ(cut.tool_calls.size(), 1u);
  EXPECT_TRUE(cut.tool_calls[0].complete);
}

// A random reply in `syntax`: text, reasoning and well-formed calls with random arguments.
std::string random_reply(ChatOutputSyntax syntax, std::mt19937& random) {
  const auto pick = [&](const std::vector<std::string>& options) { return options[random() % options.size()]; };
  const std::vector<std::string> objects = {"{}", R"({"city": "Paris", "days": 2})", R"({ "hours" : [1, 2.5e3, {"a": null}] })",
                                            R"({"note": "a \"b\" \u00e9"})"};
  const std::vector<std::pair<std::string, std::string>> parameters = {
      {"days", "3"}, {"city", "Rome"}, {"hours", "[1, 2]"}, {"code", "a < b"}, {"note", "two\nlines"}};
  if (syntax.tool_calls == ToolCallSyntax::LlamaJson)
    return random() % 4 == 0 ? std::string("It is sunny.")
                             : R"({"name": "get_weather", "parameters": )" + pick(objects) + "}";
  std::string reply;
  for (int segment = 1 + static_cast<int>(random() % 4); segment > 0; --segment) {
    switch (random() % 4) {
      case 0: reply += pick({"Sure. ", "a < b ", "\n", "<think>hmm</think>\n"}); break;
      default:
        if (syntax.tool_calls == ToolCallSyntax::Hermes) {
          const std::string arguments = random() % 5 == 0 ? "\"{\\\"city\\\": \\\"Rome\\\"}\"" : pick(objects);
          reply += random() % 3 == 0 ? R"(<tool_call>{"arguments": )" + arguments + R"(, "name": "get_weather"})"
                                     : "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + arguments + "}\n";
          reply += "</tool_call>\n";
          break;
        }
        const bool qwen = syntax.tool_calls == ToolCallSyntax::QwenXml;
        reply += qwen ? "<tool_call>\n<function=get_weather>\n" : R"(<function name="get_weather">)";
        for (int count = static_cast<int>(random() % 3); count > 0; --count) {
          const auto& [key, value] = parameters[random() % parameters.size()];
          reply += qwen ? "<parameter=" + key + ">\n" + value + "\n</parameter>\n"
                        : R"(<param name=")" + key + R"(">)" + (random() % 2 ? "<![CDATA[" + value + "]]>" : value) + "</param>";
        }
        reply += qwen ? "</function>\n</tool_call>" : "</function>";
    }
  }
  return reply;
}

// Random replies, half of them then mutated (a byte lost, a stray byte, the end cut off): parsing
// never throws; whole, every call is complete with an object for arguments; streamed in random
// cuts, the complete calls are the whole reply's calls and every other call's arguments are a
// prefix of JSON text.
TEST(ChatOutput, RandomRepliesKeepTheContracts) {
  std::mt19937 random(41);
  for (const ChatOutputSyntax syntax : {kQwen3, kLlama, kQwen35, kMiniCpm}) {
    size_t whole_calls = 0, broken_calls = 0;
    for (int round = 0; round < 300; ++round) {
      std::string text = random_reply(syntax, random);
      if (random() % 2) {
        const size_t at = random() % text.size();
        switch (random() % 3) {
          case 0: text.erase(at, 1); break;
          case 1: text.insert(at, 1, "{}[]\",:<>/\\ a1"[random() % 16]); break;
          default: text.resize(at); break;
        }
      }
      SCOPED_TRACE(text);
      const ChatOutput whole = parse_whole(syntax, text);
      whole_calls += whole.tool_calls.size();
      for (const ToolCall& call : whole.tool_calls) {
        EXPECT_TRUE(call.complete);
        EXPECT_TRUE(json::parse(call.arguments).is_object());
      }
      for (int cut = 0; cut < 3; ++cut) {
        const ChatOutput streamed = parse_streamed(syntax, text, [&] { return size_t{1} + random() % 12; });
        std::vector<ToolCall> complete;
        for (const ToolCall& call : streamed.tool_calls) {
          if (call.complete) {
            complete.push_back(call);
            continue;
          }
          ++broken_calls;
          JsonScanner prefix;
          for (char byte : call.arguments) ASSERT_NE(prefix.take(byte), JsonScanner::Byte::Refused) << call.arguments;
        }
        ASSERT_EQ(complete.size(), whole.tool_calls.size());
        for (size_t i = 0; i < complete.size(); ++i) {
          EXPECT_EQ(complete[i].name, whole.tool_calls[i].name);
          EXPECT_EQ(complete[i].arguments, whole.tool_calls[i].arguments);
        }
      }
    }
    // The replies hold whole calls and broken ones alike.
    EXPECT_GT(whole_calls, 100u) << tool_call_syntax_name(syntax.tool_calls);
    EXPECT_GT(broken_calls, 20u) << tool_call_syntax_name(syntax.tool_calls);
  }
}

TEST(ChatOutput, TextThatOnlyLooksLikeAMarkerStaysText) {
  const ChatOutput out = parse_every_way(kQwen3, "a <tool and <think b < c <tool_cal");
  EXPECT_EQ(out.content, "a <tool and <think b < c <tool_cal");
  EXPECT_TRUE(out.tool_calls.empty());
  // Without a tool syntax, a <tool_call> is text.
  const ChatOutput plain = parse_every_way({ToolCallSyntax::None, false}, "<tool_call>{}</tool_call><think>x</think>");
  EXPECT_EQ(plain.content, "<tool_call>{}</tool_call><think>x</think>");
}

TEST(ChatOutput, ReasoningCloseTextIsTheTemplatesWithItsLineBreaks) {
  // Qwen3's and MiniCPM5's templates: a reasoning block in the history, and an empty one where
  // thinking is off.
  EXPECT_EQ(reasoning_close_text("{%- if '</think>' in message.content %}{{- '<|im_start|>' + message.role + "
                                 "'\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content }}"
                                 "{%- if enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"),
            "\n</think>\n\n");
  // Line breaks in the template's own text; an empty block alone; a close without any.
  EXPECT_EQ(reasoning_close_text("<think>\n{{ r }}\n</think>\n\n{{ c }}"), "\n</think>\n\n");
  EXPECT_EQ(reasoning_close_text("{{- '<think>\\n\\n</think>\\n\\n' }}"), "</think>\n\n");
  EXPECT_EQ(reasoning_close_text("{%- if not enable_thinking %}{{- '</think>' -}}{% endif %}"), "</think>");
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
