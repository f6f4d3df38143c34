#include "text/text_model.h"

#include "engine/generation.h"
#include "engine/stop_matcher.h"
#include "model/loader.h"

namespace kiln {

TextModel TextModel::open(const std::filesystem::path& folder, Backend& backend, const TextModelOptions& options) {
  LoadOptions load;
  load.dtype = options.dtype;
  return TextModel(load_model(folder, backend, load), folder, options.chat_template);
}

TextModel::TextModel(std::unique_ptr<Model> model, const std::filesystem::path& folder,
                     std::optional<std::string> chat_template)
    : model_(std::move(model)), tokenizer_(Tokenizer::load(folder)), chat_template_source_(std::move(chat_template)) {
  tokenizer_.check_fits_model(model_->config().vocab_size);
}

TextModel::~TextModel() = default;
TextModel::TextModel(TextModel&&) noexcept = default;
TextModel& TextModel::operator=(TextModel&&) noexcept = default;

const ChatTemplate& TextModel::chat_template() {
  if (!chat_template_) {
    if (chat_template_source_)
      chat_template_ = std::make_unique<ChatTemplate>(*chat_template_source_, "the chat template given",
                                                      tokenizer_.bos_token(), tokenizer_.eos_token());
    else
      chat_template_ = std::make_unique<ChatTemplate>(ChatTemplate::for_tokenizer(tokenizer_));
  }
  return *chat_template_;
}

TextResult TextModel::generate(std::string_view prompt, const TextOptions& options, const TextCallback& on_text) {
  return generate_ids(tokenizer_.encode(prompt, true), options, on_text);
}

TextResult TextModel::chat(const nlohmann::ordered_json& messages, const TextOptions& options,
                           const TextCallback& on_text) {
  ChatTemplateOptions template_options;
  template_options.add_generation_prompt = true;
  // The template writes the special tokens (BOS) itself.
  return generate_ids(tokenizer_.encode(chat_template().render(messages, template_options), false), options, on_text);
}

TextResult TextModel::generate_ids(const std::vector<int32_t>& prompt, const TextOptions& options,
                                   const TextCallback& on_text) {
  GenerationOptions generation;
  generation.max_tokens = options.max_tokens;
  generation.sampling = options.sampling;
  generation.sampling.validate();
  generation.prefill_chunk = options.prefill_chunk;
  generation.speculation = options.speculation;
  if (!options.ignore_eos) generation.stop_ids = tokenizer_.eos_ids();

  TextResult result;
  result.prompt_tokens = static_cast<int64_t>(prompt.size());
  // Primed with the whole prompt, the decoder gives what the generated ids add to the prompt's text
  // (a SentencePiece decoder would otherwise drop the first token's leading space).
  StreamingDecoder decoder(tokenizer_, true);
  decoder.feed_prompt(prompt);
  StopMatcher stops(options.stop);
  bool keep_going = true;
  // Nothing more is taken once the callback has said stop.
  const auto emit = [&](const std::string& text) {
    if (text.empty() || !keep_going) return;
    result.text += text;
    if (on_text) keep_going = on_text(text);
  };
  bool stopped = false;
  const GenerationResult generated = kiln::generate(*model_, prompt, generation, [&](const SampledToken& token) {
    const StopMatcher::Output output = stops.push(decoder.push(token.token));
    emit(output.text);
    stopped = output.matched.has_value();
    return !stopped && keep_going;
  });
  if (!stopped) emit(stops.push(decoder.finish()).text + stops.flush());
  result.finish_reason = generated.finish_reason;
  result.completion_tokens = static_cast<int64_t>(generated.tokens.size());
  return result;
}

}  // namespace kiln
