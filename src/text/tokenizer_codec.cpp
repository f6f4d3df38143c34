#include "text/tokenizer_codec.h"

#include <algorithm>

#include "core/error.h"

namespace kiln {

namespace {

// How many prompt tokens prime the decoder of generated ids: enough for any decoder's context
// (a leading-space strip, an unfinished character), as incremental detokenisers use a few.
constexpr size_t kDecoderContextTokens = 6;

class StreamingText final : public TokenTextStream {
 public:
  StreamingText(const Tokenizer& tokenizer, const std::vector<int32_t>& prompt) : decoder_(tokenizer, true) {
    const size_t context = std::min(prompt.size(), kDecoderContextTokens);
    for (size_t i = prompt.size() - context; i < prompt.size(); ++i) decoder_.push(prompt[i]);
  }
  std::string push(int32_t id) override { return decoder_.push(id); }
  std::string finish() override { return decoder_.finish(); }

 private:
  StreamingDecoder decoder_;
};

}  // namespace

TokenizerCodec::TokenizerCodec(const std::filesystem::path& model_dir, std::optional<std::string> chat_template)
    : tokenizer_(Tokenizer::load(model_dir)) {
  if (chat_template)
    chat_template_ = std::make_unique<ChatTemplate>(*chat_template, "--chat-template", tokenizer_.bos_token(),
                                                    tokenizer_.eos_token());
  else if (tokenizer_.chat_template())
    chat_template_ = std::make_unique<ChatTemplate>(ChatTemplate::for_tokenizer(tokenizer_));
  if (chat_template || tokenizer_.chat_template())
    output_syntax_ = kiln::chat_output_syntax(chat_template ? *chat_template : *tokenizer_.chat_template());
  if (output_syntax_.reasoning) {
    const std::string& source = chat_template ? *chat_template : *tokenizer_.chat_template();
    ReasoningBudget markers;
    markers.open = encode_within_text("<think>");
    markers.close = encode_within_text("</think>");
    markers.forced = encode_within_text(reasoning_close_text(source));
    // Where the tokens of the line breaks merge with the marker's, the marker alone is forced.
    if (std::search(markers.forced.begin(), markers.forced.end(), markers.close.begin(), markers.close.end()) ==
        markers.forced.end())
      markers.forced = markers.close;
    reasoning_markers_ = std::move(markers);
  }
  const std::vector<int32_t> anchor = tokenizer_.encode("a", false);
  if (!anchor.empty() && !tokenizer_.is_special(anchor.back())) {
    anchor_ = anchor.back();
    anchor_text_ = tokenizer_.decode(std::vector<int32_t>{*anchor_}, true);
  }
}

std::vector<int32_t> TokenizerCodec::encode(std::string_view text, bool add_special_tokens) const {
  return tokenizer_.encode(text, add_special_tokens);
}

std::vector<int32_t> TokenizerCodec::encode_within_text(std::string_view text) const {
  // Encoded after a line break whose own tokens are then dropped: a tokenizer that marks the
  // start of a whole text (SentencePiece's prepended "▁") does not mark a piece of one.
  const std::vector<int32_t> line_break = tokenizer_.encode("\n", false);
  std::string after_break = "\n";
  after_break += text;
  std::vector<int32_t> ids = tokenizer_.encode(after_break, false);
  if (ids.size() > line_break.size() && std::equal(line_break.begin(), line_break.end(), ids.begin())) {
    ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(line_break.size()));
    return ids;
  }
  return tokenizer_.encode(text, false);
}

std::optional<ReasoningBudget> TokenizerCodec::reasoning_budget(int64_t max_tokens, bool opened_by_prompt) const {
  if (!reasoning_markers_) return std::nullopt;
  ReasoningBudget budget = *reasoning_markers_;
  budget.max_tokens = max_tokens;
  budget.opened_by_prompt = opened_by_prompt;
  return budget;
}

std::unique_ptr<TokenTextStream> TokenizerCodec::text_stream(const std::vector<int32_t>& prompt) const {
  return std::make_unique<StreamingText>(tokenizer_, prompt);
}

std::string TokenizerCodec::decode(std::span<const int32_t> ids) const { return tokenizer_.decode(ids, false); }

std::string TokenizerCodec::token_text(int32_t id) const {
  if (anchor_ && !tokenizer_.is_special(id)) {
    const std::string both = tokenizer_.decode(std::vector<int32_t>{*anchor_, id}, false);
    // Concatenative decoders give the anchor's text first; the rest is the token's own text.
    if (both.compare(0, anchor_text_.size(), anchor_text_) == 0) return both.substr(anchor_text_.size());
  }
  return tokenizer_.decode(std::vector<int32_t>{id}, false);
}

std::string TokenizerCodec::render_chat(const nlohmann::ordered_json& messages,
                                        const ChatPromptOptions& options) const {
  if (!chat_template_) fail("{}: the model has no chat template", tokenizer_.source().string());
  ChatTemplateOptions template_options;
  template_options.add_generation_prompt = options.add_generation_prompt;
  template_options.tools = options.tools;
  template_options.extra = options.template_kwargs;
  // vLLM passes enable_thinking inside chat_template_kwargs; the template takes it as its switch.
  if (const auto found = options.template_kwargs.find("enable_thinking");
      found != options.template_kwargs.end() && found->is_boolean()) {
    template_options.enable_thinking = found->get<bool>();
    template_options.extra.erase("enable_thinking");
  }
  return chat_template_->render(messages, template_options);
}

std::vector<std::string> TokenizerCodec::token_bytes(int64_t rows) const {
  std::vector<std::string> bytes(static_cast<size_t>(rows));
  for (int64_t id = 0; id < rows; ++id) bytes[id] = tokenizer_.token_bytes(static_cast<int32_t>(id));
  return bytes;
}

}  // namespace kiln
