// The structured-output engine (engine/grammar/): JSON schemas compiled to grammars accept and
// reject the texts they should, token masks equal a brute-force check of every token, and random
// walks through the masks always produce JSON that satisfies the schema.
#include <random>

#include <gtest/gtest.h>

#include "engine/grammar/json_schema.h"
#include "engine/grammar/token_mask.h"
#include "json_schema_validator.h"
#include "test_support.h"

namespace {

using json = nlohmann::ordered_json;
using namespace kiln::grammar;

std::shared_ptr<const TokenVocabulary> byte_vocabulary() {
  std::vector<std::string> bytes;
  for (int byte = 0; byte < 256; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
  return std::make_shared<TokenVocabulary>(std::move(bytes));
}

// Single bytes and multi-byte pieces that cross JSON's structure, as BPE vocabularies have them;
// id 0 is a special token (no bytes).
std::shared_ptr<const TokenVocabulary> json_vocabulary() {
  std::vector<std::string> bytes = {""};
  for (int byte = 0x20; byte < 0x7F; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
  for (const char* piece : {"{\"", "\"}", "\":", "\",", "\",\"", "true", "false", "null", "12", "0.", "e+", "ab",
                            "\"a\":", "},{", "\"]", "]}", "\xC3\xA9", "\xC3", "\xA9", "\\u00", "\"x\"", ":\"", ",\"",
                            "1,", "1}", "\"},{\"", "\":\"", "\"\"", "\"}]", "00", "-0", "2024-", "-12T", ":00",
                            "Z\"", "abcdef", "\\n", "\"b\":[", "[]", "{}", "[{\"", "\t", "\n"})
    bytes.push_back(piece);
  return std::make_shared<TokenVocabulary>(std::move(bytes));
}

std::shared_ptr<const CompiledGrammar> compile(const json& schema, std::shared_ptr<const TokenVocabulary> vocabulary) {
  return std::make_shared<CompiledGrammar>(json_schema_grammar(schema), std::move(vocabulary));
}

bool matches(const std::shared_ptr<const CompiledGrammar>& grammar, const std::string& text) {
  GrammarMatcher matcher(grammar);
  return matcher.accept_bytes(text) && matcher.can_end();
}

const json kPerson = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 3},
    "ok": {"type": ["boolean", "null"]}
  },
  "required": ["name", "age"],
  "additionalProperties": false
})");

TEST(JsonSchemaGrammar, AcceptsWhatTheSchemaAllowsAndNothingElse) {
  const auto vocabulary = byte_vocabulary();
  const auto person = compile(kPerson, vocabulary);
  EXPECT_TRUE(matches(person, R"({"name":"Al","age":3})"));
  EXPECT_TRUE(matches(person, R"({"name":"\u00e9\n","age":-30,"tags":["a",3],"ok":null})"));
  EXPECT_TRUE(matches(person, "{\"name\":\"\xC3\xA9t\xC3\xA9\",\"age\":0,\"ok\":true}"));
  EXPECT_FALSE(matches(person, R"({"age":3,"name":"Al"})"));  // properties in schema order
  EXPECT_FALSE(matches(person, R"({"name":"Al"})"));          // required age
  EXPECT_FALSE(matches(person, R"({"name":"","age":3})"));    // minLength
  EXPECT_FALSE(matches(person, R"({"name":"123456789","age":3})"));
  EXPECT_FALSE(matches(person, R"({"name":"Al","age":03})"));
  EXPECT_FALSE(matches(person, R"({"name":"Al","age":3,"tags":[]})"));
  EXPECT_FALSE(matches(person, R"({"name":"Al","age":3,"tags":["a","a","a","a"]})"));
  EXPECT_FALSE(matches(person, R"({"name":"Al","age":3,"x":1})"));
  EXPECT_FALSE(matches(person, R"({"name": "Al","age":3})"));  // no whitespace
  EXPECT_FALSE(matches(person, "{\"name\":\"\xC3\",\"age\":3}"));  // broken UTF-8
  EXPECT_FALSE(matches(person, "{\"name\":\"\x01\",\"age\":3}"));  // control character

  const auto numbers = compile(json::parse(R"({"type":"array","items":{"type":"number"}})"), vocabulary);
  EXPECT_TRUE(matches(numbers, "[0,-1.5,2e10,3.25E-2,100]"));
  EXPECT_TRUE(matches(numbers, "[]"));
  EXPECT_FALSE(matches(numbers, "[1.]"));
  EXPECT_FALSE(matches(numbers, "[.5]"));
  EXPECT_FALSE(matches(numbers, "[1,]"));

  const auto tree = compile(json::parse(R"({
    "$defs": {"node": {"type": "object", "properties": {
      "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
      "required": ["value"]}},
    "$ref": "#/$defs/node"})"),
                            vocabulary);
  EXPECT_TRUE(matches(tree, R"({"value":1,"children":[{"value":2},{"value":3,"children":[{"value":4}]}]})"));
  EXPECT_FALSE(matches(tree, R"({"value":1,"children":[{"children":[]}]})"));

  const auto any_object = std::make_shared<CompiledGrammar>(json_object_grammar(), vocabulary);
  EXPECT_TRUE(matches(any_object, R"({"a":[1,{"b":null}],"c":"d","e":{}})"));
  EXPECT_TRUE(matches(any_object, "{}"));
  EXPECT_FALSE(matches(any_object, "[]"));
  EXPECT_FALSE(matches(any_object, R"({"a":1,})"));

  const auto extra = compile(json::parse(R"({"additionalProperties":{"type":"string"}})"), vocabulary);
  EXPECT_TRUE(matches(extra, R"({"a":"y","b":"x","c":""})"));
  EXPECT_TRUE(matches(extra, R"({})"));
  EXPECT_FALSE(matches(extra, R"({"a":"y","b":2})"));

  const auto formats = compile(json::parse(R"({"type":"array","items":{"anyOf":[
      {"type":"string","format":"date-time"},{"type":"string","format":"uuid"}]}})"),
                               vocabulary);
  EXPECT_FALSE(matches(formats, R"(["2024-02-29T23:59:60Z"])"));
  EXPECT_TRUE(matches(formats, R"(["2024-02-29T23:59:59.5+01:00","123e4567-e89b-12d3-a456-426614174000"])"));
  EXPECT_FALSE(matches(formats, R"(["2024-13-01T00:00:00Z"])"));
}

