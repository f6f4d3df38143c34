#include "text/tool_call_reader.h"

#include <algorithm>

namespace kiln {

namespace {

using json = nlohmann::ordered_json;

constexpr std::string_view kFunctionOpen = "<function=", kFunctionClose = "</function>";
constexpr std::string_view kParameterOpen = "<parameter=", kParameterClose = "</parameter>";
constexpr std::string_view kParamOpen = "<param name=", kParamClose = "</param>";
constexpr std::string_view kCdataOpen = "<![CDATA[", kCdataClose = "]]>";

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

size_t skip_spaces(std::string_view text, size_t at) {
  while (at < text.size() && is_space(text[at])) ++at;
  return at;
}

bool only_spaces(std::string_view text) { return std::all_of(text.begin(), text.end(), is_space); }

// Whether `text` could still grow into `marker` (it is a proper beginning of it).
bool may_become(std::string_view text, std::string_view marker) {
  return text.size() < marker.size() && marker.substr(0, text.size()) == text;
}

// A JSON string's value from its text (quotes included), or nothing.
std::optional<std::string> json_string(const std::string& text) {
  const json parsed = json::parse(text, nullptr, false);
  if (parsed.is_discarded() || !parsed.is_string()) return std::nullopt;
  return parsed.get<std::string>();
}

// The `properties` of the tool named `name` in OpenAI's shape, or null.
const json* tool_properties(const json* tools, const std::string& name) {
  if (!tools || !tools->is_array()) return nullptr;
  for (const json& tool : *tools) {
    const json& spec = tool.contains("function") ? tool["function"] : tool;
    if (spec.is_object() && spec.value("name", "") == name && spec.contains("parameters") &&
        spec["parameters"].is_object() && spec["parameters"].contains("properties") &&
        spec["parameters"]["properties"].is_object())
      return &spec["parameters"]["properties"];
  }
  return nullptr;
}

// An XML parameter's value typed by its property's schema: a string where the property's type
// allows one (or names none), else the value parsed as JSON when it parses.
json typed_value(const json* properties, const std::string& key, const std::string& value) {
  const bool as_string = !properties || !properties->contains(key) || xml_value_is_string((*properties)[key]);
  if (!as_string) {
    json parsed = json::parse(value, nullptr, false);
    if (!parsed.is_discarded()) return parsed;
  }
  return value;
}

// A quoted attribute value at `at` ("…" or '…'): the value and the position past its closing quote;
// nothing while the text may still complete it; `broken` where it cannot.
struct Quoted {
  std::string value;
  size_t end = 0;
};
std::optional<Quoted> quoted(std::string_view text, size_t at, bool& broken) {
  if (at >= text.size()) return std::nullopt;
  if (text[at] != '"' && text[at] != '\'') {
    broken = true;
    return std::nullopt;
  }
  const size_t end = text.find(text[at], at + 1);
  if (end == std::string_view::npos) return std::nullopt;
  return Quoted{std::string(text.substr(at + 1, end - at - 1)), end + 1};
}

}  // namespace

bool xml_value_is_string(const json& property) {
  if (!property.is_object()) return true;
  const json& type = property.value("type", json());
  if (type.is_string()) return type.get<std::string>() == "string";
  if (type.is_array()) return std::find(type.begin(), type.end(), "string") != type.end();
  return true;
}

ToolCallReader::ToolCallReader(ToolCallSyntax syntax, std::shared_ptr<const json> tools)
    : syntax_(syntax), tools_(std::move(tools)) {}

void ToolCallReader::read(std::string_view text) {
  if (broken_) return;
  switch (syntax_) {
    case ToolCallSyntax::Hermes:
    case ToolCallSyntax::LlamaJson:
      for (char byte : text) {
        read_json(byte);
        if (broken_) return;
      }
      return;
    case ToolCallSyntax::QwenXml:
      text_ += text;
      read_qwen_xml();
      return;
    case ToolCallSyntax::MiniCpmXml:
      text_ += text;
      read_minicpm_xml();
      return;
    case ToolCallSyntax::None: broken_ = true; return;
  }
}

void ToolCallReader::end() {
  if (!broken_) {
    if (syntax_ == ToolCallSyntax::Hermes || syntax_ == ToolCallSyntax::LlamaJson)
      end_json();
    else
      end_xml();
  }
  broken_ = !complete_;
}

void ToolCallReader::name_function(std::string name) {
  properties_ = tool_properties(tools_.get(), name);
  name_ = std::move(name);
}

// --- Hermes and Llama JSON: {"name": N, "arguments" (or "parameters"): {…}} ---

void ToolCallReader::read_json(char byte) {
  const bool was_in_string = scanner_.in_string();
  const size_t depth_before = scanner_.depth();
  const JsonScanner::Byte taken = scanner_.take(byte);
  // The call is one object.
  if (taken == JsonScanner::Byte::Refused || (depth_before == 0 && taken == JsonScanner::Byte::Taken && byte != '{')) {
    broken_ = true;
    return;
  }
  // A key of the call's object begins: the member before it, whatever it was, is over.
  if (scanner_.depth() == 1 && scanner_.in_key() && !was_in_string) {
    member_ = Member::Key;
    raw_ = byte;
    return;
  }
  switch (member_) {
    case Member::Between:
    case Member::Other: return;
    case Member::Key:
      raw_ += byte;
      if (scanner_.in_string()) return;
      key_ = json_string(raw_).value_or("");
      member_ = Member::BeforeValue;
      return;
    case Member::BeforeValue:
      if (taken == JsonScanner::Byte::Taken && byte != ':') start_json_value(byte);
      return;
    case Member::Name:
      raw_ += byte;
      if (scanner_.in_string()) return;
      if (auto name = json_string(raw_); name && !name->empty())
        name_function(std::move(*name));
      else
        broken_ = true;
      member_ = Member::Between;
      return;
    case Member::Arguments:
      if (taken == JsonScanner::Byte::Taken) arguments_ += byte;
      if (scanner_.depth() == 1) member_ = Member::Between;  // the arguments object closed
      return;
    case Member::QuotedArguments: {
      raw_ += byte;
      if (scanner_.in_string()) return;
      member_ = Member::Between;
      // Arguments some models quote: a JSON string holding the object, which is checked as the
      // object is, now that it is whole.
      const std::optional<std::string> text = json_string(raw_);
      JsonScanner object;
      std::string compact;
      for (char inner : text.value_or("")) {
        const JsonScanner::Byte inner_taken = object.take(inner);
        if (inner_taken == JsonScanner::Byte::Refused ||
            (inner_taken == JsonScanner::Byte::Taken && compact.empty() && inner != '{')) {
          broken_ = true;
          return;
        }
        if (inner_taken == JsonScanner::Byte::Taken) compact += inner;
      }
      if (!object.complete()) {
        broken_ = true;
        return;
      }
      arguments_ += compact;
      return;
    }
  }
}

// The first byte of the value of member `key_`.
void ToolCallReader::start_json_value(char byte) {
  member_ = Member::Other;
  if (key_ == "name" && !name_) {
    if (byte != '"') {
      broken_ = true;
      return;
    }
    member_ = Member::Name;
    raw_ = byte;
    return;
  }
  // Hermes templates name the member "arguments" and Llama's "parameters"; models write either.
  if ((key_ == "arguments" || key_ == "parameters") && !has_arguments_) {
    has_arguments_ = true;
    if (byte == '{') {
      member_ = Member::Arguments;
      arguments_ += byte;
    } else if (byte == '"') {
      member_ = Member::QuotedArguments;
      raw_ = byte;
    } else {
      broken_ = true;
    }
  }
}

void ToolCallReader::end_json() {
  complete_ = scanner_.complete() && name_.has_value();
  // A call without arguments takes none.
  if (complete_ && !has_arguments_) arguments_ += "{}";
}

// --- XML: the arguments built as an object, a parameter at a time ---

void ToolCallReader::add_parameter(const std::string& key, const std::string& value) {
  if (parameters_++ > 0) arguments_ += ',';
  // Text that is not UTF-8 (the decoder replaces such bytes, but a reader takes any text) gets
  // U+FFFD rather than an exception.
  constexpr auto kReplace = json::error_handler_t::replace;
  arguments_ += json(key).dump(-1, ' ', false, kReplace) + ':' +
                typed_value(properties_, key, value).dump(-1, ' ', false, kReplace);
}

// <function=N>\n<parameter=K>\nV\n</parameter>\n…</function>, spaces between elements.
void ToolCallReader::read_qwen_xml() {
  while (!broken_) {
    parsed_ = skip_spaces(text_, parsed_);
    const std::string_view rest = std::string_view(text_).substr(parsed_);
    if (rest.empty()) return;
    if (function_closed_) {
      broken_ = true;  // text after the function
      return;
    }
    const std::string_view open = name_ ? kParameterOpen : kFunctionOpen;
    if (name_ && rest.starts_with(kFunctionClose)) {
      arguments_ += '}';
      function_closed_ = true;
      parsed_ += kFunctionClose.size();
      continue;
    }
    if (!rest.starts_with(open)) {
      broken_ = !may_become(rest, open) && !(name_ && may_become(rest, kFunctionClose));
      return;
    }
    const size_t name_end = text_.find('>', parsed_ + open.size());
    if (name_end == std::string::npos) return;
    std::string name = text_.substr(parsed_ + open.size(), name_end - parsed_ - open.size());
    if (name.empty()) {
      broken_ = true;
      return;
    }
    if (!name_) {
      name_function(std::move(name));
      arguments_ += '{';
      parsed_ = name_end + 1;
      continue;
    }
    const size_t value_start = name_end + 1;
    const size_t close = text_.find(kParameterClose, std::max(value_start, search_from_));
    if (close == std::string::npos) {
      // The end may begin in the last few bytes: the next search starts there.
      search_from_ = text_.size() - std::min(text_.size(), kParameterClose.size() - 1);
      return;
    }
    std::string_view value = std::string_view(text_).substr(value_start, close - value_start);
    // The template writes a newline after the opening tag and before the closing one.
    if (value.starts_with('\n')) value.remove_prefix(1);
    if (value.ends_with('\n')) value.remove_suffix(1);
    add_parameter(name, std::string(value));
    parsed_ = close + kParameterClose.size();
  }
}

// "N"><param name="K">V</param>… (what follows `<function name=`, up to `</function>`); a value
// with <, & or a newline in <![CDATA[…]]>.
void ToolCallReader::read_minicpm_xml() {
  while (!broken_) {
    if (!name_) {
      const std::optional<Quoted> name = quoted(text_, 0, broken_);
      if (!name || name->end >= text_.size()) return;
      if (text_[name->end] != '>' || name->value.empty()) {
        broken_ = true;
        return;
      }
      name_function(name->value);
      arguments_ += '{';
      parsed_ = name->end + 1;
      continue;
    }
    parsed_ = skip_spaces(text_, parsed_);
    const std::string_view rest = std::string_view(text_).substr(parsed_);
    if (rest.empty()) return;
    if (!rest.starts_with(kParamOpen)) {
      broken_ = !may_become(rest, kParamOpen);
      return;
    }
    const std::optional<Quoted> key = quoted(text_, parsed_ + kParamOpen.size(), broken_);
    if (!key || key->end >= text_.size()) return;
    if (text_[key->end] != '>') {
      broken_ = true;
      return;
    }
    const size_t value_start = key->end + 1;
    const std::string_view value_text = std::string_view(text_).substr(value_start);
    if (may_become(value_text, kCdataOpen)) return;
    std::string value;
    size_t close;
    if (value_text.starts_with(kCdataOpen)) {
      const size_t cdata_end = text_.find(kCdataClose, value_start + kCdataOpen.size());
      if (cdata_end == std::string::npos) return;
      value = text_.substr(value_start + kCdataOpen.size(), cdata_end - value_start - kCdataOpen.size());
      close = cdata_end + kCdataClose.size();
      const std::string_view after = std::string_view(text_).substr(close);
      if (may_become(after, kParamClose)) return;
      if (!after.starts_with(kParamClose)) {
        broken_ = true;
        return;
      }
    } else {
      close = text_.find(kParamClose, value_start);
      if (close == std::string::npos) return;
      value = text_.substr(value_start, close - value_start);
    }
    add_parameter(key->value, value);
    parsed_ = close + kParamClose.size();
  }
}

void ToolCallReader::end_xml() {
  if (!name_) return;
  if (syntax_ == ToolCallSyntax::QwenXml) {
    complete_ = function_closed_ && only_spaces(std::string_view(text_).substr(parsed_));
    return;
  }
  // A MiniCPM call's text ends at its </function>: everything in it must have been parameters.
  complete_ = only_spaces(std::string_view(text_).substr(parsed_));
  if (complete_) arguments_ += '}';
}

}  // namespace kiln
