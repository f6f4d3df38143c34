// A model's chat template rendered the way transformers' apply_chat_template renders it (with
// tokenize=False): the template sees `messages`, `tools` (none without tools), `documents` (none),
// `add_generation_prompt`, the special tokens bos_token / eos_token, `enable_thinking` when it is
// set, and any extra variables.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "tokenizer/jinja_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln {

struct ChatTemplateOptions {
  bool add_generation_prompt = false;   // transformers' default; generation wants true
  std::optional<bool> enable_thinking;  // Qwen3 / Qwen3.5: false asks for an empty <think> block
  nlohmann::ordered_json tools;         // a list of tool schemas, or null for none
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // more variables; they win over the rest
};

class ChatTemplate {
 public:
  // `origin` names the template in errors; bos_token / eos_token are what the template sees.
  ChatTemplate(std::string_view source, std::string origin, std::optional<std::string> bos_token,
               std::optional<std::string> eos_token);

  // The tokenizer's chat template; an error when the model has none.
  static ChatTemplate for_tokenizer(const Tokenizer& tokenizer);

  // `messages` is a JSON list of {"role", "content", ...} objects.
  std::string render(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options) const;

  // The variables render() gives the template.
  nlohmann::ordered_json variables(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options) const;

 private:
  jinja::Template template_;
  std::optional<std::string> bos_token_, eos_token_;
};

}  // namespace kiln
