#include "tokenizer/tokenizer.h"

#include <deque>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe.h"
#include "tokenizer/decoder.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/unicode.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

struct Tokenizer::Impl {
  Impl(fs::path source, Normalizer normalizer, PreTokenizer pre_tokenizer, BpeModel model, DecoderPipeline decoder)
      : source(std::move(source)),
        normalizer(std::move(normalizer)),
        pre_tokenizer(std::move(pre_tokenizer)),
        model(std::move(model)),
        decoder(std::move(decoder)) {}

  fs::path source;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  BpeModel model;
  DecoderPipeline decoder;
  std::vector<AddedToken> added_tokens;
  std::unique_ptr<AddedTokenMatcher> raw_matcher;             // tokens with normalized = false
  std::unique_ptr<AddedTokenMatcher> normalized_matcher;      // tokens with normalized = true
  std::unordered_map<int32_t, std::string> added_token_text;  // id -> what decoding shows
  StringMap<int32_t> added_token_ids;                         // content -> id
  std::vector<bool> special;                                  // per id
  int32_t vocab_size = 0;
  std::vector<int32_t> prefix_ids, suffix_ids;  // what add_special_tokens puts around a sequence

  std::optional<std::string> bos_token, eos_token;
  std::optional<int32_t> bos_id, eos_id;
  GenerationDefaults generation;
  std::optional<std::string> chat_template;
  std::map<std::string, std::string, std::less<>> named_chat_templates;
  std::string chat_template_origin;

  std::optional<int32_t> token_to_id(std::string_view token) const {
    if (const auto found = added_token_ids.find(token); found != added_token_ids.end()) return found->second;
    return model.token_to_id(token);
  }

  // The token an id decodes from, or null for an id with none.
  const std::string* token_text(int32_t id) const {
    if (const auto found = added_token_text.find(id); found != added_token_text.end()) return &found->second;
    return model.id_to_token(id);
  }

  void encode_words(std::string_view text, bool at_input_start, std::vector<int32_t>& ids, WordCache* cache) const {
    thread_local std::vector<std::string_view> words;
    thread_local std::deque<std::string> storage;
    words.clear();
    storage.clear();
    pre_tokenizer.split(text, at_input_start, words, storage);
    for (std::string_view word : words) model.encode_word(word, ids, cache);
  }

  // A span of the input between added tokens: normalize it, find the added tokens that match
  // normalized text, and encode what lies between them.
  void encode_span(std::string_view span, bool at_input_start, std::vector<int32_t>& ids, WordCache* cache) const {
    const std::string normalized = normalizer.empty() ? std::string() : normalizer.apply(span);
    const std::string_view text = normalizer.empty() ? span : std::string_view(normalized);
    if (normalized_matcher->empty()) {
      encode_words(text, at_input_start, ids, cache);
      return;
    }
    std::vector<AddedTokenMatcher::Match> matches;
    normalized_matcher->find(text, matches);
    size_t cursor = 0;
    for (const auto& match : matches) {
      if (match.begin > cursor)
        encode_words(text.substr(cursor, match.begin - cursor), at_input_start && cursor == 0, ids, cache);
      ids.push_back(match.id);
      cursor = match.end;
    }
    if (cursor < text.size()) encode_words(text.substr(cursor), at_input_start && cursor == 0, ids, cache);
  }
};

