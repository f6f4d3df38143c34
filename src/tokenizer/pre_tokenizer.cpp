#include "tokenizer/pre_tokenizer.h"

#include <algorithm>

#include "core/error.h"
#include "tokenizer/normalizer.h"

namespace kiln {

namespace {

// GPT-2's split pattern, used by the ByteLevel pre-tokenizer when use_regex is true
// (tokenizers/src/pre_tokenizers/byte_level.rs).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

bool bool_field(const nlohmann::json& spec, const char* name, bool fallback, const std::string& where) {
  if (!spec.contains(name)) return fallback;
  if (!spec[name].is_boolean()) fail("{}: \"{}\" must be true or false", where, name);
  return spec[name].get<bool>();
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const nlohmann::json& spec, const std::string& where) {
  PreTokenizer pre_tokenizer;
  if (!spec.is_null()) pre_tokenizer.add(spec, where);
  for (size_t i = 0; i + 1 < pre_tokenizer.steps_.size(); ++i)
    if (pre_tokenizer.steps_[i].kind == Step::Kind::ByteLevel)
      fail("{}: a ByteLevel pre-tokenizer followed by others is not supported (ByteLevel must be last)", where);
  return pre_tokenizer;
}

void PreTokenizer::add(const nlohmann::json& spec, const std::string& where) {
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string())
    fail("{}: expected an object with a \"type\"", where);
  const std::string type = spec["type"];
  const std::string here = where + " (" + type + ")";
  if (type == "Sequence") {
    if (!spec.contains("pretokenizers") || !spec["pretokenizers"].is_array())
      fail("{}: \"pretokenizers\" must be a list", here);
    for (const auto& child : spec["pretokenizers"]) add(child, where);
  } else if (type == "Split") {
    Step step;
    step.kind = Step::Kind::Split;
    step.pattern = pattern_from_json(spec.value("pattern", nlohmann::json()), here + " pattern");
    const std::string behavior = spec.value("behavior", std::string());
    if (behavior == "Removed")
      step.behavior = Behavior::Removed;
    else if (behavior == "Isolated")
      step.behavior = Behavior::Isolated;
    else if (behavior == "MergedWithPrevious")
      step.behavior = Behavior::MergedWithPrevious;
    else if (behavior == "MergedWithNext")
      step.behavior = Behavior::MergedWithNext;
    else if (behavior == "Contiguous")
      step.behavior = Behavior::Contiguous;
    else
      fail("{}: unknown behavior \"{}\"", here, behavior);
    step.invert = bool_field(spec, "invert", false, here);
    steps_.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    Step step;
    step.kind = Step::Kind::ByteLevel;
    step.add_prefix_space = bool_field(spec, "add_prefix_space", true, here);
    if (bool_field(spec, "use_regex", true, here))
      step.pattern = std::make_shared<const Regex>(kGpt2Pattern, here + " GPT-2 pattern");
    steps_.push_back(std::move(step));
    byte_level_ = true;
  } else if (type == "Metaspace") {
    Step step;
    step.kind = Step::Kind::Metaspace;
    step.replacement = spec.value("replacement", std::string("\u2581"));
    if (spec.contains("prepend_scheme")) {
      const std::string scheme = spec["prepend_scheme"].is_string() ? spec["prepend_scheme"].get<std::string>() : "";
      if (scheme == "always")
        step.prepend = Prepend::Always;
      else if (scheme == "first")
        step.prepend = Prepend::First;
      else if (scheme == "never")
        step.prepend = Prepend::Never;
      else
        fail("{}: unknown prepend_scheme {}", here, spec["prepend_scheme"].dump());
    } else {
      // Files written before prepend_scheme existed say add_prefix_space instead.
      step.prepend = bool_field(spec, "add_prefix_space", true, here) ? Prepend::Always : Prepend::Never;
    }
    if (bool_field(spec, "split", true, here))
      step.pattern = std::make_shared<const Regex>(Regex::escape(step.replacement), here + " replacement");
    steps_.push_back(std::move(step));
  } else {
    fail("{}: pre-tokenizer type \"{}\" is not supported (supported: Split, ByteLevel, Metaspace, Sequence)", where,
         type);
  }
}

void PreTokenizer::split_by_pattern(const Regex& pattern, Behavior behavior, bool invert, const Piece& piece,
                                    std::vector<Piece>& out) {
  // Cut the piece into alternating matched / unmatched spans (tokenizer/pattern.rs find_matches),
  // then group them by behavior (tokenizer/normalizer.rs NormalizedString::split).
  const std::string_view text = piece.text;
  auto emit = [&](size_t begin, size_t end) {
    if (end > begin) out.push_back({text.substr(begin, end - begin), piece.at_input_start && begin == 0});
  };
  size_t previous = 0;
  if (behavior == Behavior::Isolated) {  // every span is a piece: no grouping needed
    pattern.for_each_match(text, [&](size_t begin, size_t end) {
      emit(previous, begin);
      emit(begin, end);
      previous = end;
    });
    emit(previous, text.size());
    return;
  }
  struct Span {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Span> spans;
  pattern.for_each_match(text, [&](size_t begin, size_t end) {
    if (previous != begin) spans.push_back({previous, begin, invert});
    spans.push_back({begin, end, !invert});
    previous = end;
  });
  if (previous != text.size()) spans.push_back({previous, text.size(), invert});

  std::vector<std::pair<size_t, size_t>> groups;
  switch (behavior) {
    case Behavior::Isolated:
    case Behavior::Removed:
      for (const Span& span : spans)
        if (!span.is_match) groups.emplace_back(span.begin, span.end);
      break;
    case Behavior::Contiguous: {
      bool previous_match = false;
      for (const Span& span : spans) {
        if (!groups.empty() && span.is_match == previous_match)
          groups.back().second = span.end;
        else
          groups.emplace_back(span.begin, span.end);
        previous_match = span.is_match;
      }
      break;
    }
    case Behavior::MergedWithPrevious: {
      bool previous_match = false;
      for (const Span& span : spans) {
        if (!groups.empty() && span.is_match && !previous_match)
          groups.back().second = span.end;
        else
          groups.emplace_back(span.begin, span.end);
        previous_match = span.is_match;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool previous_match = false;
      for (auto span = spans.rbegin(); span != spans.rend(); ++span) {
        if (!groups.empty() && span->is_match && !previous_match)
          groups.back().first = span->begin;
        else
          groups.emplace_back(span->begin, span->end);
        previous_match = span->is_match;
      }
      std::reverse(groups.begin(), groups.end());
      break;
    }
  }
  for (const auto& [begin, end] : groups) emit(begin, end);
}

void PreTokenizer::split(std::string_view segment, bool segment_at_input_start, std::vector<std::string_view>& words,
                         std::deque<std::string>& storage) const {
  if (segment.empty()) return;
  thread_local std::vector<Piece> pieces, next;
  pieces.assign(1, Piece{segment, segment_at_input_start});
  for (const Step& step : steps_) {
    next.clear();
    for (const Piece& piece : pieces) {
      switch (step.kind) {
        case Step::Kind::Split:
          split_by_pattern(*step.pattern, step.behavior, step.invert, piece, next);
          break;
        case Step::Kind::ByteLevel: {
          Piece prefixed = piece;
          if (step.add_prefix_space && piece.text.front() != ' ') {
            std::string& text = storage.emplace_back(1, ' ');
            text.append(piece.text);
            prefixed.text = text;
          }
          if (step.pattern)
            split_by_pattern(*step.pattern, Behavior::Isolated, false, prefixed, next);
          else
            next.push_back(prefixed);
          break;
        }
        case Step::Kind::Metaspace: {
          std::string replaced = replace_literal(piece.text, " ", step.replacement);
          const bool starts_with_replacement = replaced.compare(0, step.replacement.size(), step.replacement) == 0;
          const bool prepend = !starts_with_replacement && (step.prepend == Prepend::Always ||
                                                            (step.prepend == Prepend::First && piece.at_input_start));
          if (prepend) replaced.insert(0, step.replacement);
          storage.push_back(std::move(replaced));
          const Piece replaced_piece{storage.back(), piece.at_input_start};
          if (step.pattern) {
            split_by_pattern(*step.pattern, Behavior::MergedWithNext, false, replaced_piece, next);
          } else {
            next.push_back(replaced_piece);
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
  for (const Piece& piece : pieces) words.push_back(piece.text);
}

}  // namespace kiln
