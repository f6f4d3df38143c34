// Reasoning and tool calls in the OpenAI and Anthropic answers: a Qwen3-style reply (<think>, text,
// two Hermes calls) as a whole body and as a stream cut at every few bytes (each call's name first,
// then its arguments in pieces), and a call cut short by the length limit: text whole, a call as far
// as it came when streamed.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/anthropic_api.h"
#include "server/openai_api.h"

using namespace kiln;
using namespace kiln::server;

namespace {

class NoCodec final : public TextCodec {
 public:
  std::vector<int32_t> encode(std::string_view, bool) const override { return {}; }
  std::unique_ptr<TokenTextStream> text_stream(const std::vector<int32_t>&) const override { return nullptr; }
  std::string token_text(int32_t) const override { return ""; }
  std::string decode(std::span<const int32_t>) const override { return ""; }
  bool has_chat_template() const override { return true; }
  std::string render_chat(const nlohmann::ordered_json&, const ChatPromptOptions&) const override { return ""; }
  std::vector<int32_t> stop_token_ids() const override { return {}; }
  std::vector<std::string> token_bytes(int64_t) const override { return {}; }
};

const json kTools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");

const std::string kReply =
    "<think>\nweather asked\n</think>\n\nChecking.\n<tool_call>\n"
    R"({"name": "get_weather", "arguments": {"city": "Paris"}})"
    "\n</tool_call>\n<tool_call>\n"
    R"({"name": "get_weather", "arguments": {"city": "Oslo"}})"
    "\n</tool_call>";

ChatOutputParser qwen3_parser() { return ChatOutputParser({ToolCallSyntax::Hermes, true}, kTools); }

WholeGeneration whole_of(const std::string& text, FinishReason reason = FinishReason::Stop) {
  WholeGeneration whole;
  whole.text = text;
  whole.last.finished = true;
  whole.last.finish_reason = reason;
  return whole;
}

// The reply as deltas of `step` bytes, the last one finished.
std::vector<TextDelta> deltas_of(const std::string& text, size_t step, FinishReason reason = FinishReason::Stop) {
  std::vector<TextDelta> deltas;
  for (size_t at = 0; at < text.size(); at += step) {
    deltas.emplace_back();
    deltas.back().text = text.substr(at, step);
  }
  deltas.emplace_back();
  deltas.back().finished = true;
  deltas.back().finish_reason = reason;
  return deltas;
}

// The JSON payloads of an event stream, with their event names ("" for OpenAI's).
std::vector<std::pair<std::string, json>> payloads(const std::vector<std::string>& writes) {
  std::vector<std::pair<std::string, json>> out;
  for (const std::string& write : writes) {
    size_t at = 0;
    std::string name;
    while (at < write.size()) {
      const size_t end = write.find('\n', at);
      const std::string line = write.substr(at, end - at);
      at = end + 1;
      if (line.starts_with("event: ")) name = line.substr(7);
      if (line.starts_with("data: ") && line != "data: [DONE]") {
        out.emplace_back(name, json::parse(line.substr(6)));
        name.clear();
      }
    }
  }
  return out;
}

TEST(ChatResponse, OpenAiWholeSplitsReasoningContentAndToolCalls) {
  NoCodec codec;
  ChatCompletionRequest request;
  ChatCompletionResponse response(request, "m", codec, qwen3_parser());
  const json body = response.whole(std::vector{whole_of(kReply)}, {});
  const json& choice = body["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["reasoning_content"], "\nweather asked\n");
  EXPECT_EQ(choice["message"]["content"], "Checking.\n");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 2u);
  const json& call = choice["message"]["tool_calls"][1];
  EXPECT_TRUE(call["id"].get<std::string>().starts_with("call_"));
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()), json::parse(R"({"city": "Oslo"})"));
}