namespace {

json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  try {
    return json::parse(buffer.str());
  } catch (const json::exception& error) {
    fail("{}: not valid JSON: {}", path.string(), error.what());
  }
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// A token id written in a JSON file, checked before it is narrowed (narrowing first would report an
// id of 4000000000 as -294967296) and against kMaxTokenIds (bpe.h).
int32_t checked_token_id(const json& value, const std::string& where) {
  const bool in_range = value.is_number_unsigned()  ? value.get<uint64_t>() < kMaxTokenIds
                        : value.is_number_integer() ? value.get<int64_t>() >= 0 && value.get<int64_t>() < kMaxTokenIds
                                                    : false;
  if (!in_range) fail("{}: token id {} is not an integer from 0 to {}", where, value.dump(), kMaxTokenIds - 1);
  return value.get<int32_t>();
}

bool flag(const json& object, const char* field, const std::string& where) {
  if (!object.contains(field) || object[field].is_null()) return false;
  if (!object[field].is_boolean()) fail("{}: \"{}\" must be true or false", where, field);
  return object[field].get<bool>();
}

// A special-token field of tokenizer_config.json: a string, {"content": string, ...} or null.
std::optional<std::string> special_token_field(const json& config, const char* field, const std::string& where) {
  if (!config.contains(field) || config[field].is_null()) return std::nullopt;
  const json& value = config[field];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  fail("{}: \"{}\" must be a string, an object with \"content\", or null", where, field);
}

// What add_special_tokens puts before and after a sequence (the "single" template).
void add_post_processor(const json& spec, const std::string& where, std::vector<int32_t>& prefix,
                        std::vector<int32_t>& suffix) {
  if (spec.is_null()) return;
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string())
    fail("{}: expected an object with a \"type\"", where);
  const std::string type = spec["type"];
  const std::string here = where + " (" + type + ")";
  if (type == "Sequence") {
    if (!spec.contains("processors") || !spec["processors"].is_array()) fail("{}: \"processors\" must be a list", here);
    for (const auto& child : spec["processors"]) add_post_processor(child, where, prefix, suffix);
  } else if (type == "ByteLevel") {
    // Adjusts offsets only; ids are unchanged.
  } else if (type == "TemplateProcessing") {
    if (!spec.contains("single") || !spec["single"].is_array()) fail("{}: \"single\" must be a list", here);
    const json special_tokens = spec.value("special_tokens", json::object());
    std::vector<int32_t> before, after;
    bool seen_sequence = false;
    for (const auto& piece : spec["single"]) {
      if (piece.contains("Sequence")) {
        if (seen_sequence) fail("{}: \"single\" names the sequence twice", here);
        seen_sequence = true;
      } else if (piece.contains("SpecialToken") && piece["SpecialToken"].contains("id")) {
        const std::string name = piece["SpecialToken"]["id"];
        if (!special_tokens.contains(name) || !special_tokens[name].contains("ids") ||
            !special_tokens[name]["ids"].is_array())
          fail("{}: special token \"{}\" is not in \"special_tokens\" with its ids", here, name);
        std::vector<int32_t> ids;
        for (const auto& id : special_tokens[name]["ids"])
          ids.push_back(checked_token_id(id, fmt::format("{}: special token \"{}\"", here, name)));
        (seen_sequence ? after : before).insert((seen_sequence ? after : before).end(), ids.begin(), ids.end());
      } else {
        fail("{}: unknown template piece {}", here, piece.dump());
      }
    }
    if (!seen_sequence) fail("{}: \"single\" does not contain the sequence", here);
    prefix.insert(prefix.begin(), before.begin(), before.end());
    suffix.insert(suffix.end(), after.begin(), after.end());
  } else {
    fail("{}: post-processor type \"{}\" is not supported (supported: TemplateProcessing, ByteLevel, Sequence)", where,
         type);
  }
}

std::optional<int64_t> integer_field(const json& object, const char* field, const std::string& where) {
  if (!object.contains(field) || object[field].is_null()) return std::nullopt;
  if (!object[field].is_number_integer()) fail("{}: \"{}\" must be an integer", where, field);
  return object[field].get<int64_t>();
}

std::optional<double> number_field(const json& object, const char* field, const std::string& where) {
  if (!object.contains(field) || object[field].is_null()) return std::nullopt;
  if (!object[field].is_number()) fail("{}: \"{}\" must be a number", where, field);
  return object[field].get<double>();
}