TEST(JsonSchemaGrammar, AnUnsupportedKeywordIsNamedWithItsPlace) {
  const auto error_of = [](const char* schema) {
    try {
      json_schema_grammar(json::parse(schema));
    } catch (const kiln::Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of(R"({"type":"object","properties":{"n":{"type":"number","minimum":0}}})"),
            "unsupported JSON schema keyword \"minimum\" at /properties/n");
  EXPECT_EQ(error_of(R"({"type":"string","pattern":"a+"})"), "unsupported JSON schema keyword \"pattern\" at /");
  EXPECT_EQ(error_of(R"({"properties":{"a":{}},"additionalProperties":true})"),
            "unsupported JSON schema keyword \"additionalProperties\" other than false beside \"properties\" at /");
  EXPECT_EQ(error_of(R"({"type":"string","format":"email"})"),
            "unsupported JSON schema format \"email\" at / (supported: date, time, date-time, uuid)");
  EXPECT_EQ(error_of(R"({"$ref":"#/$defs/missing"})"),
            "JSON schema $ref \"#/$defs/missing\" at / does not name \"#\" or an entry of $defs or definitions");
  EXPECT_EQ(error_of(R"({"type":"thing"})"),
            "JSON schema \"type\" at / is \"thing\"; expected object, array, string, number, integer, boolean or null");
  EXPECT_EQ(error_of(R"({"type":"string","maxLength":100000})"),
            "JSON schema keyword \"maxLength\" at / is 100000; at most 1000 is supported");
  EXPECT_EQ(error_of(R"({"type":"string","maxLength":1000})"),
            "the JSON schema is too large: its grammar has 51013 positions, at most 20000 are supported (counted "
            "repetitions such as maxLength make one rule per count)");
  json chain = {{"$ref", "#/$defs/d0"}, {"$defs", json::object()}};
  for (int i = 0; i < 100; ++i) chain["$defs"]["d" + std::to_string(i)] = {{"$ref", "#/$defs/d" + std::to_string(i + 1)}};
  chain["$defs"]["d100"] = {{"type", "null"}};
  EXPECT_EQ(error_of(chain.dump().c_str()), "the JSON schema nests deeper than 64 at /$defs/d63");
}

TEST(Grammar, LeftRecursionIsRefused) {
  Grammar grammar;
  const int32_t list = grammar.add_rule("list");
  const int32_t maybe = grammar.add_rule("maybe", {{}, literal("x")});
  grammar.add_alternative(list, {Symbol::reference(maybe), Symbol::reference(list), Symbol::byte_set(ByteSet::of(','))});
  grammar.add_alternative(list, literal("x"));
  grammar.set_root(list);
  EXPECT_THROW(
      {
        try {
          grammar.check();
        } catch (const kiln::Error& error) {
          EXPECT_STREQ(error.what(), "grammar rule list is left-recursive");
          throw;
        }
      },
      kiln::Error);
}

// What the mask must be: every token whose bytes the grammar accepts after `text`.
std::vector<int32_t> brute_force_allowed(const std::shared_ptr<const CompiledGrammar>& grammar, const std::string& text) {
  std::vector<int32_t> allowed;
  for (int32_t id = 0; id < grammar->vocabulary().size(); ++id) {
    GrammarMatcher matcher(grammar);
    EXPECT_TRUE(matcher.accept_bytes(text));
    if (matcher.accept_token(id)) allowed.push_back(id);
  }
  return allowed;
}

std::vector<int32_t> mask_ids(std::span<const uint64_t> mask, int32_t vocab_size) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < vocab_size; ++id)
    if (mask_allows(mask, id)) ids.push_back(id);
  return ids;
}

