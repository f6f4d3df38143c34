// The structured-output engine (engine/grammar/): JSON schemas, regexes and GBNF grammars compiled
// to grammars accept and reject the texts they should (checked against std::regex and the
// calendar on every short text of small alphabets), token masks equal a brute-force check of
// every token, and random walks through the masks always produce JSON that satisfies the schema.
#include <functional>
#include <random>
#include <regex>

#include <gtest/gtest.h>

#include "engine/grammar/gbnf.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex.h"
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
            "unsupported JSON schema keyword \"minimum\" at /properties/n for a number (it is supported for integers)");
  EXPECT_EQ(error_of(R"({"type":"array","uniqueItems":true})"), "unsupported JSON schema keyword \"uniqueItems\" at /");
  EXPECT_EQ(error_of(R"j({"type":"string","pattern":"a(?=b)"})j"),
            "JSON schema \"pattern\" at /: regex at offset 1: lookahead assertions are not supported");
  EXPECT_EQ(error_of(R"({"pattern":"a"})"),
            "JSON schema at /: \"pattern\" needs a \"type\" (string for pattern and format, integer for bounds)");
  EXPECT_EQ(error_of(R"({"type":"integer","minimum":5,"maximum":4.5})"),
            "JSON schema at /: no integer lies within its bounds");
  EXPECT_EQ(error_of(R"({"type":"integer","exclusiveMinimum":true})"),
            "JSON schema \"exclusiveMinimum\" at / must be a number (draft 4's boolean form is not supported)");
  EXPECT_EQ(error_of(R"({"type":"integer","maximum":1e19})"),
            "JSON schema \"maximum\" at / is 1e+19; bounds beyond ±10^18 are not supported");
  EXPECT_EQ(error_of(R"({"properties":{"a":{}},"additionalProperties":true})"),
            "unsupported JSON schema keyword \"additionalProperties\" other than false beside \"properties\" at /");
  EXPECT_EQ(error_of(R"({"type":"string","format":"hostname"})"),
            "unsupported JSON schema format \"hostname\" at / (supported: date, date-time, email, ipv4, time, uuid)");
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

// Every text over `alphabet` up to `length` characters.
std::vector<std::string> all_texts(const std::string& alphabet, size_t length) {
  std::vector<std::string> texts = {""};
  for (size_t begin = 0, size = 1; size <= length; ++size) {
    const size_t end = texts.size();
    for (size_t i = begin; i < end; ++i)
      for (char c : alphabet) texts.push_back(texts[i] + c);
    begin = end;
  }
  return texts;
}

TEST(RegexGrammar, MatchesWhatStdRegexMatchesOnEveryShortText) {
  const auto vocabulary = byte_vocabulary();
  const std::vector<std::string> texts = all_texts("ab1-_\n", 5);
  for (const char* pattern : {"(ab|1)*-?", "a{2,3}b?|_", "[^a]1+", "a.b", "\\d+-\\w", "(?:a|b1){1,2}1*?", "[a\\d-]{2}",
                              "(a|)+b", "((a*)*b)*", "^a?b{2,}$", "\\s|\\S\\S", "[\\W_]+", "a{0}b", "(?<x>a)(b|_)?"}) {
    SCOPED_TRACE(pattern);
    const auto compiled = std::make_shared<CompiledGrammar>(regex_grammar(pattern), vocabulary);
    // std::regex has no named groups; a plain group matches the same texts.
    std::string reference_pattern = pattern;
    if (const size_t named = reference_pattern.find("(?<x>"); named != std::string::npos)
      reference_pattern.replace(named, 5, "(");
    const std::regex reference(reference_pattern);
    for (const std::string& text : texts)
      ASSERT_EQ(matches(compiled, text), std::regex_match(text, reference)) << "text \"" << text << "\"";
  }
}