// eos_token_id as one id or a list of ids.
std::vector<int32_t> id_list_field(const json& object, const char* field, const std::string& where) {
  if (!object.contains(field) || object[field].is_null()) return {};
  const json& value = object[field];
  const std::string here = fmt::format("{}: \"{}\"", where, field);
  if (value.is_number_integer()) return {checked_token_id(value, here)};
  if (value.is_array()) {
    std::vector<int32_t> ids;
    for (const auto& id : value) {
      if (!id.is_number_integer()) fail("{}: \"{}\" must be an id or a list of ids", where, field);
      ids.push_back(checked_token_id(id, here));
    }
    return ids;
  }
  fail("{}: \"{}\" must be an id or a list of ids", where, field);
}

// added_tokens, the ids they are matched to, and which ids are special.
void load_added_tokens(Tokenizer::Impl& impl, const json& spec, const std::string& where) {
  const json added = spec.value("added_tokens", json::array());
  if (!added.is_array()) fail("{}: \"added_tokens\" must be a list", where);
  std::vector<std::string> raw_patterns, normalized_patterns;
  // Hugging Face ignores the ids written here: a token in the model's vocabulary keeps its id, any
  // other takes the next one after the vocabulary, in list order (added_vocabulary.rs add_tokens).
  // A file whose ids disagree with that is refused rather than read two ways.
  int32_t next_id = impl.model.vocab_count();
  for (size_t i = 0; i < added.size(); ++i) {
    const json& entry = added[i];
    const std::string here = fmt::format("{}: added_tokens[{}]", where, i);
    if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_number_integer() || !entry.contains("content") ||
        !entry["content"].is_string())
      fail("{}: needs an integer \"id\" and a string \"content\"", here);
    AddedToken token;
    token.id = checked_token_id(entry["id"], here);
    token.content = entry["content"];
    token.special = flag(entry, "special", here);
    token.lstrip = flag(entry, "lstrip", here);
    token.rstrip = flag(entry, "rstrip", here);
    token.normalized = flag(entry, "normalized", here);
    if (flag(entry, "single_word", here)) fail("{}: single_word added tokens are not supported", here);
    int32_t assigned;
    if (const auto model_id = impl.model.token_to_id(token.content))
      assigned = *model_id;
    else if (const auto found = impl.added_token_ids.find(token.content); found != impl.added_token_ids.end())
      assigned = found->second;
    else
      assigned = next_id++;
    if (token.id != assigned)
      fail(
          "{}: \"{}\" has id {}, but Hugging Face tokenizers gives it id {} (tokens outside the vocabulary are "
          "numbered in order after it)",
          here, token.content, token.id, assigned);
    // A normalized token is matched, and decoded, as its normalized content
    // (tokenizer/added_vocabulary.rs normalized_cache).
    const std::string normalized_content =
        token.normalized && !impl.normalizer.empty() ? impl.normalizer.apply(token.content) : token.content;
    impl.added_token_text[token.id] = normalized_content;
    impl.added_token_ids[token.content] = token.id;
    raw_patterns.push_back(token.normalized ? std::string() : token.content);
    normalized_patterns.push_back(token.normalized ? normalized_content : std::string());
    impl.added_tokens.push_back(std::move(token));
  }
  impl.raw_matcher = std::make_unique<AddedTokenMatcher>(impl.added_tokens, raw_patterns);
  impl.normalized_matcher = std::make_unique<AddedTokenMatcher>(impl.added_tokens, normalized_patterns);

  impl.vocab_size = impl.model.id_limit();
  for (const auto& token : impl.added_tokens) impl.vocab_size = std::max(impl.vocab_size, token.id + 1);
  // Hugging Face skips a token in decoding when the text it decodes from is the content of a
  // special added token (tokenizer/mod.rs decode): so also a model token spelled like one, but not
  // a special token marked `normalized` whose normalized text differs.
  impl.special.assign(impl.vocab_size, false);
  std::unordered_set<std::string> special_contents;
  for (const auto& token : impl.added_tokens)
    if (token.special) special_contents.insert(token.content);
  for (const auto& token : impl.added_tokens)
    impl.special[token.id] = special_contents.count(impl.added_token_text.at(token.id)) > 0;
  for (const auto& content : special_contents)
    if (const auto model_id = impl.model.token_to_id(content); model_id && !impl.added_token_text.count(*model_id))
      impl.special[*model_id] = true;
}