TEST(ChatResponse, OpenAiStreamCarriesTheSameSplitAtAnyCut) {
  NoCodec codec;
  ChatCompletionRequest request;
  for (size_t step : {1, 5, 64}) {
    SCOPED_TRACE(step);
    ChatCompletionResponse response(request, "m", codec, qwen3_parser());
    std::vector<std::string> writes = response.stream_start({});
    for (const TextDelta& delta : deltas_of(kReply, step))
      for (std::string& write : response.stream_delta(0, delta, {})) writes.push_back(std::move(write));
    for (std::string& write : response.stream_end({})) writes.push_back(std::move(write));
    std::string reasoning, content, finish;
    std::vector<json> calls;
    for (const auto& [name, chunk] : payloads(writes)) {
      const json& choice = chunk["choices"][0];
      const json& delta = choice["delta"];
      if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
      if (delta.contains("content")) content += delta["content"].get<std::string>();
      if (delta.contains("tool_calls")) {
        ASSERT_EQ(delta["tool_calls"].size(), 1u);
        const json& call = delta["tool_calls"][0];
        const size_t index = call["index"];
        if (index == calls.size()) {
          // A call's first delta: its index, id, type and name, with empty arguments.
          EXPECT_EQ(call.size(), 4u) << call;
          EXPECT_EQ(call["type"], "function");
          EXPECT_EQ(call["function"]["arguments"], "");
          calls.push_back(call);
        } else {
          // Then pieces of its arguments under its index alone.
          ASSERT_EQ(index + 1, calls.size());
          EXPECT_EQ(call, (json{{"index", index}, {"function", {{"arguments", call["function"]["arguments"]}}}}));
          calls.back()["function"]["arguments"] =
              calls.back()["function"]["arguments"].get<std::string>() + call["function"]["arguments"].get<std::string>();
        }
      }
      if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
    }
    EXPECT_EQ(reasoning, "\nweather asked\n");
    EXPECT_EQ(content, "Checking.\n");
    ASSERT_EQ(calls.size(), 2u);
    EXPECT_EQ(calls[1]["function"]["name"], "get_weather");
    EXPECT_NE(calls[0]["id"], calls[1]["id"]);
    EXPECT_EQ(calls[0]["function"]["arguments"], R"({"city":"Paris"})");
    EXPECT_EQ(calls[1]["function"]["arguments"], R"({"city":"Oslo"})");
    EXPECT_EQ(finish, "tool_calls");
    EXPECT_EQ(writes.back(), "data: [DONE]\n\n");
  }
}

TEST(ChatResponse, ACallCutByTheLengthLimitIsText) {
  NoCodec codec;
  ChatCompletionRequest request;
  ChatCompletionResponse response(request, "m", codec, qwen3_parser());
  const std::string cut = "Sure.\n<tool_call>\n{\"name\": \"get_wea";
  const json body = response.whole(std::vector{whole_of(cut, FinishReason::Length)}, {});
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["choices"][0]["message"]["content"], cut);
  EXPECT_FALSE(body["choices"][0]["message"].contains("tool_calls"));
  MessagesResponse messages("m", qwen3_parser());
  const json message = messages.whole(std::vector{whole_of(cut, FinishReason::Length)}, {});
  EXPECT_EQ(message["stop_reason"], "max_tokens");
  ASSERT_EQ(message["content"].size(), 1u);
  EXPECT_EQ(message["content"][0]["text"], cut);
}

// A call cut short after its name: whole, text with finish_reason "length"; streamed, the call as
// far as it came, its finish_reason "length" too (OpenAI's own answer to a call the limit cuts).
TEST(ChatResponse, ACallCutAfterItsStartStreamedEndsWithTheLengthLimit) {
  NoCodec codec;
  ChatCompletionRequest request;
  const std::string cut = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa";
  ChatCompletionResponse whole(request, "m", codec, qwen3_parser());
  const json body = whole.whole(std::vector{whole_of(cut, FinishReason::Length)}, {});
  EXPECT_EQ(body["choices"][0]["message"]["content"], cut);
  ChatCompletionResponse response(request, "m", codec, qwen3_parser());
  std::vector<std::string> writes;
  for (const TextDelta& delta : deltas_of(cut, 4, FinishReason::Length))
    for (std::string& write : response.stream_delta(0, delta, {})) writes.push_back(std::move(write));
  std::string arguments, finish;
  for (const auto& [name, chunk] : payloads(writes)) {
    const json& choice = chunk["choices"][0];
    if (choice["delta"].contains("tool_calls")) arguments += choice["delta"]["tool_calls"][0]["function"]["arguments"];
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
  }
  EXPECT_EQ(arguments, R"({"city":"Pa)");
  EXPECT_EQ(finish, "length");

  // A call that breaks after its start: its block closes, and the message does not end in tool use.
  MessagesResponse messages("m", qwen3_parser());
  writes.clear();
  const std::string broken = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ]}\n</tool_call>";
  for (const TextDelta& delta : deltas_of(broken, 3))
    for (std::string& write : messages.stream_delta(0, delta, {})) writes.push_back(std::move(write));
  for (std::string& write : messages.stream_end({})) writes.push_back(std::move(write));
  std::string partial_json, stop_reason;
  int starts = 0, stops = 0;
  for (const auto& [name, event] : payloads(writes)) {
    starts += name == "content_block_start";
    stops += name == "content_block_stop";
    if (name == "content_block_delta") partial_json += event["delta"]["partial_json"].get<std::string>();
    if (name == "message_delta") stop_reason = event["delta"]["stop_reason"];
  }
  EXPECT_EQ(starts, 1);
  EXPECT_EQ(stops, 1);
  EXPECT_EQ(partial_json, R"({"city":)");
  EXPECT_EQ(stop_reason, "end_turn");
}