// A schema's pattern constrains the string's value, unanchored, while the grammar writes its JSON text.
TEST(RegexGrammar, APatternInASchemaMatchesTheStringsValue) {
  const auto vocabulary = byte_vocabulary();
  const std::vector<std::string> values = all_texts("a\"\\\n/", 5);
  for (const char* pattern : {"a\"", "^(a|\\\\)", "\"$", "\\n\\\\?$", "^[^a]*$", "^.a", "/\"?/", ""}) {
    SCOPED_TRACE(pattern);
    const json schema = {{"type", "string"}, {"pattern", pattern}};
    const auto compiled = compile(schema, vocabulary);
    const std::regex reference(pattern);
    for (const std::string& value : values)
      ASSERT_EQ(matches(compiled, json(value).dump()), std::regex_search(value, reference)) << json(value).dump();
  }
  // One way to write each character: the escapes JSON text needs, nothing else.
  const auto any = compile(json::parse(R"({"type":"string","pattern":"^.$"})"), vocabulary);
  EXPECT_TRUE(matches(any, R"("\u0001")"));
  EXPECT_FALSE(matches(any, R"("\u0041")"));
  EXPECT_TRUE(matches(any, "\"\xC3\xA9\""));
  EXPECT_FALSE(matches(any, R"("\n")"));  // `.` is no line terminator
}

TEST(RegexGrammar, MalformedAndUnsupportedPatternsNameTheirPlace) {
  const auto error_of = [](const char* pattern) {
    try {
      regex_grammar(pattern);
    } catch (const kiln::Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of("ab(?=c)"), "regex at offset 2: lookahead assertions are not supported");
  EXPECT_EQ(error_of("(?<!a)b"), "regex at offset 0: lookbehind assertions are not supported");
  EXPECT_EQ(error_of("(a)\\1"), "regex at offset 3: backreferences are not supported");
  EXPECT_EQ(error_of("a\\bc"), "regex at offset 1: word boundaries (\\b) are not supported");
  EXPECT_EQ(error_of("\\p{L}"), "regex at offset 0: Unicode property escapes (\\p, \\P) are not supported");
  EXPECT_EQ(error_of("a^b"), "regex at offset 1: ^ is supported only at the start of the pattern");
  EXPECT_EQ(error_of("a$b"), "regex at offset 1: $ is supported only at the end of the pattern");
  EXPECT_EQ(error_of("(ab"), "regex at offset 0: unterminated group");
  EXPECT_EQ(error_of("ab)"), "regex at offset 2: unmatched )");
  EXPECT_EQ(error_of("[b-a]"), "regex at offset 1: character class range out of order");
  EXPECT_EQ(error_of("[ab"), "regex at offset 0: unterminated character class");
  EXPECT_EQ(error_of("a**"), "regex at offset 2: nothing to repeat (a quantifier follows a quantifier)");
  EXPECT_EQ(error_of("+a"), "regex at offset 0: nothing to repeat");
  EXPECT_EQ(error_of("a{3,2}"), "regex at offset 1: quantifier {n,m} with n above m");
  EXPECT_EQ(error_of("a{2"), "regex at offset 1: malformed quantifier (expected {n}, {n,} or {n,m})");
  EXPECT_EQ(error_of("a{1001}"), "regex at offset 1: repetition count above 1000 is not supported");
  EXPECT_EQ(error_of("\\q"), "regex at offset 0: unknown escape \\q");
  EXPECT_EQ(error_of("[]"), "regex: the pattern matches no text");
  EXPECT_EQ(error_of("((a{1000}){1000})"),
            "regex: the pattern is too large: its automaton passes 20000 states (counted repetitions copy what they "
            "repeat)");
  EXPECT_EQ(error_of("a{2}{3}"), "regex at offset 4: nothing to repeat (a quantifier follows a quantifier)");
}

TEST(GbnfGrammar, MatchesWhatTheEquivalentRegexMatches) {
  const auto vocabulary = byte_vocabulary();
  const std::vector<std::string> texts = all_texts("abc\n", 6);
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"root ::= (\"a\" | \"b\" c)* \"c\"?\nc ::= [a-c]{1,2}", "(a|b[a-c]{1,2})*c?"},
      {"# a comment\nroot ::= x{2,} | [^a\\n] # another\n\nx ::= \"ab\"\n   | \"c\"", "(ab|c){2,}|[^a\\n]"},
      {"root ::= (\n  \"a\"\n  | \"b\"+\n) \"\\n\"{,2}", "(a|b+)\\n{0,2}"},
      {"root ::= item+\nitem ::= \"a\" item? \"b\" | \"c\"", ""},  // balanced a…b: checked below
      {"root ::= [abc]{3} .", "[abc]{3}[\\s\\S]"},
      {"root ::= \"\\x61\\u0062\" \"\" | \"c\"{0}", "ab|"},
  };
  for (const auto& [text, regex] : cases) {
    SCOPED_TRACE(text);
    const auto compiled = std::make_shared<CompiledGrammar>(gbnf_grammar(text), vocabulary);
    if (std::string(regex).empty()) {
      // item ::= a item? b | c: a's and b's nest, c's between; checked by counting.
      const auto balanced = [](const std::string& candidate) {
        std::function<bool(size_t&)> item = [&](size_t& at) {
          if (at < candidate.size() && candidate[at] == 'c') return ++at, true;
          if (at >= candidate.size() || candidate[at] != 'a') return false;
          ++at;
          size_t inner = at;
          if (item(inner)) at = inner;
          if (at >= candidate.size() || candidate[at] != 'b') return false;
          return ++at, true;
        };
        size_t at = 0, items = 0;
        for (size_t next = at; at < candidate.size() && item(next); next = at) {
          at = next;
          ++items;
        }
        return items > 0 && at == candidate.size();
      };
      for (const std::string& candidate : texts)
        ASSERT_EQ(matches(compiled, candidate), balanced(candidate)) << "text \"" << candidate << "\"";
      continue;
    }
    const std::regex reference(regex);
    for (const std::string& candidate : texts)
      ASSERT_EQ(matches(compiled, candidate), std::regex_match(candidate, reference)) << "text \"" << candidate << "\"";
  }
  // Characters past ASCII are UTF-8 texts.
  const auto unicode = std::make_shared<CompiledGrammar>(gbnf_grammar("root ::= [α-ω]+ \"\\u00e9\""), vocabulary);
  EXPECT_TRUE(matches(unicode, "\xCE\xB1\xCF\x89\xC3\xA9"));
  EXPECT_FALSE(matches(unicode, "\xCE\xB1\xCE"));
  EXPECT_FALSE(matches(unicode, "a\xC3\xA9"));
}