// tokenizer_config.json: special tokens, the chat template, and for Llama-style tokenizer classes
// the add_bos_token / add_eos_token flags, which transformers turns into the post-processor
// (LlamaTokenizerFast.update_post_processor).
void load_tokenizer_config(Tokenizer::Impl& impl, const fs::path& directory) {
  if (const fs::path config_path = directory / "tokenizer_config.json"; fs::exists(config_path)) {
    const json config = read_json(config_path);
    const std::string here = config_path.string();
    impl.bos_token = special_token_field(config, "bos_token", here);
    impl.eos_token = special_token_field(config, "eos_token", here);
    if (impl.bos_token) impl.bos_id = impl.token_to_id(*impl.bos_token);
    if (impl.eos_token) impl.eos_id = impl.token_to_id(*impl.eos_token);
    const std::string tokenizer_class = config.value("tokenizer_class", std::string());
    static const std::vector<std::string> kFlagDrivenClasses = {"LlamaTokenizer",     "LlamaTokenizerFast",
                                                                "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
                                                                "GemmaTokenizer",     "GemmaTokenizerFast"};
    const bool flag_driven =
        std::find(kFlagDrivenClasses.begin(), kFlagDrivenClasses.end(), tokenizer_class) != kFlagDrivenClasses.end();
    if (flag_driven && (config.contains("add_bos_token") || config.contains("add_eos_token"))) {
      impl.prefix_ids.clear();
      impl.suffix_ids.clear();
      if (flag(config, "add_bos_token", here)) {
        if (!impl.bos_id) fail("{}: add_bos_token is true but bos_token has no id", here);
        impl.prefix_ids.push_back(*impl.bos_id);
      }
      if (flag(config, "add_eos_token", here)) {
        if (!impl.eos_id) fail("{}: add_eos_token is true but eos_token has no id", here);
        impl.suffix_ids.push_back(*impl.eos_id);
      }
    }
    if (config.contains("chat_template") && !config["chat_template"].is_null()) {
      const json& chat = config["chat_template"];
      if (chat.is_string()) {
        impl.chat_template = chat.get<std::string>();
      } else if (chat.is_array()) {
        for (const auto& named : chat) {
          if (!named.is_object() || !named.contains("name") || !named["name"].is_string() ||
              !named.contains("template") || !named["template"].is_string())
            fail("{}: chat_template entries must be {{\"name\": ..., \"template\": ...}}", here);
          impl.named_chat_templates[named["name"].get<std::string>()] = named["template"].get<std::string>();
        }
        if (const auto found = impl.named_chat_templates.find("default"); found != impl.named_chat_templates.end())
          impl.chat_template = found->second;
      } else {
        fail("{}: chat_template must be a string or a list of named templates", here);
      }
      impl.chat_template_origin = here + " chat_template";
    }
  }
}

// chat_template.json and chat_template.jinja, which win over tokenizer_config.json's template.
void load_chat_template_files(Tokenizer::Impl& impl, const fs::path& directory) {
  if (const fs::path json_template = directory / "chat_template.json"; fs::exists(json_template)) {
    const json chat = read_json(json_template);
    if (!chat.is_object() || !chat.contains("chat_template") || !chat["chat_template"].is_string())
      fail("{}: expected {{\"chat_template\": string}}", json_template.string());
    impl.chat_template = chat["chat_template"].get<std::string>();
    impl.chat_template_origin = json_template.string();
  }
  if (const fs::path jinja_template = directory / "chat_template.jinja"; fs::exists(jinja_template)) {
    impl.chat_template = read_text(jinja_template);
    impl.chat_template_origin = jinja_template.string();
  }
}

}  // namespace

