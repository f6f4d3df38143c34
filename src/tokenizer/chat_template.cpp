#include "tokenizer/chat_template.h"

#include <utility>
#include <vector>

#include "core/error.h"

namespace kiln {

namespace {

// Client JSON is refused past jinja::kMaxValueDepth before it is copied: nlohmann's copy recurses
// once per level, so this walk keeps its own stack.
void check_json_depth(const nlohmann::ordered_json& json, std::string_view name, const std::string& origin) {
  std::vector<std::pair<const nlohmann::ordered_json*, int>> pending = {{&json, 0}};
  while (!pending.empty()) {
    const auto [value, depth] = pending.back();
    pending.pop_back();
    if (!value->is_structured()) continue;
    if (depth >= jinja::kMaxValueDepth)
      fail("{}: {} nests deeper than {} levels, the limit on a template value", origin, name, jinja::kMaxValueDepth);
    for (const auto& element : *value) pending.emplace_back(&element, depth + 1);
  }
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, std::string origin, std::optional<std::string> bos_token,
                           std::optional<std::string> eos_token)
    : template_(source, std::move(origin)), bos_token_(std::move(bos_token)), eos_token_(std::move(eos_token)) {}

ChatTemplate ChatTemplate::for_tokenizer(const Tokenizer& tokenizer) {
  if (!tokenizer.chat_template())
    fail(
        "{}: the model has no chat template (no chat_template in tokenizer_config.json, chat_template.json or "
        "chat_template.jinja)",
        tokenizer.source().parent_path().string());
  return ChatTemplate(*tokenizer.chat_template(), tokenizer.chat_template_origin(), tokenizer.bos_token(),
                      tokenizer.eos_token());
}

nlohmann::ordered_json ChatTemplate::variables(const nlohmann::ordered_json& messages,
                                               const ChatTemplateOptions& options) const {
  if (!messages.is_array()) fail("{}: messages must be a JSON list", template_.origin());
  check_json_depth(messages, "messages", template_.origin());
  check_json_depth(options.tools, "tools", template_.origin());
  check_json_depth(options.extra, "the extra template variables", template_.origin());
  for (size_t i = 0; i < messages.size(); ++i)
    if (!messages[i].is_object()) fail("{}: messages[{}] must be a JSON object", template_.origin(), i);
  if (!options.tools.is_null() && !options.tools.is_array()) fail("{}: tools must be a JSON list", template_.origin());
  if (!options.extra.is_object()) fail("{}: extra template variables must be a JSON object", template_.origin());
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
  variables["messages"] = messages;
  variables["tools"] = options.tools;
  variables["documents"] = nullptr;
  variables["add_generation_prompt"] = options.add_generation_prompt;
  if (bos_token_) variables["bos_token"] = *bos_token_;
  if (eos_token_) variables["eos_token"] = *eos_token_;
  if (options.enable_thinking) variables["enable_thinking"] = *options.enable_thinking;
  for (const auto& [name, value] : options.extra.items()) variables[name] = value;
  return variables;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options) const {
  return template_.render(variables(messages, options));
}

}  // namespace kiln
