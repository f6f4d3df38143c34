// tokenizer.json "decoder": turns token strings back into text. Supported: ByteLevel, ByteFallback,
// Fuse, Replace, Strip, Metaspace and Sequence of these (and no decoder, which joins tokens with
// spaces), with Hugging Face's results (tokenizers/src/decoders).
//
// Decoding runs as a stream: tokens go in one at a time and text comes out as soon as it can no
// longer change. Held back are a run of <0xXX> byte tokens (a run decodes as a whole: its bytes
// if they are well-formed UTF-8, else one U+FFFD per byte), an incomplete UTF-8 sequence of a
// byte-level model, and characters a later Strip may still remove. One-shot decoding is the same
// stream, so both always agree.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace kiln {

class DecoderPipeline {
 public:
  static DecoderPipeline from_json(const nlohmann::json& spec, const std::string& where);

  // The bytes `token` (spelled as in tokenizer.json) adds to a text it does not start: its per-token
  // stages applied as to any token after the first, a byte-fallback or byte-level token as its raw
  // byte(s), which may be part of a UTF-8 sequence (what constrained decoding matches).
  std::string token_bytes(std::string_view token) const;

  class Stream {
   public:
    explicit Stream(const DecoderPipeline& pipeline);
    // Appends to `out` the text that `token` (spelled as in tokenizer.json) completes.
    void push(std::string_view token, std::string& out);
    // Appends everything still held back; the stream then starts over.
    void finish(std::string& out);

   private:
    void feed(size_t stage, std::string token, std::string& out);
    void flush(size_t stage, std::string& out);
    void emit_text(std::string_view text, std::string& out);

    const DecoderPipeline* pipeline_;
    std::vector<std::string> byte_runs_;  // per stage: ByteFallback bytes waiting for the run's end
    std::vector<size_t> tokens_seen_;     // per stage: tokens that reached it (Metaspace's first token)
    unicode::LossyUtf8Decoder lossy_;
    bool any_token_joined_ = false;
    size_t leading_stripped_ = 0;
    bool past_leading_ = false;
  };

 private:
  struct Stage {
    enum class Kind { Replace, ByteFallback, Strip, Metaspace, ByteLevel } kind = Kind::Replace;
    std::string literal;                   // Replace with a String pattern
    std::shared_ptr<const Regex> pattern;  // Replace with a Regex pattern
    std::string content;                   // Replace: replacement; Strip: the character stripped
    size_t start = 0, stop = 0;            // Strip
    std::string replacement;               // Metaspace
    bool drop_in_first_token = false;      // Metaspace with a prepend scheme
  };
  void add(const nlohmann::json& spec, const std::string& where);

  std::vector<Stage> token_stages_;  // applied to each token
  bool fused_ = false;               // a Fuse or ByteLevel joined the tokens into one text
  bool byte_level_ = false;          // the joined text is bytes to decode as lossy UTF-8
  bool has_decoder_ = true;          // without one, tokens are joined with spaces
  // Strip applied to the joined text: how many leading `joined_strip_content_` characters go.
  std::string joined_strip_content_;
  size_t joined_strip_start_ = 0;
};

}  // namespace kiln