GenerationDefaults read_generation_config(const fs::path& path) {
  GenerationDefaults generation;
  const json config = read_json(path);
  const std::string here = path.string();
  generation.eos_token_ids = id_list_field(config, "eos_token_id", here);
  if (config.contains("bos_token_id") && !config["bos_token_id"].is_null())
    generation.bos_token_id = checked_token_id(config["bos_token_id"], here + ": \"bos_token_id\"");
  if (config.contains("pad_token_id") && !config["pad_token_id"].is_null())
    generation.pad_token_id = checked_token_id(config["pad_token_id"], here + ": \"pad_token_id\"");
  if (config.contains("do_sample") && !config["do_sample"].is_null())
    generation.do_sample = flag(config, "do_sample", here);
  generation.temperature = number_field(config, "temperature", here);
  generation.top_p = number_field(config, "top_p", here);
  generation.top_k = integer_field(config, "top_k", here);
  generation.min_p = number_field(config, "min_p", here);
  generation.repetition_penalty = number_field(config, "repetition_penalty", here);
  generation.max_new_tokens = integer_field(config, "max_new_tokens", here);
  generation.max_length = integer_field(config, "max_length", here);
  return generation;
}

namespace {

// generation_config.json, with config.json's eos_token_id (else the eos_token) when it has none.
void load_generation_defaults(Tokenizer::Impl& impl, const fs::path& directory) {
  GenerationDefaults& generation = impl.generation;
  if (const fs::path generation_path = directory / "generation_config.json"; fs::exists(generation_path))
    generation = read_generation_config(generation_path);
  if (generation.eos_token_ids.empty()) {
    if (const fs::path config_path = directory / "config.json"; fs::exists(config_path)) {
      const json config = read_json(config_path);
      const json& text_config = config.contains("text_config") ? config["text_config"] : config;
      generation.eos_token_ids = id_list_field(text_config, "eos_token_id", config_path.string());
      if (generation.eos_token_ids.empty())
        generation.eos_token_ids = id_list_field(config, "eos_token_id", config_path.string());
    }
  }
  if (generation.eos_token_ids.empty() && impl.eos_id) generation.eos_token_ids = {*impl.eos_id};
  for (int32_t id : generation.eos_token_ids)
    if (id < 0 || id >= impl.vocab_size)
      fail("{}: eos token id {} is outside the vocabulary ({} ids)", directory.string(), id, impl.vocab_size);
}

}  // namespace

Tokenizer Tokenizer::load(const fs::path& path) {
  const fs::path file = fs::is_directory(path) ? path / "tokenizer.json" : path;
  if (!fs::exists(file)) fail("{}: no tokenizer.json there", path.string());
  const fs::path directory = file.parent_path();
  const json spec = read_json(file);
  const std::string where = file.string();
  if (!spec.is_object()) fail("{}: expected a JSON object", where);

  PreTokenizer pre_tokenizer = PreTokenizer::from_json(spec.value("pre_tokenizer", json()), where + ": pre_tokenizer");
  const bool byte_level = pre_tokenizer.byte_level();
  auto impl = std::make_shared<Impl>(
      file, Normalizer::from_json(spec.value("normalizer", json()), where + ": normalizer"), std::move(pre_tokenizer),
      BpeModel::from_json(spec.value("model", json()), byte_level, where + ": model"),
      DecoderPipeline::from_json(spec.value("decoder", json()), where + ": decoder"));

  load_added_tokens(*impl, spec, where);
  add_post_processor(spec.value("post_processor", json()), where + ": post_processor", impl->prefix_ids,
                     impl->suffix_ids);

  load_tokenizer_config(*impl, directory);
  load_chat_template_files(*impl, directory);
  load_generation_defaults(*impl, directory);
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& impl = *impl_;
  if (const size_t invalid = unicode::find_invalid_utf8(text); invalid != std::string_view::npos)
    fail("text to encode is not valid UTF-8 (byte {})", invalid);
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = impl.prefix_ids;
  const BpeModel::CacheLease lease(impl.model);
  std::vector<AddedTokenMatcher::Match> matches;
  impl.raw_matcher->find(text, matches);
  size_t cursor = 0;
  for (const auto& match : matches) {
    if (match.begin > cursor)
      impl.encode_span(text.substr(cursor, match.begin - cursor), cursor == 0, ids, lease.cache());
    ids.push_back(match.id);
    cursor = match.end;
  }
  if (cursor < text.size()) impl.encode_span(text.substr(cursor), cursor == 0, ids, lease.cache());
  if (add_special_tokens) ids.insert(ids.end(), impl.suffix_ids.begin(), impl.suffix_ids.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  StreamingDecoder stream(*this, skip_special_tokens);
  std::string text;
  for (int32_t id : ids) text += stream.push(id);
  text += stream.finish();
  return text;
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

void Tokenizer::check_fits_model(int64_t model_vocab_size) const {
  for (int32_t id = static_cast<int32_t>(std::max<int64_t>(model_vocab_size, 0)); id < impl_->vocab_size; ++id)
    if (const std::string* token = impl_->token_text(id))
      fail(
          "{}: token id {} (\"{}\") is not below the model's vocab_size {}: the model has no logits for it, so this "
          "tokenizer does not belong to the model",
          impl_->source.string(), id, *token, model_vocab_size);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const { return impl_->token_to_id(token); }

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size) return std::nullopt;
  if (const auto found = impl_->added_token_text.find(id); found != impl_->added_token_text.end()) return found->second;
  if (const std::string* token = impl_->model.id_to_token(id)) return *token;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const { return id >= 0 && id < impl_->vocab_size && impl_->special[id]; }

std::string Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size || impl_->special[id]) return "";
  const std::string* token = impl_->token_text(id);
  return token ? impl_->decoder.token_bytes(*token) : "";
}

