#include "tokenizer/normalizer.h"

#include "core/error.h"

namespace kiln {

std::shared_ptr<const Regex> pattern_from_json(const nlohmann::json& pattern, const std::string& where) {
  if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string())
    return std::make_shared<const Regex>(Regex::escape(pattern["String"].get<std::string>()), where);
  if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string())
    return std::make_shared<const Regex>(pattern["Regex"].get<std::string>(), where);
  fail("{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}, got {}", where, pattern.dump());
}

std::string replace_all(const Regex& pattern, std::string_view text, std::string_view replacement) {
  std::string out;
  out.reserve(text.size());
  size_t copied = 0;
  pattern.for_each_match(text, [&](size_t begin, size_t end) {
    out.append(text.substr(copied, begin - copied));
    out.append(replacement);
    copied = end;
  });
  out.append(text.substr(copied));
  return out;
}

std::string replace_literal(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(text.size());
  size_t copied = 0;
  for (size_t found = text.find(from); found != std::string_view::npos; found = text.find(from, copied)) {
    out.append(text.substr(copied, found - copied));
    out.append(to);
    copied = found + from.size();
  }
  out.append(text.substr(copied));
  return out;
}

Normalizer Normalizer::from_json(const nlohmann::json& spec, const std::string& where) {
  Normalizer normalizer;
  if (!spec.is_null()) normalizer.add(spec, where);
  return normalizer;
}

void Normalizer::add(const nlohmann::json& spec, const std::string& where) {
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string())
    fail("{}: expected an object with a \"type\"", where);
  const std::string type = spec["type"];
  const std::string here = where + " (" + type + ")";
  if (type == "Sequence") {
    if (!spec.contains("normalizers") || !spec["normalizers"].is_array())
      fail("{}: \"normalizers\" must be a list", here);
    for (const auto& child : spec["normalizers"]) add(child, where);
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    const unicode::NormalForm form = type == "NFC"    ? unicode::NormalForm::Nfc
                                     : type == "NFD"  ? unicode::NormalForm::Nfd
                                     : type == "NFKC" ? unicode::NormalForm::Nfkc
                                                      : unicode::NormalForm::Nfkd;
    Step step;
    step.form = form;
    steps_.push_back(std::move(step));
  } else if (type == "Prepend") {
    if (!spec.contains("prepend") || !spec["prepend"].is_string()) fail("{}: \"prepend\" must be a string", here);
    Step step;
    step.kind = Kind::Prepend;
    step.text = spec["prepend"].get<std::string>();
    steps_.push_back(std::move(step));
  } else if (type == "Replace") {
    if (!spec.contains("content") || !spec["content"].is_string()) fail("{}: \"content\" must be a string", here);
    const nlohmann::json pattern = spec.value("pattern", nlohmann::json());
    Step step;
    step.kind = Kind::Replace;
    step.text = spec["content"].get<std::string>();
    if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      step.literal = pattern["String"].get<std::string>();
      if (step.literal.empty()) fail("{}: an empty String pattern is not supported", here);
    } else {
      step.pattern = pattern_from_json(pattern, here + " pattern");
    }
    steps_.push_back(std::move(step));
  } else {
    fail("{}: normalizer type \"{}\" is not supported (supported: NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence)",
         where, type);
  }
}

std::string Normalizer::apply(std::string_view text) const {
  std::string current(text);
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Kind::Normalize:
        current = unicode::normalize(current, step.form);
        break;
      case Kind::Prepend:
        // Hugging Face prepends only to non-empty text (normalizers/prepend.rs).
        if (!current.empty()) current.insert(0, step.text);
        break;
      case Kind::Replace:
        current = step.pattern ? replace_all(*step.pattern, current, step.text)
                               : replace_literal(current, step.literal, step.text);
        break;
    }
  }
  return current;
}

}  // namespace kiln
