#include "tokenizer/decoder.h"

#include "core/error.h"
#include "tokenizer/normalizer.h"

namespace kiln {

namespace {

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";

// The byte a ByteFallback token stands for: exactly "<0x" + two hex digits + ">" (either case).
std::optional<uint8_t> byte_token_value(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  int value = 0;
  for (char c : token.substr(3, 2)) {
    int digit;
    if (c >= '0' && c <= '9')
      digit = c - '0';
    else if (c >= 'a' && c <= 'f')
      digit = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F')
      digit = c - 'A' + 10;
    else
      return std::nullopt;
    value = value * 16 + digit;
  }
  return static_cast<uint8_t>(value);
}

std::string single_character(const nlohmann::json& spec, const char* field, const std::string& where) {
  if (!spec.contains(field) || !spec[field].is_string()) fail("{}: \"{}\" must be a string", where, field);
  const std::string text = spec[field];
  size_t offset = 0;
  if (text.empty() || (unicode::next_code_point(text, offset), offset != text.size()))
    fail("{}: \"{}\" must be one character, got \"{}\"", where, field, text);
  return text;
}

size_t count_field(const nlohmann::json& spec, const char* field, const std::string& where) {
  if (!spec.contains(field) || !spec[field].is_number_unsigned()) fail("{}: \"{}\" must be a count", where, field);
  return spec[field].get<size_t>();
}

// Up to `start` leading and `stop` trailing `content` characters go (decoders/strip.rs).
std::string strip(const std::string& token, const std::string& content, size_t start, size_t stop) {
  size_t begin = 0, end = token.size();
  for (size_t i = 0; i < start && token.compare(begin, content.size(), content) == 0; ++i) begin += content.size();
  for (size_t i = 0;
       i < stop && end >= begin + content.size() && token.compare(end - content.size(), content.size(), content) == 0;
       ++i)
    end -= content.size();
  return token.substr(begin, end - begin);
}

// A token made only of GPT-2 byte characters becomes those bytes; any other token (an added token
// such as "<|im_start|>" that uses other characters) passes as its own UTF-8.
std::string byte_level_decoded(std::string token) {
  std::string bytes;
  size_t offset = 0;
  while (offset < token.size()) {
    const auto byte = unicode::char_to_byte(unicode::next_code_point(token, offset));
    if (!byte) return token;
    bytes.push_back(static_cast<char>(*byte));
  }
  return bytes;
}

}  // namespace

DecoderPipeline DecoderPipeline::from_json(const nlohmann::json& spec, const std::string& where) {
  DecoderPipeline pipeline;
  if (spec.is_null())
    pipeline.has_decoder_ = false;
  else
    pipeline.add(spec, where);
  return pipeline;
}

void DecoderPipeline::add(const nlohmann::json& spec, const std::string& where) {
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string())
    fail("{}: expected an object with a \"type\"", where);
  const std::string type = spec["type"];
  const std::string here = where + " (" + type + ")";
  if (type == "Sequence") {
    if (!spec.contains("decoders") || !spec["decoders"].is_array()) fail("{}: \"decoders\" must be a list", here);
    for (const auto& child : spec["decoders"]) add(child, where);
    return;
  }
  if (fused_) {
    // After Fuse or ByteLevel there is one token, the whole text; only a leading Strip is
    // supported there (what SentencePiece-style decoders use).
    if (type == "Strip" && count_field(spec, "stop", here) == 0 && joined_strip_start_ == 0) {
      joined_strip_content_ = single_character(spec, "content", here);
      joined_strip_start_ = count_field(spec, "start", here);
      return;
    }
    fail("{}: decoder \"{}\" after Fuse or ByteLevel is not supported", where, type);
  }
  Stage stage;
  if (type == "Replace") {
    if (!spec.contains("content") || !spec["content"].is_string()) fail("{}: \"content\" must be a string", here);
    stage.content = spec["content"];
    const nlohmann::json pattern = spec.value("pattern", nlohmann::json());
    if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      stage.literal = pattern["String"];
      if (stage.literal.empty()) fail("{}: an empty String pattern is not supported", here);
    } else {
      stage.pattern = pattern_from_json(pattern, here + " pattern");
    }
  } else if (type == "ByteFallback") {
    stage.kind = Stage::Kind::ByteFallback;
  } else if (type == "Strip") {
    stage.kind = Stage::Kind::Strip;
    stage.content = single_character(spec, "content", here);
    stage.start = count_field(spec, "start", here);
    stage.stop = count_field(spec, "stop", here);
  } else if (type == "Metaspace") {
    stage.kind = Stage::Kind::Metaspace;
    stage.replacement = spec.value("replacement", std::string("\u2581"));
    const std::string scheme = spec.value("prepend_scheme", std::string());
    if (scheme.empty())
      stage.drop_in_first_token = spec.value("add_prefix_space", true);
    else if (scheme == "always" || scheme == "first")
      stage.drop_in_first_token = true;
    else if (scheme == "never")
      stage.drop_in_first_token = false;
    else
      fail("{}: unknown prepend_scheme \"{}\"", here, scheme);
  } else if (type == "ByteLevel") {
    stage.kind = Stage::Kind::ByteLevel;
    fused_ = byte_level_ = true;
  } else if (type == "Fuse") {
    fused_ = true;
    return;
  } else {
    fail(
        "{}: decoder type \"{}\" is not supported (supported: ByteLevel, ByteFallback, Fuse, Replace, Strip, "
        "Metaspace, Sequence)",
        where, type);
  }
  token_stages_.push_back(std::move(stage));
}

