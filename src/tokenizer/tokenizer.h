// A Hugging Face tokenizer loaded from tokenizer.json (BPE, byte-level or SentencePiece-style with
// byte fallback), with what tokenizer_config.json and generation_config.json say about special
// tokens, the chat template and sampling defaults. Token ids equal those of Hugging Face
// `tokenizers` for the supported pipelines; anything outside them is an error when loading.
//
// A Tokenizer is cheap to copy (it shares its immutable state) and safe to use from many threads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

// What generation_config.json (or, without one, the model's config.json) and tokenizer_config.json
// say generation should default to. Absent fields stay empty.
struct GenerationDefaults {
  std::vector<int32_t> eos_token_ids;  // generation stops at any of these
  std::optional<int32_t> bos_token_id;
  std::optional<int32_t> pad_token_id;
  std::optional<bool> do_sample;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;
  std::optional<int64_t> max_new_tokens;
  std::optional<int64_t> max_length;
};

// generation_config.json at `path`: its token ids and defaults as the file gives them (each field
// type-checked, naming the file); eos_token_ids is the file's own, without the Tokenizer's fallbacks.
GenerationDefaults read_generation_config(const std::filesystem::path& path);

class Tokenizer {
 public:
  // `path` is a directory holding tokenizer.json (a model directory), or a tokenizer.json file;
  // tokenizer_config.json, generation_config.json, config.json, chat_template.jinja and
  // chat_template.json are read from the same directory when present.
  static Tokenizer load(const std::filesystem::path& path);

  // Token ids of UTF-8 text. Added and special tokens written in the text are always recognised;
  // add_special_tokens adds what the tokenizer puts around a sequence (e.g. Llama's BOS).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;

  // The text of ids, as Hugging Face's decode gives it. An id with no token (a model's padding
  // past the vocabulary) gives no text, as Hugging Face's decode skips it.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // One past the largest token id (model vocabulary and added tokens together).
  int32_t vocab_size() const;
  // Fails, naming tokenizer.json and the id, when a token id is at or past `model_vocab_size` (the
  // model's logit rows): such a tokenizer was made for another model. Fewer tokens than rows is
  // fine (models pad their vocabulary).
  void check_fits_model(int64_t model_vocab_size) const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token as tokenizer.json spells it (e.g. "Ġworld", "▁world", "<0x0A>").
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // The bytes a token adds in the middle of a text (DecoderPipeline::token_bytes), for matching
  // generated text byte by byte; empty for a special token or an id without a token.
  std::string token_bytes(int32_t id) const;

  // Special tokens from tokenizer_config.json (and their ids); empty when not set.
  const std::optional<std::string>& bos_token() const;
  const std::optional<std::string>& eos_token() const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  // Ids that end generation: generation_config.json's eos_token_id (one or a list), else
  // config.json's, else the eos_token of tokenizer_config.json.
  const std::vector<int32_t>& eos_ids() const;
  const GenerationDefaults& generation_defaults() const;

  // The model's default chat template (chat_template.jinja, chat_template.json or
  // tokenizer_config.json's chat_template, in that order), if any; with a name, that named
  // template (e.g. "tool_use") when the model lists several.
  const std::optional<std::string>& chat_template() const;
  std::optional<std::string> chat_template(std::string_view name) const;
  // Where the chat template came from, for error messages.
  const std::string& chat_template_origin() const;

  // The tokenizer.json this was loaded from.
  const std::filesystem::path& source() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
  friend class StreamingDecoder;
};

// Turns generated ids into text as they come: push() returns the text that is complete once id is
// known (nothing while a UTF-8 sequence or a run of byte-fallback tokens is unfinished), finish()
// whatever is left. The pieces always concatenate to decode() of all ids.
class StreamingDecoder {
 public:
  StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  ~StreamingDecoder();
  StreamingDecoder(StreamingDecoder&&) noexcept;
  StreamingDecoder& operator=(StreamingDecoder&&) noexcept;

  // Feeds ids whose text the caller already has (the prompt), so that what follows continues it:
  // pushing generated ids then yields decode(prompt + generated) minus decode(prompt). Without it
  // the first generated token counts as the start of the text (SentencePiece decoders drop its
  // leading space).
  void feed_prompt(std::span<const int32_t> ids);
  std::string push(int32_t id);
  std::string finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kiln
