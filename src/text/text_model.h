// kiln as a library for text: a model folder opened once, then prompts in and text out, whole or
// streamed, with the model's tokenizer, end-of-generation ids and chat template. One request at a
// time, on the calling thread (the server batches requests through engine/scheduler.h instead).
//
//   std::unique_ptr<kiln::Backend> cpu = kiln::make_cpu_backend();
//   kiln::TextModel model = kiln::TextModel::open("models/stories260K", *cpu);
//   model.generate("Once upon a time", {}, [](std::string_view text) { std::cout << text; return true; });
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "engine/finish_reason.h"
#include "engine/sampler.h"
#include "engine/serving_sizes.h"
#include "engine/speculative.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln {

struct TextModelOptions {
  std::optional<DType> dtype;                // the weights' dtype once loaded; nothing: as stored
  std::optional<std::string> chat_template;  // a Jinja template replacing the model's own
};

struct TextOptions {
  int64_t max_tokens = 256;
  SamplingParams sampling;         // greedy at temperature 0
  std::vector<std::string> stop;   // the text ends before the first of these strings
  bool ignore_eos = false;         // keep generating past the model's end-of-generation ids
  int64_t prefill_chunk = kDefaultPrefillChunk;  // most prompt tokens prefilled per step (a multiple of 64)
  Speculation speculation;                       // GenerationOptions::speculation
};

struct TextResult {
  std::string text;           // the continuation (without a stop string that ended it)
  FinishReason finish_reason = FinishReason::Length;  // Stop: end of generation, a stop string, or the callback
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};

// Receives the text as it is decoded (whole UTF-8 characters); returns false to stop generating.
using TextCallback = std::function<bool(std::string_view text)>;

class TextModel {
 public:
  // Reads config.json, the weights and tokenizer.json of `folder` onto `backend`, which must outlive
  // the model. Errors name the file and field at fault.
  static TextModel open(const std::filesystem::path& folder, Backend& backend, const TextModelOptions& options = {});
  // A model already built (e.g. split over tensor-parallel ranks), with the tokenizer of `folder`.
  TextModel(std::unique_ptr<Model> model, const std::filesystem::path& folder,
            std::optional<std::string> chat_template = std::nullopt);
  ~TextModel();
  TextModel(TextModel&&) noexcept;
  TextModel& operator=(TextModel&&) noexcept;

  // Continues `prompt` (tokenised with the tokenizer's special tokens, e.g. BOS).
  TextResult generate(std::string_view prompt, const TextOptions& options, const TextCallback& on_text = {});
  // Answers a conversation (messages in OpenAI's shape: [{"role", "content"}, ...]) rendered with the
  // chat template, which adds the assistant's turn. An error when the model has no chat template.
  TextResult chat(const nlohmann::ordered_json& messages, const TextOptions& options,
                  const TextCallback& on_text = {});
  // Continues prompt ids as given.
  TextResult generate_ids(const std::vector<int32_t>& prompt, const TextOptions& options,
                          const TextCallback& on_text = {});

  Model& model() { return *model_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  const ChatTemplate& chat_template();

  std::unique_ptr<Model> model_;
  Tokenizer tokenizer_;
  std::optional<std::string> chat_template_source_;
  // Parsed on the first chat, so that a template kiln cannot parse fails only the chats.
  std::unique_ptr<ChatTemplate> chat_template_;
};

}  // namespace kiln