TEST(GbnfGrammar, MalformedGrammarsNameTheirLineAndColumn) {
  const auto error_of = [](const char* text) {
    try {
      gbnf_grammar(text);
    } catch (const kiln::Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of("root ::= x"), "GBNF grammar at line 1, column 10: rule x is used but never defined");
  EXPECT_EQ(error_of("a ::= \"x\""), "GBNF grammar: no rule is named root (the rule the whole text must match)");
  EXPECT_EQ(error_of("root ::= \"a\"\nroot ::= \"b\""),
            "GBNF grammar at line 2, column 1: rule root is defined twice (first at line 1, column 1)");
  EXPECT_EQ(error_of("root ::= \"abc"), "GBNF grammar at line 1, column 10: unterminated string literal");
  EXPECT_EQ(error_of("root ::= [a-"), "GBNF grammar at line 1, column 10: unterminated character class [");
  EXPECT_EQ(error_of("root ::= [z-a]"), "GBNF grammar at line 1, column 11: character range out of order");
  EXPECT_EQ(error_of("root ::=\n  (\"a\" | \"b\""), "GBNF grammar at line 2, column 3: unterminated group (");
  EXPECT_EQ(error_of("root ::= \"a\" )"), "GBNF grammar at line 1, column 14: unexpected ')'");
  EXPECT_EQ(error_of("root = \"a\""), "GBNF grammar at line 1, column 6: expected ::= after the rule name root");
  EXPECT_EQ(error_of("root ::= \"\\q\""), "GBNF grammar at line 1, column 11: unknown escape \\'q'");
  EXPECT_EQ(error_of("root ::= <think>"),
            "GBNF grammar at line 1, column 10: token references (<…>, <[id]>) are not supported");
  EXPECT_EQ(error_of("root ::= \"a\"{3,1}"), "GBNF grammar at line 1, column 13: repetition {m,n} with m above n");
  EXPECT_EQ(error_of("root ::= \"\"*"),
            "GBNF grammar at line 1, column 10: nothing to repeat (the expression matches only the empty text)");
  EXPECT_EQ(error_of("root ::= root \"a\" | \"b\""), "GBNF grammar rule root is left-recursive");
  EXPECT_EQ(error_of("root ::= \"a\"{30000}"), "GBNF grammar at line 1, column 13: repetition count above 20000");
  EXPECT_EQ(error_of("root ::= \"a\"{15000} \"b\"{15000}"),
            "GBNF grammar at line 1, column 24: the grammar is too large: it passes 20000 positions (counted "
            "repetitions copy what they repeat)");
  EXPECT_EQ(error_of("root ::= []"), "GBNF grammar: the root rule root matches no text");
}

// Integer bounds compile to exact digit grammars: every integer in a window around the bounds is
// accepted exactly when it is within them, and only in its canonical form.
TEST(JsonSchemaGrammar, IntegerBoundsAreExact) {
  const auto vocabulary = byte_vocabulary();
  const std::vector<json> schemas = {
      json::parse(R"({"type":"integer","minimum":-17,"exclusiveMaximum":250})"),
      json::parse(R"({"type":"integer","minimum":0,"maximum":0})"),
      json::parse(R"({"type":"integer","exclusiveMinimum":99})"),
      json::parse(R"({"type":"integer","maximum":-1000})"),
      json::parse(R"({"type":"integer","minimum":-1205.5,"maximum":-3})"),
      json::parse(R"({"type":"integer","minimum":7,"maximum":1009})"),
      json::parse(R"({"type":"integer","exclusiveMaximum":10.5})"),
      json::parse(R"({"type":"integer","minimum":1000000000000000000})"),
  };
  for (const json& schema : schemas) {
    SCOPED_TRACE(schema.dump());
    const auto compiled = compile(schema, vocabulary);
    for (int64_t n = -1500; n <= 1500; ++n)
      ASSERT_EQ(matches(compiled, std::to_string(n)), kiln::testing::schema_violation(json(n), schema).empty()) << n;
    for (int64_t n : {int64_t{999999999999999999}, int64_t{1000000000000000000}, int64_t{9223372036854775807},
                      int64_t{-1000000000000000000}})
      EXPECT_EQ(matches(compiled, std::to_string(n)), kiln::testing::schema_violation(json(n), schema).empty()) << n;
    EXPECT_FALSE(matches(compiled, "-0"));
    EXPECT_FALSE(matches(compiled, "007"));
    EXPECT_FALSE(matches(compiled, "1.0"));
  }
  const auto unbounded = compile(json::parse(R"({"type":"integer","exclusiveMinimum":99})"), vocabulary);
  EXPECT_TRUE(matches(unbounded, "123456789012345678901234567890"));
}

TEST(JsonSchemaGrammar, FormatsAcceptExactlyTheirTexts) {
  const auto vocabulary = byte_vocabulary();
  const auto date = compile(json::parse(R"({"type":"string","format":"date"})"), vocabulary);
  // Every day number of every month of common, leap and century years.
  for (const char* year : {"2023", "2024", "1900", "2000", "0000", "2100", "0400", "1996"})
    for (int month = 0; month <= 13; ++month)
      for (int day = 0; day <= 32; ++day) {
        const std::string text = fmt::format("{}-{:02}-{:02}", year, month, day);
        const json value = text;
        ASSERT_EQ(matches(date, value.dump()), kiln::testing::schema_violation(value, {{"format", "date"}}).empty())
            << text;
      }
  EXPECT_TRUE(matches(date, R"("2024-02-29")"));
  EXPECT_FALSE(matches(date, R"("2023-02-29")"));
  EXPECT_FALSE(matches(date, R"("1900-02-29")"));
  EXPECT_TRUE(matches(date, R"("2000-02-29")"));
  EXPECT_FALSE(matches(date, R"("2023-04-31")"));
  const auto date_time = compile(json::parse(R"({"type":"string","format":"date-time"})"), vocabulary);
  EXPECT_TRUE(matches(date_time, R"("2024-02-29T12:00:00Z")"));
  EXPECT_FALSE(matches(date_time, R"("2023-02-29T12:00:00Z")"));

  const auto ipv4 = compile(json::parse(R"({"type":"string","format":"ipv4"})"), vocabulary);
  for (int octet = 0; octet < 300; ++octet)
    for (const std::string& text : {fmt::format("{}.0.10.255", octet), fmt::format("1.2.3.{}", octet),
                                    fmt::format("0{}.1.1.1", octet)}) {
      const json value = text;
      ASSERT_EQ(matches(ipv4, value.dump()), kiln::testing::schema_violation(value, {{"format", "ipv4"}}).empty())
          << text;
    }
  EXPECT_FALSE(matches(ipv4, R"("1.2.3")"));

  const auto email = compile(json::parse(R"({"type":"string","format":"email"})"), vocabulary);
  for (const char* text : {"a@b.co", "first.last+tag@mail.example.org", "x_y!#$%&'*/=?^`{|}~-@a-1.b2", "a@b.c.d"}) {
    EXPECT_TRUE(matches(email, json(text).dump())) << text;
    EXPECT_EQ(kiln::testing::schema_violation(json(text), {{"format", "email"}}), "") << text;
  }
  for (const char* text : {"a@b", "@b.co", "a.@b.co", "a..b@c.co", "a@-b.co", "a@b-.co", "a@b..co", "a b@c.co",
                           "a@b.co.", "\"a\"@b.co", "a@[1.2.3.4]"}) {
    EXPECT_FALSE(matches(email, json(text).dump())) << text;
    EXPECT_NE(kiln::testing::schema_violation(json(text), {{"format", "email"}}), "") << text;
  }
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
    json::parse(R"({"type":"object","properties":{"code":{"type":"string","pattern":"^[A-Z]{2}-\\d+"},
        "note":{"type":"string","pattern":"ab|\"\\\\"},"n":{"type":"integer","minimum":-5,"exclusiveMaximum":120},
        "when":{"type":"string","format":"date"},"ip":{"type":"string","format":"ipv4"},
        "mail":{"type":"string","format":"email"}},"required":["code","note","n","when","ip","mail"]})"),
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