std::string DecoderPipeline::token_bytes(std::string_view spelled) const {
  std::string token(spelled);
  for (const Stage& stage : token_stages_) {
    switch (stage.kind) {
      case Stage::Kind::Replace:
        token = stage.pattern ? replace_all(*stage.pattern, token, stage.content)
                              : replace_literal(token, stage.literal, stage.content);
        break;
      case Stage::Kind::ByteFallback:
        if (const auto byte = byte_token_value(token)) token = std::string(1, static_cast<char>(*byte));
        break;
      case Stage::Kind::Strip:
        token = strip(token, stage.content, stage.start, stage.stop);
        break;
      case Stage::Kind::Metaspace:
        token = replace_literal(token, stage.replacement, " ");
        break;
      case Stage::Kind::ByteLevel:
        token = byte_level_decoded(std::move(token));
        break;
    }
  }
  return has_decoder_ ? token : " " + token;
}

DecoderPipeline::Stream::Stream(const DecoderPipeline& pipeline)
    : pipeline_(&pipeline), byte_runs_(pipeline.token_stages_.size()), tokens_seen_(pipeline.token_stages_.size(), 0) {}

void DecoderPipeline::Stream::push(std::string_view token, std::string& out) { feed(0, std::string(token), out); }

void DecoderPipeline::Stream::feed(size_t stage_index, std::string token, std::string& out) {
  const auto& stages = pipeline_->token_stages_;
  if (stage_index == stages.size()) {
    if (pipeline_->byte_level_) {
      std::string text;
      lossy_.push(token, text);
      emit_text(text, out);
    } else {
      if (!pipeline_->has_decoder_ && any_token_joined_) emit_text(" ", out);
      emit_text(token, out);
    }
    any_token_joined_ = true;
    return;
  }
  const Stage& stage = stages[stage_index];
  const size_t index = tokens_seen_[stage_index]++;
  switch (stage.kind) {
    case Stage::Kind::Replace:
      token = stage.pattern ? replace_all(*stage.pattern, token, stage.content)
                            : replace_literal(token, stage.literal, stage.content);
      break;
    case Stage::Kind::ByteFallback:
      if (const auto byte = byte_token_value(token)) {
        byte_runs_[stage_index].push_back(static_cast<char>(*byte));
        return;
      }
      flush(stage_index, out);
      break;
    case Stage::Kind::Strip:
      token = strip(token, stage.content, stage.start, stage.stop);
      break;
    case Stage::Kind::Metaspace:
      // The first token loses every replacement character, later ones turn them into spaces
      // (decoders' Metaspace::decode_chain).
      token = replace_literal(token, stage.replacement,
                              index == 0 && stage.drop_in_first_token ? std::string_view() : std::string_view(" "));
      break;
    case Stage::Kind::ByteLevel:
      token = byte_level_decoded(std::move(token));
      break;
  }
  feed(stage_index + 1, std::move(token), out);
}

void DecoderPipeline::Stream::flush(size_t stage_index, std::string& out) {
  std::string run;
  run.swap(byte_runs_[stage_index]);
  if (run.empty()) return;
  if (unicode::find_invalid_utf8(run) == std::string_view::npos) {
    feed(stage_index + 1, std::move(run), out);
  } else {
    for (size_t i = 0; i < run.size(); ++i) feed(stage_index + 1, std::string(kReplacementCharacter), out);
  }
}

void DecoderPipeline::Stream::emit_text(std::string_view text, std::string& out) {
  if (!past_leading_ && pipeline_->joined_strip_start_ > 0) {
    const std::string& content = pipeline_->joined_strip_content_;
    while (!text.empty() && leading_stripped_ < pipeline_->joined_strip_start_ &&
           text.substr(0, content.size()) == content) {
      text.remove_prefix(content.size());
      ++leading_stripped_;
    }
    if (!text.empty() || leading_stripped_ == pipeline_->joined_strip_start_) past_leading_ = true;
  }
  out.append(text);
}

void DecoderPipeline::Stream::finish(std::string& out) {
  for (size_t stage = 0; stage < pipeline_->token_stages_.size(); ++stage) flush(stage, out);
  if (pipeline_->byte_level_) {
    std::string text;
    lossy_.finish(text);
    emit_text(text, out);
  }
  std::fill(tokens_seen_.begin(), tokens_seen_.end(), 0);
  any_token_joined_ = false;
  leading_stripped_ = 0;
  past_leading_ = false;
}

}  // namespace kiln
