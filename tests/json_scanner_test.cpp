// The byte-at-a-time JSON scanner against nlohmann::json's parser, which the server parses with:
// on valid texts and on thousands of mutations of them, the scanner takes a text whole and calls it
// complete exactly when nlohmann parses it, and never refuses a byte of a text that parses.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <random>
#include <string>
#include <vector>

#include "text/json_scanner.h"

using namespace kiln;

namespace {

// Whether the scanner takes every byte and ends complete; where it refused, if it did.
struct Verdict {
  bool accepted = false;
  size_t refused_at = std::string::npos;
};
Verdict scan(const std::string& text) {
  JsonScanner scanner;
  for (size_t i = 0; i < text.size(); ++i)
    if (scanner.take(text[i]) == JsonScanner::Byte::Refused) return {false, i};
  return {scanner.complete(), std::string::npos};
}

bool nlohmann_parses(const std::string& text) { return nlohmann::json::accept(text); }

const std::vector<std::string> kValid = {
    R"({})",
    R"([])",
    R"({"a": 1, "b": [true, false, null], "c": {"d": "e"}})",
    R"( { "city" : "S\u00e3o \"Paulo\"", "n": -0.5e+10, "m": 0, "k": 12.25E-3 } )",
    R"(["\ud83d\ude00", "\u00e9", "é", "😀", "\\\/\b\f\n\r\t"])",
    R"("just a string")",
    R"(-12)",
    R"(1e308)",
    R"([1.7976931348623157e308, 1e-400, -0.0])",
    R"([[[[{"deep": [[]]}]]]])",
    "{\"tab\":\t[1,\n2,\r\n3]}",
};

// Pieces a mutation inserts: JSON's own characters, and whole and broken UTF-8 sequences.
const std::vector<std::string> kPieces = {
    "{", "}", "[", "]", ",", ":", "\"", "\\", "u", "d8", "dc", "\\ud800", "\\udc00", "0", "1", "-", "+", ".",
    "e", "E", "9", "99", "1e400", "t", "true", "n", "null", " ", "\n", "\t", "\x01", "a", "é", "😀", "\xC0\x80", "\xED\xA0\x80",
    "\xF4\x90\x80\x80", "\xE2\x82", "\x80", "\xFF",
};

TEST(JsonScanner, AgreesWithNlohmannOnValidTexts) {
  for (const std::string& text : kValid) {
    ASSERT_TRUE(nlohmann_parses(text)) << text;
    const Verdict verdict = scan(text);
    EXPECT_TRUE(verdict.accepted) << text << " refused at " << verdict.refused_at;
  }
}

TEST(JsonScanner, AgreesWithNlohmannOnMutatedTexts) {
  std::mt19937 random(29);
  size_t accepted = 0, refused = 0;
  for (int round = 0; round < 20000; ++round) {
    std::string text = kValid[random() % kValid.size()];
    for (int edits = 1 + static_cast<int>(random() % 3); edits > 0; --edits) {
      const size_t at = text.empty() ? 0 : random() % (text.size() + 1);
      switch (random() % 3) {
        case 0:
          if (at < text.size()) text.erase(at, 1 + random() % 3);
          break;
        case 1: text.insert(at, kPieces[random() % kPieces.size()]); break;
        default:
          if (at < text.size()) text.replace(at, 1, kPieces[random() % kPieces.size()]);
          break;
      }
    }
    const bool parses = nlohmann_parses(text);
    const Verdict verdict = scan(text);
    ASSERT_EQ(verdict.accepted, parses) << "text: " << text << " (scanner refused at " << verdict.refused_at << ")";
    // A text that parses has no byte the scanner refuses, so every prefix of it is taken.
    if (parses) ASSERT_EQ(verdict.refused_at, std::string::npos) << text;
    (parses ? accepted : refused) += 1;
  }
  // The mutations reach both sides.
  EXPECT_GT(accepted, 1000u);
  EXPECT_GT(refused, 1000u);
}

TEST(JsonScanner, RefusesNumbersPastADoublesRangeAsNlohmannDoes) {
  for (const std::string& text : {std::string("1e400"), std::string("-2e308"), std::string("1.7976931348623159e308"),
                                  "[1" + std::string(309, '0') + "]"}) {
    EXPECT_FALSE(nlohmann_parses(text)) << text;
    EXPECT_FALSE(scan(text).accepted) << text;
  }
  EXPECT_TRUE(scan("1" + std::string(308, '0')).accepted);
  EXPECT_EQ(scan("[1e3999]").refused_at, 5u);  // 1e399: the digit that left the range
}

TEST(JsonScanner, TellsLayoutFromTheValueAndKeysFromStrings) {
  JsonScanner scanner;
  std::string value, keys;
  for (char byte : std::string(" {\"k\" : [ 1 , \"v w\" ] }\n")) {
    const bool in_key_before = scanner.in_key();
    const JsonScanner::Byte taken = scanner.take(byte);
    ASSERT_NE(taken, JsonScanner::Byte::Refused);
    if (taken == JsonScanner::Byte::Taken) value += byte;
    if (in_key_before || scanner.in_key()) keys += byte;
  }
  EXPECT_EQ(value, R"({"k":[1,"v w"]})");
  EXPECT_EQ(keys, R"("k")");
  EXPECT_TRUE(scanner.complete());
  EXPECT_EQ(scanner.depth(), 0u);
  // A number ends only when what follows it says so.
  JsonScanner number;
  for (char byte : std::string("[12")) number.take(byte);
  EXPECT_EQ(number.depth(), 1u);
  EXPECT_FALSE(number.complete());
  EXPECT_EQ(number.take(']'), JsonScanner::Byte::Taken);
  EXPECT_TRUE(number.complete());
  EXPECT_EQ(number.take('x'), JsonScanner::Byte::Refused);
  EXPECT_TRUE(number.refused());
}

}  // namespace