// Random walks through the masks: at each step the mask equals the brute-force answer (while
// `check_masks`), and every walk that ends (the grammar can end and the coin says stop, or
// nothing may follow) is JSON satisfying the schema.
void random_walks(const json& schema, const std::shared_ptr<const CompiledGrammar>& grammar, int walks, bool check_masks) {
  const int32_t vocab = grammar->vocabulary().size();
  std::mt19937 random(1234);
  int finished = 0;
  for (int walk = 0; walk < walks; ++walk) {
    GrammarMatcher matcher(grammar);
    std::string text;
    TokenMask mask = empty_mask(vocab);
    for (int step = 0; step < 400; ++step) {
      if (!matcher.can_continue() || (matcher.can_end() && random() % 4 == 0)) {
        ++finished;
        const json value = json::parse(text);  // throws on invalid JSON
        EXPECT_EQ(kiln::testing::schema_violation(value, schema), "") << text;
        break;
      }
      matcher.fill_mask(mask);
      const std::vector<int32_t> allowed = mask_ids(mask, vocab);
      if (check_masks) {
        ASSERT_EQ(allowed, brute_force_allowed(grammar, text)) << "after " << text;
      }
      ASSERT_FALSE(allowed.empty()) << "no token can follow " << text;
      // Prefer closing tokens half of the time so that walks end.
      int32_t id = allowed[random() % allowed.size()];
      if (random() % 2 == 0) {
        for (int32_t candidate : allowed)
          if (grammar->vocabulary().bytes(candidate).find_first_of("]}\"") != std::string::npos) id = candidate;
      }
      ASSERT_TRUE(matcher.accept_token(id));
      text += grammar->vocabulary().bytes(id);
    }
  }
  EXPECT_GT(finished, walks / 2);
}

const std::vector<json> kWalkSchemas = {
    kPerson,
    json::parse(R"({"type":"array","items":{"type":"number"},"maxItems":4})"),
    json::parse(R"({"anyOf":[{"type":"string","maxLength":3},{"type":"object","properties":{
        "a":{"type":"array","items":{"type":"integer"}},"b":{"type":"boolean"}}}]})"),
    json::parse(R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
        "next":{"anyOf":[{"$ref":"#/$defs/node"},{"type":"null"}]}},"required":["v","next"]}},"$ref":"#/$defs/node"})"),
    json::parse(R"({"type":"object","properties":{"when":{"type":"string","format":"date-time"},
        "id":{"type":"string","format":"uuid"}},"required":["when"]})"),
    json::parse(R"({"type":"object","properties":{"x":{"const":{"k":[1,"é"]}}}})"),
    json::parse(R"({"type":"object","additionalProperties":{"type":"array","items":{"type":"null"}}})"),
};

TEST(TokenMask, EqualsBruteForceAlongRandomWalks) {
  const auto vocabulary = json_vocabulary();
  for (const json& schema : kWalkSchemas) {
    SCOPED_TRACE(schema.dump());
    random_walks(schema, compile(schema, vocabulary), 6, true);
  }
  random_walks(json::object({{"type", "object"}}), std::make_shared<CompiledGrammar>(json_object_grammar(), vocabulary),
               6, true);
}

TEST(TokenMask, RandomWalksGiveValidJson) {
  const auto vocabulary = json_vocabulary();
  for (const json& schema : kWalkSchemas) {
    SCOPED_TRACE(schema.dump());
    random_walks(schema, compile(schema, vocabulary), 60, false);
  }
}

}  // namespace