// Regex and GBNF grammars through the same masks: each step's mask is the brute-force answer.
TEST(TokenMask, EqualsBruteForceForRegexAndGbnfGrammars) {
  const auto vocabulary = json_vocabulary();
  const std::vector<Grammar> grammars = {
      regex_grammar("(true|[a-f]{2,4}|\\d+(\\.\\d\\d)?)( ,[\\w\"]+:\"?)*"),
      gbnf_grammar("root ::= \"{\" pair (\",\" pair)* \"}\"\npair ::= \"\\\"\" [a-z]+ \"\\\":\" (\"null\" | [0-9]+ | root)"),
  };
  std::mt19937 random(99);
  for (const Grammar& grammar : grammars) {
    const auto compiled = std::make_shared<CompiledGrammar>(grammar, vocabulary);
    for (int walk = 0; walk < 8; ++walk) {
      GrammarMatcher matcher(compiled);
      std::string text;
      TokenMask mask = empty_mask(vocabulary->size());
      for (int step = 0; step < 60 && matcher.can_continue() && !(matcher.can_end() && random() % 5 == 0); ++step) {
        matcher.fill_mask(mask);
        const std::vector<int32_t> allowed = mask_ids(mask, vocabulary->size());
        ASSERT_EQ(allowed, brute_force_allowed(compiled, text)) << "after " << text;
        ASSERT_FALSE(allowed.empty()) << text;
        const int32_t id = allowed[random() % allowed.size()];
        ASSERT_TRUE(matcher.accept_token(id));
        text += vocabulary->bytes(id);
      }
    }
  }
}

TEST(TokenMask, RandomWalksGiveValidJson) {
  const auto vocabulary = json_vocabulary();
  for (const json& schema : kWalkSchemas) {
    SCOPED_TRACE(schema.dump());
    random_walks(schema, compile(schema, vocabulary), 60, false);
  }
}

}  // namespace
