// A context-free grammar over bytes: the form every structured-output constraint compiles to (a
// JSON schema, any JSON object). A rule is a list of alternatives; an alternative a sequence of
// symbols, each one byte out of a set or a whole rule. The matcher (engine/grammar/token_mask.h)
// runs it as a pushdown automaton over bytes, as llama.cpp's grammar sampler does, so rules may
// recurse (nested JSON) but never on the left: check() refuses a rule that can reach itself without
// consuming a byte, which the automaton could not expand.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::grammar {

// Compiling costs a walk of the vocabulary per grammar position (a wide one, inside a string, some
// tens of microseconds per thousand tokens), and a grammar made from a request (a JSON schema, a
// regex, a GBNF grammar) is compiled while the client waits: past this many positions it is
// refused rather than compiled for seconds.
inline constexpr size_t kMaxRequestGrammarPositions = 20000;

class ByteSet {
 public:
  static ByteSet of(uint8_t byte) { return ByteSet().add(byte, byte); }
  static ByteSet range(uint8_t first, uint8_t last) { return ByteSet().add(first, last); }
  ByteSet& add(uint8_t first, uint8_t last);
  ByteSet& add(const ByteSet& other);
  ByteSet without(const ByteSet& other) const;
  bool contains(uint8_t byte) const { return (words_[byte >> 6] >> (byte & 63)) & 1; }
  bool empty() const;
  bool operator==(const ByteSet&) const = default;

 private:
  std::array<uint64_t, 4> words_{};
};

// One symbol of an alternative. `End` closes every alternative in the flattened grammar.
struct Symbol {
  enum class Kind : uint8_t { Bytes, Rule, End };
  Kind kind = Kind::End;
  ByteSet bytes;      // Kind::Bytes
  int32_t rule = -1;  // Kind::Rule

  static Symbol byte_set(const ByteSet& bytes) { return {Kind::Bytes, bytes, -1}; }
  static Symbol reference(int32_t rule) { return {Kind::Rule, {}, rule}; }
};

using Sequence = std::vector<Symbol>;

// The bytes of `text`, one symbol each.
Sequence literal(std::string_view text);
// `a` then `b`.
Sequence concat(Sequence a, const Sequence& b);

class Grammar {
 public:
  // A new rule without alternatives; `name` appears in errors.
  int32_t add_rule(std::string name);
  // Appends an alternative to `rule`; symbols of kind End are not allowed in it.
  void add_alternative(int32_t rule, const Sequence& symbols);
  // A new rule with these alternatives.
  int32_t add_rule(std::string name, const std::vector<Sequence>& alternatives);
  void set_root(int32_t rule) { root_ = rule; }

  int32_t root() const { return root_; }
  size_t rules() const { return alternatives_.size(); }
  const std::string& rule_name(int32_t rule) const { return names_[rule]; }
  // Positions (indices of symbols) where the alternatives of `rule` start.
  std::span<const int32_t> alternatives(int32_t rule) const { return alternatives_[rule]; }
  // The symbol at a position; every alternative ends with an End symbol.
  const Symbol& at(int32_t position) const { return symbols_[position]; }
  size_t positions() const { return symbols_.size(); }

  // Fails (kiln::Error naming the rule) when the root is unset, a reference names no rule, a rule
  // is left-recursive, or the root matches no text at all (a matcher would start with nothing
  // allowed).
  void check() const;

 private:
  std::vector<Symbol> symbols_;
  std::vector<std::vector<int32_t>> alternatives_;
  std::vector<std::string> names_;
  int32_t root_ = -1;
};

}  // namespace kiln::grammar
