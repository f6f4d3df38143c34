#include "engine/grammar/grammar.h"

#include <functional>

#include "core/error.h"

namespace kiln::grammar {

ByteSet& ByteSet::add(uint8_t first, uint8_t last) {
  for (int byte = first; byte <= last; ++byte) words_[byte >> 6] |= uint64_t{1} << (byte & 63);
  return *this;
}

ByteSet& ByteSet::add(const ByteSet& other) {
  for (size_t i = 0; i < words_.size(); ++i) words_[i] |= other.words_[i];
  return *this;
}

ByteSet ByteSet::without(const ByteSet& other) const {
  ByteSet result;
  for (size_t i = 0; i < words_.size(); ++i) result.words_[i] = words_[i] & ~other.words_[i];
  return result;
}

bool ByteSet::empty() const { return (words_[0] | words_[1] | words_[2] | words_[3]) == 0; }

Sequence literal(std::string_view text) {
  Sequence symbols;
  for (char c : text) symbols.push_back(Symbol::byte_set(ByteSet::of(static_cast<uint8_t>(c))));
  return symbols;
}

Sequence concat(Sequence a, const Sequence& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

int32_t Grammar::add_rule(std::string name) {
  names_.push_back(std::move(name));
  alternatives_.emplace_back();
  return static_cast<int32_t>(names_.size() - 1);
}

void Grammar::add_alternative(int32_t rule, const Sequence& symbols) {
  alternatives_.at(rule).push_back(static_cast<int32_t>(symbols_.size()));
  for (const Symbol& symbol : symbols) {
    if (symbol.kind == Symbol::Kind::End) fail("grammar rule {}: an alternative may not contain End", names_[rule]);
    symbols_.push_back(symbol);
  }
  symbols_.push_back(Symbol{});
}

int32_t Grammar::add_rule(std::string name, const std::vector<Sequence>& alternatives) {
  const int32_t rule = add_rule(std::move(name));
  for (const Sequence& alternative : alternatives) add_alternative(rule, alternative);
  return rule;
}

void Grammar::check() const {
  if (root_ < 0 || root_ >= static_cast<int32_t>(rules())) fail("grammar: no root rule");
  for (const Symbol& symbol : symbols_)
    if (symbol.kind == Symbol::Kind::Rule && (symbol.rule < 0 || symbol.rule >= static_cast<int32_t>(rules())))
      fail("grammar: a reference names rule {}, which does not exist", symbol.rule);
  // Rules that can match no bytes, to a fixed point.
  std::vector<bool> nullable(rules(), false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t rule = 0; rule < rules(); ++rule) {
      if (nullable[rule]) continue;
      for (int32_t position : alternatives_[rule]) {
        while (symbols_[position].kind == Symbol::Kind::Rule && nullable[symbols_[position].rule]) ++position;
        if (symbols_[position].kind == Symbol::Kind::End) {
          nullable[rule] = changed = true;
          break;
        }
      }
    }
  }
  // A rule reachable from itself through leading symbols that match nothing is left-recursive.
  enum class Mark { Unvisited, Active, Done };
  std::vector<Mark> marks(rules(), Mark::Unvisited);
  std::function<void(int32_t)> visit = [&](int32_t rule) {
    marks[rule] = Mark::Active;
    for (int32_t position : alternatives_[rule]) {
      for (; symbols_[position].kind == Symbol::Kind::Rule; ++position) {
        const int32_t next = symbols_[position].rule;
        if (marks[next] == Mark::Active) fail("grammar rule {} is left-recursive", names_[next]);
        if (marks[next] == Mark::Unvisited) visit(next);
        if (!nullable[next]) break;
      }
    }
    marks[rule] = Mark::Done;
  };
  for (size_t rule = 0; rule < rules(); ++rule)
    if (marks[rule] == Mark::Unvisited) visit(static_cast<int32_t>(rule));
  // Rules that match some text, to a fixed point: an alternative whose byte sets are not empty and
  // whose rules match some text.
  std::vector<bool> productive(rules(), false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t rule = 0; rule < rules(); ++rule) {
      if (productive[rule]) continue;
      for (int32_t position : alternatives_[rule]) {
        for (;; ++position) {
          const Symbol& symbol = symbols_[position];
          if (symbol.kind == Symbol::Kind::End) {
            productive[rule] = changed = true;
            break;
          }
          if (symbol.kind == Symbol::Kind::Bytes ? symbol.bytes.empty() : !productive[symbol.rule]) break;
        }
        if (productive[rule]) break;
      }
    }
  }
  if (!productive[root_]) fail("grammar: the root rule {} matches no text", names_[root_]);
}

}  // namespace kiln::grammar
