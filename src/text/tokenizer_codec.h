// The TextCodec bound to kiln's tokenizer (tokenizer/): a model directory's
// tokenizer.json, its special tokens and end-of-generation ids, and its chat template (or one
// given in place of it, e.g. for a model that ships none).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "text/text_codec.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln {

class TokenizerCodec final : public TextCodec {
 public:
  // `chat_template` replaces the model's own template when given.
  TokenizerCodec(const std::filesystem::path& model_dir, std::optional<std::string> chat_template);

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override;
  std::unique_ptr<TokenTextStream> text_stream(const std::vector<int32_t>& prompt) const override;
  std::string token_text(int32_t id) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  bool has_chat_template() const override { return chat_template_ != nullptr; }
  std::string render_chat(const nlohmann::ordered_json& messages, const ChatPromptOptions& options) const override;
  ChatOutputSyntax chat_output_syntax() const override { return output_syntax_; }
  std::optional<ReasoningBudget> reasoning_budget(int64_t max_tokens, bool opened_by_prompt) const override;
  std::vector<int32_t> stop_token_ids() const override { return tokenizer_.eos_ids(); }
  std::vector<std::string> token_bytes(int64_t rows) const override;

  const Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  // `text` as the model writes it within a reply (no special tokens).
  std::vector<int32_t> encode_within_text(std::string_view text) const;

  Tokenizer tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
  ChatOutputSyntax output_syntax_;
  // The reasoning markers' ids, where the template writes reasoning (max_tokens unset).
  std::optional<ReasoningBudget> reasoning_markers_;
  // A plain token whose text is decoded in front of a token shown alone, so that decoders which
  // strip a leading space at the start of a text (SentencePiece's) keep the token's own space.
  std::optional<int32_t> anchor_;
  std::string anchor_text_;
};

}  // namespace kiln