const std::optional<std::string>& Tokenizer::bos_token() const { return impl_->bos_token; }
const std::optional<std::string>& Tokenizer::eos_token() const { return impl_->eos_token; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos_id; }
const std::vector<int32_t>& Tokenizer::eos_ids() const { return impl_->generation.eos_token_ids; }
const GenerationDefaults& Tokenizer::generation_defaults() const { return impl_->generation; }
const std::optional<std::string>& Tokenizer::chat_template() const { return impl_->chat_template; }
const std::string& Tokenizer::chat_template_origin() const { return impl_->chat_template_origin; }
const fs::path& Tokenizer::source() const { return impl_->source; }

std::optional<std::string> Tokenizer::chat_template(std::string_view name) const {
  if (const auto found = impl_->named_chat_templates.find(name); found != impl_->named_chat_templates.end())
    return found->second;
  return std::nullopt;
}

struct StreamingDecoder::State {
  std::shared_ptr<const Tokenizer::Impl> impl;
  DecoderPipeline::Stream stream;
  bool skip_special_tokens;
};

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : state_(std::make_unique<State>(
          State{tokenizer.impl_, DecoderPipeline::Stream(tokenizer.impl_->decoder), skip_special_tokens})) {}
StreamingDecoder::~StreamingDecoder() = default;
StreamingDecoder::StreamingDecoder(StreamingDecoder&&) noexcept = default;
StreamingDecoder& StreamingDecoder::operator=(StreamingDecoder&&) noexcept = default;

void StreamingDecoder::feed_prompt(std::span<const int32_t> ids) {
  for (int32_t id : ids) push(id);
}

std::string StreamingDecoder::push(int32_t id) {
  std::string text;
  const Tokenizer::Impl& impl = *state_->impl;
  // An id without a token decodes to nothing, as Hugging Face's decode skips ids it does not know:
  // models pad their logit rows past the tokenizer (Qwen3: 151,936 rows, 151,669 tokens), so a
  // sampled id may have no text.
  const std::string* token = impl.token_text(id);
  if (!token || (state_->skip_special_tokens && impl.special[id])) return text;
  state_->stream.push(*token, text);
  return text;
}

std::string StreamingDecoder::finish() {
  std::string text;
  state_->stream.finish(text);
  return text;
}

}  // namespace kiln