TEST(ChatResponse, AnthropicWholeHasThinkingTextAndToolUseBlocks) {
  MessagesResponse response("m", qwen3_parser());
  const json body = response.whole(std::vector{whole_of(kReply)}, {});
  EXPECT_EQ(body["stop_reason"], "tool_use");
  const json& content = body["content"];
  ASSERT_EQ(content.size(), 4u);
  EXPECT_EQ(content[0]["type"], "thinking");
  EXPECT_EQ(content[0]["thinking"], "\nweather asked\n");
  EXPECT_EQ(content[1]["type"], "text");
  EXPECT_EQ(content[1]["text"], "Checking.\n");
  EXPECT_EQ(content[2]["type"], "tool_use");
  EXPECT_TRUE(content[2]["id"].get<std::string>().starts_with("toolu_"));
  EXPECT_EQ(content[3]["input"], json::parse(R"({"city": "Oslo"})"));
}

TEST(ChatResponse, AnthropicStreamOpensEachBlockInTurn) {
  for (size_t step : {1, 7}) {
    SCOPED_TRACE(step);
    MessagesResponse response("m", qwen3_parser());
    std::vector<std::string> writes = response.stream_start({});
    for (const TextDelta& delta : deltas_of(kReply, step))
      for (std::string& write : response.stream_delta(0, delta, {})) writes.push_back(std::move(write));
    for (std::string& write : response.stream_end({})) writes.push_back(std::move(write));
    std::vector<std::string> starts;
    std::string thinking, text, stop_reason;
    std::vector<std::string> inputs;
    int64_t open = -1;
    for (const auto& [name, event] : payloads(writes)) {
      EXPECT_EQ(name, event["type"]);
      if (name == "content_block_start") {
        EXPECT_EQ(open, -1) << "a block opened before the previous one closed";
        open = event["index"];
        EXPECT_EQ(open, static_cast<int64_t>(starts.size()));
        starts.push_back(event["content_block"]["type"]);
        if (starts.back() == "tool_use") {
          EXPECT_EQ(event["content_block"]["input"], json::object());
          EXPECT_EQ(event["content_block"]["name"], "get_weather");
          inputs.emplace_back();
        }
      }
      if (name == "content_block_delta") {
        EXPECT_EQ(event["index"], open);
        const json& delta = event["delta"];
        if (delta["type"] == "thinking_delta") thinking += delta["thinking"].get<std::string>();
        if (delta["type"] == "text_delta") text += delta["text"].get<std::string>();
        if (delta["type"] == "input_json_delta") inputs.back() += delta["partial_json"].get<std::string>();
      }
      if (name == "content_block_stop") {
        EXPECT_EQ(event["index"], open);
        open = -1;
      }
      if (name == "message_delta") stop_reason = event["delta"]["stop_reason"];
    }
    EXPECT_EQ(starts, (std::vector<std::string>{"thinking", "text", "tool_use", "tool_use"}));
    EXPECT_EQ(thinking, "\nweather asked\n");
    EXPECT_EQ(text, "Checking.\n");
    EXPECT_EQ(inputs, (std::vector<std::string>{R"({"city":"Paris"})", R"({"city":"Oslo"})"}));
    EXPECT_EQ(stop_reason, "tool_use");
    const auto all = payloads(writes);
    EXPECT_EQ(all[0].first, "message_start");
    EXPECT_EQ(all[1].first, "content_block_start");
    EXPECT_EQ(all.back().first, "message_stop");
  }
}

TEST(ChatResponse, WithoutToolsOrThinkingTheReplyIsPlainContent) {
  NoCodec codec;
  ChatCompletionRequest request;
  ChatCompletionResponse response(request, "m", codec, ChatOutputParser({}, json()));
  const json body = response.whole(std::vector{whole_of(kReply)}, {});
  EXPECT_EQ(body["choices"][0]["message"]["content"], kReply);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(body["choices"][0]["message"].contains("reasoning_content"));
}

}  // namespace
