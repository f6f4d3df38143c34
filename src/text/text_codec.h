// What text generation needs from a tokenizer and chat template: text → prompt ids, generated ids
// → text as it streams, the text of single tokens (logprobs), and the ids that end generation.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/reasoning_budget.h"
#include "text/chat_output.h"

namespace kiln {

struct ChatPromptOptions {
  bool add_generation_prompt = true;
  nlohmann::ordered_json tools;                                               // null, or an array of tool schemas
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();  // e.g. {"enable_thinking": false}
};

// Generated ids in, complete UTF-8 text out (nothing while a character is unfinished).
class TokenTextStream {
 public:
  virtual ~TokenTextStream() = default;
  virtual std::string push(int32_t id) = 0;
  virtual std::string finish() = 0;
};

class TextCodec {
 public:
  virtual ~TextCodec() = default;
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const = 0;
  // Decodes ids generated after `prompt`, skipping special tokens (an end-of-text token shows no
  // text). The text is what decoding prompt + generated ids adds to the prompt's own text (so a
  // leading space is kept where decoding the generated ids alone would strip it).
  virtual std::unique_ptr<TokenTextStream> text_stream(const std::vector<int32_t>& prompt) const = 0;
  // One token on its own, as logprobs report it.
  virtual std::string token_text(int32_t id) const = 0;
  // The text of ids as Hugging Face's decode gives it, special tokens included (/detokenize).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual bool has_chat_template() const = 0;
  // The prompt text of a conversation (messages in OpenAI's shape). A template error is a
  // kiln::Error whose message the client sees.
  virtual std::string render_chat(const nlohmann::ordered_json& messages, const ChatPromptOptions& options) const = 0;
  // How the chat template's model writes reasoning and tool calls (text/chat_output.h).
  virtual ChatOutputSyntax chat_output_syntax() const { return {}; }
  // A cap of `max_tokens` on a reply's reasoning in the chat template's markers, as token ids
  // (engine/reasoning_budget.h), the reply starting inside reasoning where `opened_by_prompt`;
  // nothing where the template writes no reasoning.
  virtual std::optional<ReasoningBudget> reasoning_budget(int64_t max_tokens, bool opened_by_prompt) const {
    return std::nullopt;
  }
  // Ids that end generation (end of text, end of turn).
  virtual std::vector<int32_t> stop_token_ids() const = 0;
  // What each of the model's `rows` token ids adds to the text, as bytes (structured output
  // matches them against its grammar); empty for special tokens and ids without a token.
  virtual std::vector<std::string> token_bytes(int64_t rows) const = 0;
};

}  // namespace kiln
