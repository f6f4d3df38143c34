#include "tokenizer/jinja_builtins.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace kiln::jinja {

namespace {

using Arguments = CallArguments;

// ---------------------------------------------------------------- argument helpers

// The argument at `index` or named `name`, else `fallback` (Undefined when absent and required).
Value argument(const Arguments& arguments, size_t index, std::string_view name, const Value& fallback = Value()) {
  if (index < arguments.positional.size()) return arguments.positional[index];
  for (const auto& [key, value] : arguments.keyword)
    if (key == name) return value;
  return fallback;
}

void check_arguments(const Arguments& arguments, size_t max_positional, std::initializer_list<std::string_view> names,
                     std::string_view function, const Location& at) {
  if (arguments.positional.size() > max_positional)
    at.error(fmt::format("{}() takes at most {} positional arguments ({} given)", function, max_positional,
                         arguments.positional.size()));
  for (const auto& [key, value] : arguments.keyword)
    if (std::find(names.begin(), names.end(), key) == names.end())
      at.error(fmt::format("{}() got an unexpected keyword argument '{}'", function, key));
}

const std::string& need_string(const Value& value, std::string_view what, const Location& at) {
  if (!value.is_string()) at.error(fmt::format("{} must be a string, not {}", what, value.type_name()));
  return value.string();
}

int64_t need_int(const Value& value, std::string_view what, const Location& at) {
  if (!value.is_int() && !value.is_bool())
    at.error(fmt::format("{} must be an integer, not {}", what, value.type_name()));
  return value.integer();
}

[[noreturn]] void undefined_error(const Value& value, const Location& at) {
  at.error(value.undefined_description().empty() ? "use of an undefined value" : value.undefined_description());
}

// ---------------------------------------------------------------- strings

std::u32string decode(const std::string& text) {
  std::u32string out;
  size_t offset = 0;
  while (offset < text.size()) out.push_back(unicode::next_code_point(text, offset));
  return out;
}

size_t count_code_points(const std::string& text) {
  return static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char c) { return (c & 0xC0) != 0x80; }));
}

// Appends to a list being built, checking its size as Value(List) will count it, before it grows.
void append_item(List& items, uint64_t& bytes, Value item, const Location& at, std::string_view what) {
  at.grow(bytes, sizeof(Value) + item.bytes(), what);
  bytes += sizeof(Value) + item.bytes();
  items.push_back(std::move(item));
}

// size * times, saturated past kMaxValueBytes (what Location::grow then refuses).
uint64_t repeated_size(uint64_t size, uint64_t times) {
  if (size != 0 && times > kMaxValueBytes / size) return kMaxValueBytes + 1;
  return size * times;
}

std::string encode(const std::u32string& text) {
  std::string out;
  for (char32_t c : text) unicode::append_utf8(out, c);
  return out;
}

// Python's str.isspace(): White_Space plus the information separators U+001C..U+001F.
bool python_space(char32_t c) { return unicode::is_white_space(c) || (c >= 0x1C && c <= 0x1F); }

char32_t to_upper(char32_t c) { return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))); }
char32_t to_lower(char32_t c) { return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))); }
bool is_cased(char32_t c) { return to_upper(c) != c || to_lower(c) != c; }

std::string map_characters(const std::string& text, char32_t (*mapping)(char32_t)) {
  std::u32string characters = decode(text);
  for (char32_t& c : characters) c = mapping(c);
  return encode(characters);
}

// str.strip / lstrip / rstrip with Python's whitespace or the given characters.
std::string strip(const std::string& text, const Value& characters, bool left, bool right, const Location& at) {
  const std::u32string value = decode(text);
  std::u32string set;
  if (!characters.is_none() && !characters.is_undefined())
    set = decode(need_string(characters, "strip characters", at));
  auto strippable = [&](char32_t c) {
    return characters.is_none() || characters.is_undefined() ? python_space(c) : set.find(c) != std::u32string::npos;
  };
  size_t begin = 0, end = value.size();
  if (left)
    while (begin < end && strippable(value[begin])) ++begin;
  if (right)
    while (end > begin && strippable(value[end - 1])) --end;
  return encode(value.substr(begin, end - begin));
}

List split(const std::string& text, const Value& separator, int64_t max_splits, const Location& at) {
  List parts;
  uint64_t bytes = 0;
  if (separator.is_none() || separator.is_undefined()) {
    // Runs of whitespace separate; leading and trailing whitespace give no empty parts.
    const std::u32string value = decode(text);
    size_t i = 0;
    int64_t splits = 0;
    while (i < value.size()) {
      while (i < value.size() && python_space(value[i])) ++i;
      if (i == value.size()) break;
      if (max_splits >= 0 && splits == max_splits) {
        size_t end = value.size();
        while (end > i && python_space(value[end - 1])) --end;
        append_item(parts, bytes, Value(encode(value.substr(i, end - i))), at, "the split result");
        break;
      }
      size_t j = i;
      while (j < value.size() && !python_space(value[j])) ++j;
      append_item(parts, bytes, Value(encode(value.substr(i, j - i))), at, "the split result");
      ++splits;
      i = j;
    }
    return parts;
  }
  const std::string& sep = need_string(separator, "split separator", at);
  if (sep.empty()) at.error("empty separator");
  size_t start = 0;
  int64_t splits = 0;
  while (max_splits < 0 || splits < max_splits) {
    const size_t found = text.find(sep, start);
    if (found == std::string::npos) break;
    append_item(parts, bytes, Value(text.substr(start, found - start)), at, "the split result");
    start = found + sep.size();
    ++splits;
  }
  append_item(parts, bytes, Value(text.substr(start)), at, "the split result");
  return parts;
}

std::string replace(const std::string& text, const std::string& old, const std::string& replacement, int64_t count,
                    const Location& at) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement around every character.
    const std::u32string characters = decode(text);
    int64_t done = 0;
    for (char32_t c : characters) {
      if (count < 0 || done < count) {
        at.grow(out.size(), replacement.size(), "the replaced string");
        out += replacement;
        ++done;
      }
      unicode::append_utf8(out, c);
    }
    if (count < 0 || done < count) {
      at.grow(out.size(), replacement.size(), "the replaced string");
      out += replacement;
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t found = text.find(old, start);
    if (found == std::string::npos) break;
    at.grow(out.size(), found - start + replacement.size(), "the replaced string");
    out.append(text, start, found - start);
    out += replacement;
    start = found + old.size();
    ++done;
  }
  out.append(text, start);
  return out;
}

std::string capitalize(const std::string& text) {
  std::u32string characters = decode(text);
  for (size_t i = 0; i < characters.size(); ++i)
    characters[i] = i == 0 ? to_upper(characters[i]) : to_lower(characters[i]);
  return encode(characters);
}

// str.title(): a cased character after an uncased one starts a word.
std::string title_method(const std::string& text) {
  std::u32string characters = decode(text);
  bool previous_cased = false;
  for (char32_t& c : characters) {
    c = previous_cased ? to_lower(c) : to_upper(c);
    previous_cased = is_cased(c);
  }
  return encode(characters);
}

// Jinja2's title filter: words begin after '-', whitespace, '(', '{', '[' or '<'.
std::string title_filter(const std::string& text) {
  std::u32string characters = decode(text);
  bool word_start = true;
  for (char32_t& c : characters) {
    const bool separator = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || python_space(c);
    if (separator) {
      word_start = true;
      continue;
    }
    c = word_start ? to_upper(c) : to_lower(c);
    word_start = false;
  }
  return encode(characters);
}

// str.format with {} / {0} / {name} fields (no format specs) and {{ }} escapes.
std::string format_string(const std::string& pattern, const Arguments& arguments, const Location& at) {
  std::string out;
  size_t next_automatic = 0;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '{' && i + 1 < pattern.size() && pattern[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (c == '}' && i + 1 < pattern.size() && pattern[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (c == '{') {
      const size_t close = pattern.find('}', i);
      if (close == std::string::npos) at.error("format string has an unmatched '{'");
      const std::string field = pattern.substr(i + 1, close - i - 1);
      if (field.find_first_of(":!") != std::string::npos)
        at.error("format specifications are not supported: {" + field + "}");
      Value value;
      if (field.empty()) {
        if (next_automatic >= arguments.positional.size()) at.error("format string needs more arguments");
        value = arguments.positional[next_automatic++];
      } else if (std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
        const size_t index = std::stoul(field);
        if (index >= arguments.positional.size()) at.error("format string needs more arguments");
        value = arguments.positional[index];
      } else {
        value = argument(arguments, SIZE_MAX, field);
        if (value.is_undefined()) at.error("format string names a missing argument '" + field + "'");
      }
      const std::string text = value.str();
      at.grow(out.size(), text.size(), "the formatted string");
      out += text;
      i = close;
    } else if (c == '}') {
      at.error("format string has an unmatched '}'");
    } else {
      out += c;
    }
  }
  return out;
}

List split_lines(const std::string& text, const Location& at) {
  List lines;
  uint64_t bytes = 0;
  const std::u32string characters = decode(text);
  size_t start = 0;
  for (size_t i = 0; i < characters.size(); ++i) {
    const char32_t c = characters[i];
    const bool line_break = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) || c == 0x85 ||
                            c == 0x2028 || c == 0x2029;
    if (!line_break) continue;
    append_item(lines, bytes, Value(encode(characters.substr(start, i - start))), at, "the split lines");
    if (c == '\r' && i + 1 < characters.size() && characters[i + 1] == '\n') ++i;
    start = i + 1;
  }
  if (start < characters.size())
    append_item(lines, bytes, Value(encode(characters.substr(start))), at, "the split lines");
  return lines;
}

// ---------------------------------------------------------------- methods

Value bound_method(const Value& self, const std::string& name);

Value call_string_method(const std::string& self, const std::string& name, Arguments& arguments, const Location& at) {
  at.charge(self.size() / kBytesPerStep);
  if (name == "startswith" || name == "endswith") {
    check_arguments(arguments, 1, {}, name, at);
    const Value affix = argument(arguments, 0, "");
    List candidates = affix.is_list() ? affix.list() : List{affix};
    for (const Value& candidate : candidates) {
      const std::string& text = need_string(candidate, name + " argument", at);
      const bool match = name == "startswith" ? self.compare(0, text.size(), text) == 0 && self.size() >= text.size()
                                              : self.size() >= text.size() &&
                                                    self.compare(self.size() - text.size(), text.size(), text) == 0;
      if (match) return Value(true);
    }
    return Value(false);
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    check_arguments(arguments, 1, {}, name, at);
    return Value(strip(self, argument(arguments, 0, "chars", Value::none()), name != "rstrip", name != "lstrip", at));
  }
  if (name == "split") {
    check_arguments(arguments, 2, {"sep", "maxsplit"}, name, at);
    return Value(split(self, argument(arguments, 0, "sep", Value::none()),
                       need_int(argument(arguments, 1, "maxsplit", Value(-1)), "maxsplit", at), at));
  }
  if (name == "splitlines") {
    check_arguments(arguments, 0, {}, name, at);
    return Value(split_lines(self, at));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    check_arguments(arguments, 0, {}, name, at);
    if (name == "upper") return Value(map_characters(self, to_upper));
    if (name == "lower") return Value(map_characters(self, to_lower));
    if (name == "title") return Value(title_method(self));
    return Value(capitalize(self));
  }
  if (name == "replace") {
    check_arguments(arguments, 3, {}, name, at);
    return Value(replace(self, need_string(argument(arguments, 0, ""), "replace argument", at),
                         need_string(argument(arguments, 1, ""), "replace argument", at),
                         need_int(argument(arguments, 2, "", Value(-1)), "replace count", at), at));
  }
  if (name == "find" || name == "count") {
    check_arguments(arguments, 1, {}, name, at);
    const std::string& needle = need_string(argument(arguments, 0, ""), name + " argument", at);
    if (name == "find") {
      const size_t found = self.find(needle);
      if (found == std::string::npos) return Value(-1);
      size_t characters = 0;  // Python counts characters, not bytes
      for (size_t i = 0; i < found; ++i) characters += (static_cast<unsigned char>(self[i]) & 0xC0) != 0x80;
      return Value(static_cast<int64_t>(characters));
    }
    if (needle.empty()) return Value(static_cast<int64_t>(count_code_points(self) + 1));
    int64_t count = 0;
    for (size_t found = self.find(needle); found != std::string::npos; found = self.find(needle, found + needle.size()))
      ++count;
    return Value(count);
  }
  if (name == "join") {
    check_arguments(arguments, 1, {}, name, at);
    std::string out;
    const List items = iterate(argument(arguments, 0, ""), at);
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string& item = need_string(items[i], "join item", at);
      at.grow(out.size(), (i ? self.size() : 0) + item.size(), "the joined string");
      if (i) out += self;
      out += item;
    }
    return Value(std::move(out));
  }
  if (name == "format") return Value(format_string(self, arguments, at));
  at.error("'str' object has no attribute '" + name + "'");
}

Value call_dict_method(const Value& self, const std::string& name, Arguments& arguments, const Location& at) {
  const Dict& dict = self.dict();
  if (name == "items" || name == "keys" || name == "values") {
    check_arguments(arguments, 0, {}, name, at);
    List out;
    for (const auto& [key, value] : dict.entries) {
      if (name == "items")
        out.emplace_back(List{Value(key), value});
      else if (name == "keys")
        out.emplace_back(key);
      else
        out.push_back(value);
    }
    return Value(std::move(out));
  }
  if (name == "get") {
    check_arguments(arguments, 2, {}, name, at);
    const Value key = argument(arguments, 0, "");
    if (key.is_string())
      if (const Value* found = dict.find(key.string())) return *found;
    return argument(arguments, 1, "", Value::none());
  }
  at.error("'dict' object has no attribute '" + name + "'");
}

bool is_string_method(const std::string& name) {
  static const std::vector<std::string> kNames = {"startswith", "endswith", "strip", "lstrip", "rstrip",     "split",
                                                  "splitlines", "upper",    "lower", "title",  "capitalize", "replace",
                                                  "find",       "count",    "join",  "format"};
  return std::find(kNames.begin(), kNames.end(), name) != kNames.end();
}

bool is_dict_method(const std::string& name) {
  return name == "items" || name == "keys" || name == "values" || name == "get";
}

Value bound_method(const Value& self, const std::string& name) {
  return Value(Function{name, [self, name](Arguments& arguments) {
                          return self.is_string() ? call_string_method(self.string(), name, arguments, arguments.at)
                                                  : call_dict_method(self, name, arguments, arguments.at);
                        }});
}

// ---------------------------------------------------------------- comparisons and sorting

// Python's < for numbers, strings and lists.
bool less_than(const Value& left, const Value& right, const Location& at) {
  if (left.is_number() && right.is_number()) {
    if (left.is_float() || right.is_float()) return left.number() < right.number();
    return left.integer() < right.integer();
  }
  if (left.is_string() && right.is_string()) return left.string() < right.string();  // UTF-8 order is code point order
  if (left.is_list() && right.is_list()) {
    const List& a = left.list();
    const List& b = right.list();
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      if (a[i] == b[i]) continue;
      return less_than(a[i], b[i], at);
    }
    return a.size() < b.size();
  }
  at.error(fmt::format("'<' not supported between instances of '{}' and '{}'", left.type_name(), right.type_name()));
}

// The comparisons a sort of `count` items makes, at most.
uint64_t sort_steps(size_t count) {
  uint64_t steps = count;
  for (size_t n = count; n > 1; n /= 2) steps += count;
  return steps;
}

// A sort key: lowercased strings unless case_sensitive (Jinja2's ignore_case).
Value sort_key(const Value& value, bool case_sensitive) {
  if (!case_sensitive && value.is_string()) return Value(map_characters(value.string(), to_lower));
  return value;
}

Value attribute_path(const Value& value, const Value& attribute, const Location& at) {
  if (attribute.is_int()) return get_item(value, attribute, at);
  Value current = value;
  for (const Value& part : split(need_string(attribute, "attribute", at), Value("."), -1, at)) {
    const std::string& name = part.string();
    const bool numeric =
        !name.empty() && std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
    current =
        numeric ? get_item(current, Value(static_cast<int64_t>(std::stoll(name))), at) : get_item(current, part, at);
  }
  return current;
}

// ---------------------------------------------------------------- filters

using FilterFunction = std::function<Value(const Value&, Arguments&, const Location&)>;

Value length_of(const Value& value, const Location& at) {
  switch (value.kind()) {
    case Value::Kind::Undefined:
      return Value(0);
    case Value::Kind::String:
      return Value(static_cast<int64_t>(count_code_points(value.string())));
    case Value::Kind::List:
      return Value(static_cast<int64_t>(value.list().size()));
    case Value::Kind::Dict:
      return Value(static_cast<int64_t>(value.dict().entries.size()));
    default:
      at.error(fmt::format("object of type '{}' has no len()", value.type_name()));
  }
}

std::string soft_string(const Value& value) { return value.str(); }

Value select_or_reject(const Value& input, Arguments& arguments, const Location& at, bool select, bool by_attribute) {
  List out;
  const Value attribute = by_attribute ? argument(arguments, 0, "") : Value();
  if (by_attribute && attribute.is_undefined()) at.error("selectattr/rejectattr need an attribute");
  const size_t test_index = by_attribute ? 1 : 0;
  const Value test_name = test_index < arguments.positional.size() ? arguments.positional[test_index] : Value();
  Arguments test_arguments;
  test_arguments.at = arguments.at;
  for (size_t i = test_index + 1; i < arguments.positional.size(); ++i)
    test_arguments.positional.push_back(arguments.positional[i]);
  for (const Value& item : iterate(input, at)) {
    const Value subject = by_attribute ? attribute_path(item, attribute, at) : item;
    bool passes;
    if (test_name.is_undefined()) {
      passes = subject.truthy();
    } else {
      Arguments copy = test_arguments;
      passes = apply_test(need_string(test_name, "test name", at), subject, copy, at);
    }
    if (passes == select) out.push_back(item);
  }
  return Value(std::move(out));
}

JsonFormat json_format(const Arguments& arguments, const Location& at) {
  JsonFormat format;
  const Value indent = argument(arguments, 0, "indent", Value::none());
  if (indent.is_int() && indent.integer() > static_cast<int64_t>(kMaxValueBytes))
    at.grow(0, static_cast<uint64_t>(indent.integer()), "the tojson indent");
  if (indent.is_int())
    format.indent = static_cast<int>(indent.integer());
  else if (indent.is_string())
    at.error("tojson indent must be an integer");
  const Value ensure_ascii = argument(arguments, SIZE_MAX, "ensure_ascii", Value(false));
  format.ensure_ascii = ensure_ascii.truthy();
  const Value separators = argument(arguments, SIZE_MAX, "separators", Value::none());
  if (separators.is_list()) {
    if (separators.list().size() != 2) at.error("tojson separators must be a pair");
    format.separators_given = true;
    format.item_separator = need_string(separators.list()[0], "separator", at);
    format.key_separator = need_string(separators.list()[1], "separator", at);
  }
  format.sort_keys = argument(arguments, SIZE_MAX, "sort_keys", Value(false)).truthy();
  return format;
}

const std::map<std::string, FilterFunction, std::less<>>& filters() {
  static const std::map<std::string, FilterFunction, std::less<>> table = [] {
    std::map<std::string, FilterFunction, std::less<>> t;
    t["abs"] = [](const Value& v, Arguments&, const Location& at) -> Value {
      if (v.is_float()) return Value(std::fabs(v.number()));
      if (v.is_number()) return Value(std::abs(v.integer()));
      at.error("bad operand type for abs(): '" + v.type_name() + "'");
    };
    t["capitalize"] = [](const Value& v, Arguments&, const Location&) { return Value(capitalize(soft_string(v))); };
    t["length"] = [](const Value& v, Arguments&, const Location& at) { return length_of(v, at); };
    t["count"] = t["length"];
    t["default"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 2, {"default_value", "boolean"}, "default", at);
      const bool use_default = v.is_undefined() || (argument(a, 1, "boolean", Value(false)).truthy() && !v.truthy());
      return use_default ? argument(a, 0, "default_value", Value("")) : v;
    };
    t["d"] = t["default"];
    t["dictsort"] = [](const Value& v, Arguments& a, const Location& at) {
      if (!v.is_dict()) at.error("dictsort needs a dict, not " + v.type_name());
      const bool case_sensitive = argument(a, 0, "case_sensitive", Value(false)).truthy();
      const std::string by = argument(a, 1, "by", Value("key")).str();
      const bool reverse = argument(a, 2, "reverse", Value(false)).truthy();
      if (by != "key" && by != "value") at.error("dictsort: 'by' must be 'key' or 'value'");
      List items;
      for (const auto& [key, value] : v.dict().entries) items.emplace_back(List{Value(key), value});
      at.charge(sort_steps(items.size()));
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        const size_t index = by == "key" ? 0 : 1;
        const Value kx = sort_key(x.list()[index], case_sensitive), ky = sort_key(y.list()[index], case_sensitive);
        return reverse ? less_than(ky, kx, at) : less_than(kx, ky, at);
      });
      return Value(std::move(items));
    };
    t["first"] = [](const Value& v, Arguments&, const Location& at) {
      const List items = iterate(v, at);
      return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
    };
    t["last"] = [](const Value& v, Arguments&, const Location& at) {
      const List items = iterate(v, at);
      return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
    };
    t["float"] = [](const Value& v, Arguments& a, const Location& at) {
      const Value fallback = argument(a, 0, "default", Value(0.0));
      if (v.is_number()) return Value(v.number());
      if (v.is_string()) {
        const std::string text = strip(v.string(), Value::none(), true, true, at);
        char* end = nullptr;
        const double parsed = std::strtod(text.c_str(), &end);
        if (!text.empty() && end == text.c_str() + text.size()) return Value(parsed);
      }
      return fallback;
    };
    t["int"] = [](const Value& v, Arguments& a, const Location& at) {
      const Value fallback = argument(a, 0, "default", Value(0));
      if (v.is_float()) return Value(static_cast<int64_t>(v.number()));
      if (v.is_number()) return Value(v.integer());
      if (v.is_string()) {
        const std::string text = strip(v.string(), Value::none(), true, true, at);
        char* end = nullptr;
        const long long parsed = std::strtoll(text.c_str(), &end, 10);
        if (!text.empty() && end == text.c_str() + text.size()) return Value(static_cast<int64_t>(parsed));
        const double as_float = std::strtod(text.c_str(), &end);
        if (!text.empty() && end == text.c_str() + text.size()) return Value(static_cast<int64_t>(as_float));
      }
      return fallback;
    };
    t["indent"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 3, {"width", "first", "blank"}, "indent", at);
      const Value width = argument(a, 0, "width", Value(4));
      if (!width.is_string()) at.grow(0, static_cast<uint64_t>(std::max<int64_t>(0, need_int(width, "indent width", at))), "the indent");
      const std::string pad = width.is_string()
                                  ? width.string()
                                  : std::string(static_cast<size_t>(std::max<int64_t>(0, width.integer())), ' ');
      const bool first = argument(a, 1, "first", Value(false)).truthy();
      const bool blank = argument(a, 2, "blank", Value(false)).truthy();
      std::string text = soft_string(v);
      // Jinja2 pads every line but the first (unless `first`), skipping empty lines unless `blank`.
      std::vector<std::string> lines;
      size_t start = 0;
      for (size_t found = text.find('\n'); found != std::string::npos; found = text.find('\n', start)) {
        lines.push_back(text.substr(start, found - start));
        start = found + 1;
      }
      lines.push_back(text.substr(start));
      at.grow(text.size(), repeated_size(pad.size(), lines.size()), "the indented string");
      std::string out;
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i) out += '\n';
        const bool pad_line = i == 0 ? first : (blank || !lines[i].empty());
        if (pad_line) out += pad;
        out += lines[i];
      }
      return Value(out);
    };
    t["items"] = [](const Value& v, Arguments&, const Location& at) {
      if (v.is_undefined()) return Value(List{});
      if (!v.is_dict()) at.error("items needs a dict, not " + v.type_name());
      List items;
      for (const auto& [key, value] : v.dict().entries) items.emplace_back(List{Value(key), value});
      return Value(std::move(items));
    };
    t["join"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 2, {"d", "attribute"}, "join", at);
      const std::string separator = argument(a, 0, "d", Value("")).str();
      const Value attribute = argument(a, 1, "attribute");
      std::string out;
      const List items = iterate(v, at);
      for (size_t i = 0; i < items.size(); ++i) {
        const std::string item = (attribute.is_undefined() ? items[i] : attribute_path(items[i], attribute, at)).str();
        at.grow(out.size(), (i ? separator.size() : 0) + item.size(), "the joined string");
        if (i) out += separator;
        out += item;
      }
      return Value(std::move(out));
    };
    t["list"] = [](const Value& v, Arguments&, const Location& at) { return Value(iterate(v, at)); };
    t["lower"] = [](const Value& v, Arguments&, const Location&) {
      return Value(map_characters(soft_string(v), to_lower));
    };
    t["upper"] = [](const Value& v, Arguments&, const Location&) {
      return Value(map_characters(soft_string(v), to_upper));
    };
    t["title"] = [](const Value& v, Arguments&, const Location&) { return Value(title_filter(soft_string(v))); };
    t["map"] = [](const Value& v, Arguments& a, const Location& at) {
      List out;
      const Value attribute = argument(a, SIZE_MAX, "attribute");
      if (!attribute.is_undefined()) {
        const Value fallback = argument(a, SIZE_MAX, "default");
        for (const Value& item : iterate(v, at)) {
          Value mapped = attribute_path(item, attribute, at);
          out.push_back(mapped.is_undefined() && !fallback.is_undefined() ? fallback : mapped);
        }
        return Value(std::move(out));
      }
      if (a.positional.empty()) at.error("map needs a filter name or attribute=");
      const std::string filter = need_string(a.positional[0], "map filter name", at);
      for (const Value& item : iterate(v, at)) {
        Arguments rest;
        rest.at = a.at;
        rest.positional.assign(a.positional.begin() + 1, a.positional.end());
        rest.keyword = a.keyword;
        out.push_back(apply_filter(filter, item, rest, at));
      }
      return Value(std::move(out));
    };
    auto extreme = [](bool maximum) {
      return [maximum](const Value& v, Arguments& a, const Location& at) {
        check_arguments(a, 2, {"case_sensitive", "attribute"}, maximum ? "max" : "min", at);
        const bool case_sensitive = argument(a, 0, "case_sensitive", Value(false)).truthy();
        const Value attribute = argument(a, 1, "attribute");
        const List items = iterate(v, at);
        if (items.empty()) return Value::undefined(std::string("No aggregated item, sequence was empty."));
        auto key = [&](const Value& item) {
          return sort_key(attribute.is_undefined() ? item : attribute_path(item, attribute, at), case_sensitive);
        };
        size_t best = 0;
        for (size_t i = 1; i < items.size(); ++i) {
          const bool better =
              maximum ? less_than(key(items[best]), key(items[i]), at) : less_than(key(items[i]), key(items[best]), at);
          if (better) best = i;
        }
        return items[best];
      };
    };
    t["max"] = extreme(true);
    t["min"] = extreme(false);
    t["select"] = [](const Value& v, Arguments& a, const Location& at) {
      return select_or_reject(v, a, at, true, false);
    };
    t["reject"] = [](const Value& v, Arguments& a, const Location& at) {
      return select_or_reject(v, a, at, false, false);
    };
    t["selectattr"] = [](const Value& v, Arguments& a, const Location& at) {
      return select_or_reject(v, a, at, true, true);
    };
    t["rejectattr"] = [](const Value& v, Arguments& a, const Location& at) {
      return select_or_reject(v, a, at, false, true);
    };
    t["replace"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 3, {"old", "new", "count"}, "replace", at);
      const Value count = argument(a, 2, "count", Value::none());
      return Value(replace(soft_string(v), argument(a, 0, "old").str(), argument(a, 1, "new").str(),
                           count.is_none() ? -1 : need_int(count, "replace count", at), at));
    };
    t["reverse"] = [](const Value& v, Arguments&, const Location& at) {
      if (v.is_string()) {
        std::u32string characters = decode(v.string());
        std::reverse(characters.begin(), characters.end());
        return Value(encode(characters));
      }
      List items = iterate(v, at);
      std::reverse(items.begin(), items.end());
      return Value(std::move(items));
    };
    t["round"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 2, {"precision", "method"}, "round", at);
      if (!v.is_number()) at.error("round needs a number, not " + v.type_name());
      const int64_t precision = need_int(argument(a, 0, "precision", Value(0)), "round precision", at);
      const std::string method = argument(a, 1, "method", Value("common")).str();
      const double scale = std::pow(10.0, static_cast<double>(precision));
      const double scaled = v.number() * scale;
      double rounded;
      if (method == "common")
        rounded = std::round(scaled);
      else if (method == "ceil")
        rounded = std::ceil(scaled);
      else if (method == "floor")
        rounded = std::floor(scaled);
      else
        at.error("round method must be common, ceil or floor");
      return Value(rounded / scale);
    };
    t["safe"] = [](const Value& v, Arguments&, const Location&) { return v; };
    t["sort"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 3, {"reverse", "case_sensitive", "attribute"}, "sort", at);
      const bool reverse = argument(a, 0, "reverse", Value(false)).truthy();
      const bool case_sensitive = argument(a, 1, "case_sensitive", Value(false)).truthy();
      const Value attribute = argument(a, 2, "attribute");
      List items = iterate(v, at);
      auto key = [&](const Value& item) {
        return sort_key(attribute.is_undefined() ? item : attribute_path(item, attribute, at), case_sensitive);
      };
      at.charge(sort_steps(items.size()));
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        return reverse ? less_than(key(y), key(x), at) : less_than(key(x), key(y), at);
      });
      return Value(std::move(items));
    };
    t["string"] = [](const Value& v, Arguments&, const Location&) { return Value(soft_string(v)); };
    t["sum"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 2, {"attribute", "start"}, "sum", at);
      const Value attribute = argument(a, 0, "attribute");
      Value total = argument(a, 1, "start", Value(0));
      for (const Value& item : iterate(v, at))
        total = binary_operation("+", total, attribute.is_undefined() ? item : attribute_path(item, attribute, at), at);
      return total;
    };
    t["tojson"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 1, {"indent", "ensure_ascii", "separators", "sort_keys"}, "tojson", at);
      try {
        Value json(to_json(v, json_format(a, at)));
        at.charge(json.bytes() / kBytesCopiedPerStep);
        return json;
      } catch (const Error& error) {
        at.error(error.what());
      }
    };
    t["trim"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 1, {"chars"}, "trim", at);
      return Value(strip(soft_string(v), argument(a, 0, "chars", Value::none()), true, true, at));
    };
    t["unique"] = [](const Value& v, Arguments& a, const Location& at) {
      check_arguments(a, 2, {"case_sensitive", "attribute"}, "unique", at);
      const bool case_sensitive = argument(a, 0, "case_sensitive", Value(false)).truthy();
      const Value attribute = argument(a, 1, "attribute");
      List out, seen;
      for (const Value& item : iterate(v, at)) {
        const Value key =
            sort_key(attribute.is_undefined() ? item : attribute_path(item, attribute, at), case_sensitive);
        at.charge(seen.size());
        if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
        seen.push_back(key);
        out.push_back(item);
      }
      return Value(std::move(out));
    };
    t["wordcount"] = [](const Value& v, Arguments&, const Location&) {
      // Jinja2 counts matches of \w+.
      int64_t words = 0;
      bool in_word = false;
      for (char32_t c : decode(soft_string(v))) {
        const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(c));
        const bool word = c == '_' || (category >= UTF8PROC_CATEGORY_LU && category <= UTF8PROC_CATEGORY_NO) ||
                          category == UTF8PROC_CATEGORY_PC;
        if (word && !in_word) ++words;
        in_word = word;
      }
      return Value(words);
    };
    return t;
  }();
  return table;
}

// ---------------------------------------------------------------- tests

using TestFunction = std::function<bool(const Value&, Arguments&, const Location&)>;

const std::map<std::string, TestFunction, std::less<>>& tests() {
  static const std::map<std::string, TestFunction, std::less<>> table = [] {
    std::map<std::string, TestFunction, std::less<>> t;
    auto unary = [](bool (*predicate)(const Value&)) {
      return [predicate](const Value& v, Arguments& a, const Location& at) {
        check_arguments(a, 0, {}, "test", at);
        return predicate(v);
      };
    };
    t["defined"] = unary([](const Value& v) { return !v.is_undefined(); });
    t["undefined"] = unary([](const Value& v) { return v.is_undefined(); });
    t["none"] = unary([](const Value& v) { return v.is_none(); });
    t["boolean"] = unary([](const Value& v) { return v.is_bool(); });
    t["false"] = unary([](const Value& v) { return v.is_bool() && !v.boolean(); });
    t["true"] = unary([](const Value& v) { return v.is_bool() && v.boolean(); });
    t["integer"] = unary([](const Value& v) { return v.is_int(); });
    t["float"] = unary([](const Value& v) { return v.is_float(); });
    t["number"] = unary([](const Value& v) { return v.is_number(); });
    t["string"] = unary([](const Value& v) { return v.is_string(); });
    t["mapping"] = unary([](const Value& v) { return v.is_dict() && !v.is_namespace(); });
    t["iterable"] =
        unary([](const Value& v) { return v.is_string() || v.is_list() || (v.is_dict() && !v.is_namespace()); });
    t["sequence"] =
        unary([](const Value& v) { return v.is_string() || v.is_list() || (v.is_dict() && !v.is_namespace()); });
    t["callable"] = unary([](const Value& v) { return v.is_function(); });
    t["lower"] =
        unary([](const Value& v) { return v.is_string() && map_characters(v.string(), to_lower) == v.string(); });
    t["upper"] =
        unary([](const Value& v) { return v.is_string() && map_characters(v.string(), to_upper) == v.string(); });
    t["odd"] = [](const Value& v, Arguments&, const Location& at) { return need_int(v, "odd operand", at) % 2 != 0; };
    t["even"] = [](const Value& v, Arguments&, const Location& at) { return need_int(v, "even operand", at) % 2 == 0; };
    t["divisibleby"] = [](const Value& v, Arguments& a, const Location& at) {
      const int64_t divisor = need_int(argument(a, 0, "num"), "divisibleby argument", at);
      if (divisor == 0) at.error("integer division or modulo by zero");
      return need_int(v, "divisibleby operand", at) % divisor == 0;
    };
    auto comparison = [](std::string op) {
      return [op](const Value& v, Arguments& a, const Location& at) {
        if (a.positional.size() != 1 || !a.keyword.empty()) at.error("comparison tests take one argument");
        return compare(op, v, a.positional[0], at);
      };
    };
    for (const auto& [names, op] :
         std::vector<std::pair<std::vector<std::string>, std::string>>{{{"eq", "equalto", "=="}, "=="},
                                                                       {{"ne", "!="}, "!="},
                                                                       {{"lt", "lessthan", "<"}, "<"},
                                                                       {{"le", "<="}, "<="},
                                                                       {{"gt", "greaterthan", ">"}, ">"},
                                                                       {{"ge", ">="}, ">="},
                                                                       {{"in"}, "in"}})
      for (const auto& name : names) t[name] = comparison(op);
    t["sameas"] = [](const Value& v, Arguments& a, const Location& at) {
      if (a.positional.size() != 1) at.error("sameas takes one argument");
      const Value& other = a.positional[0];
      // Python identity: the singletons None/True/False, or the same container.
      if (v.is_none() || other.is_none()) return v.is_none() && other.is_none();
      if (v.is_bool() || other.is_bool()) return v.is_bool() && other.is_bool() && v.boolean() == other.boolean();
      if (v.is_list() && other.is_list()) return &v.list() == &other.list();
      if (v.is_dict() && other.is_dict()) return &v.dict() == &other.dict();
      return false;
    };
    return t;
  }();
  return table;
}

}  // namespace

// ---------------------------------------------------------------- public entry points

Value binary_operation(const std::string& op, const Value& left, const Value& right, const Location& at) {
  if (op == "~") {
    std::string joined = left.str();
    const std::string tail = right.str();
    at.grow(0, joined.size() + tail.size(), "the result of '~'");
    joined += tail;
    return Value(std::move(joined));
  }
  if (left.is_undefined()) undefined_error(left, at);
  if (right.is_undefined()) undefined_error(right, at);
  auto type_error = [&]() {
    at.error(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, left.type_name(), right.type_name()));
  };
  if (op == "+") {
    if ((left.is_string() && right.is_string()) || (left.is_list() && right.is_list()))
      at.grow(0, left.bytes() + right.bytes(), "the result of '+'");
    if (left.is_string() && right.is_string()) return Value(left.string() + right.string());
    if (left.is_list() && right.is_list()) {
      List joined = left.list();
      joined.insert(joined.end(), right.list().begin(), right.list().end());
      return Value(std::move(joined));
    }
  }
  if (op == "*") {
    const Value* sequence =
        left.is_string() || left.is_list() ? &left : (right.is_string() || right.is_list() ? &right : nullptr);
    const Value* count = sequence == &left ? &right : &left;
    if (sequence && (count->is_int() || count->is_bool())) {
      const int64_t times = std::max<int64_t>(0, count->integer());
      at.grow(0, repeated_size(sequence->bytes(), static_cast<uint64_t>(times)), "the result of '*'");
      if (sequence->is_string()) {
        std::string out;
        out.reserve(sequence->string().size() * static_cast<size_t>(times));
        for (int64_t i = 0; i < times; ++i) out += sequence->string();
        return Value(std::move(out));
      }
      List out;
      for (int64_t i = 0; i < times; ++i) out.insert(out.end(), sequence->list().begin(), sequence->list().end());
      return Value(std::move(out));
    }
  }
  if (!left.is_number() || !right.is_number()) type_error();
  const bool floating = left.is_float() || right.is_float();
  if (op == "/") {
    if (right.number() == 0.0) at.error("division by zero");
    return Value(left.number() / right.number());
  }
  if (op == "**") {
    if (!floating && right.integer() >= 0) {
      // Squaring: as many steps as the exponent has bits (a loop of 999999999999 multiplications hung).
      int64_t result = 1, base = left.integer();
      for (int64_t exponent = right.integer(); exponent > 0; exponent /= 2) {
        const bool overflow = ((exponent & 1) && __builtin_mul_overflow(result, base, &result)) ||
                              (exponent > 1 && __builtin_mul_overflow(base, base, &base));
        if (overflow) at.error(fmt::format("{} ** {} overflows a 64-bit integer", left.integer(), right.integer()));
      }
      return Value(result);
    }
    return Value(std::pow(left.number(), right.number()));
  }
  if (floating) {
    const double a = left.number(), b = right.number();
    if (op == "+") return Value(a + b);
    if (op == "-") return Value(a - b);
    if (op == "*") return Value(a * b);
    if (b == 0.0 && (op == "//" || op == "%")) at.error("float division by zero");
    if (op == "//") return Value(std::floor(a / b));
    if (op == "%") return Value(a - std::floor(a / b) * b);
  } else {
    const int64_t a = left.integer(), b = right.integer();
    if (op == "+") return Value(a + b);
    if (op == "-") return Value(a - b);
    if (op == "*") return Value(a * b);
    if (b == 0 && (op == "//" || op == "%")) at.error("integer division or modulo by zero");
    // Python rounds integer division toward negative infinity.
    const int64_t quotient = a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0);
    if (op == "//") return Value(quotient);
    if (op == "%") return Value(a - quotient * b);
  }
  type_error();
  return Value();
}

bool compare(const std::string& op, const Value& left, const Value& right, const Location& at) {
  if (op == "==" || op == "!=") {
    at.charge(std::min(left.bytes(), right.bytes()) / kBytesPerStep);
    return (left == right) == (op == "==");
  }
  if (op == "in" || op == "not in") {
    bool found = false;
    at.charge(right.is_list() ? right.list().size() + right.bytes() / kBytesPerStep : right.bytes() / kBytesPerStep);
    if (right.is_string()) {
      found = right.string().find(need_string(left, "left operand of 'in <string>'", at)) != std::string::npos;
    } else if (right.is_list()) {
      found = std::find(right.list().begin(), right.list().end(), left) != right.list().end();
    } else if (right.is_dict()) {
      found = left.is_string() && right.dict().find(left.string()) != nullptr;
    } else if (right.is_undefined()) {
      found = false;  // Jinja2's Undefined iterates as empty
    } else {
      at.error(fmt::format("argument of type '{}' is not iterable", right.type_name()));
    }
    return op == "in" ? found : !found;
  }
  if (left.is_undefined()) undefined_error(left, at);
  if (right.is_undefined()) undefined_error(right, at);
  if (op == "<") return less_than(left, right, at);
  if (op == ">") return less_than(right, left, at);
  if (op == "<=") return !less_than(right, left, at);
  if (op == ">=") return !less_than(left, right, at);
  at.error("unknown comparison " + op);
}

Value unary_operation(const std::string& op, const Value& operand, const Location& at) {
  if (op == "not") return Value(!operand.truthy());
  if (operand.is_undefined()) undefined_error(operand, at);
  if (!operand.is_number()) at.error(fmt::format("bad operand type for unary {}: '{}'", op, operand.type_name()));
  if (op == "+") return operand.is_float() ? Value(operand.number()) : Value(operand.integer());
  return operand.is_float() ? Value(-operand.number()) : Value(-operand.integer());
}

Value get_attribute(const Value& object, const std::string& name, const Location& at) {
  if (object.is_undefined()) undefined_error(object, at);
  if (object.is_dict()) {
    at.charge(object.dict().entries.size());  // Dict::find walks the entries
    if (!object.is_namespace() && is_dict_method(name)) return bound_method(object, name);
    if (const Value* found = object.dict().find(name)) return *found;
    return Value::undefined(fmt::format("'{}' object has no attribute '{}'", object.type_name(), name));
  }
  if (object.is_string() && is_string_method(name)) return bound_method(object, name);
  return Value::undefined(fmt::format("'{}' object has no attribute '{}'", object.type_name(), name));
}

Value get_item(const Value& object, const Value& key, const Location& at) {
  if (object.is_undefined()) undefined_error(object, at);
  if (object.is_dict()) {
    at.charge(object.dict().entries.size());  // Dict::find walks the entries
    if (key.is_string())
      if (const Value* found = object.dict().find(key.string())) return *found;
    if (key.is_string() && !object.is_namespace() && is_dict_method(key.string()))
      return bound_method(object, key.string());
    return Value::undefined(fmt::format("'{}' object has no attribute {}", object.type_name(), key.repr()));
  }
  if ((object.is_list() || object.is_string()) && (key.is_int() || key.is_bool())) {
    if (object.is_list()) {
      const auto size = static_cast<int64_t>(object.list().size());
      int64_t index = key.integer();
      if (index < 0) index += size;
      if (index < 0 || index >= size) return Value::undefined(fmt::format("list index {} out of range", key.integer()));
      return object.list()[static_cast<size_t>(index)];
    }
    at.charge(object.bytes() / kBytesPerStep);
    const std::u32string characters = decode(object.string());
    const auto size = static_cast<int64_t>(characters.size());
    int64_t index = key.integer();
    if (index < 0) index += size;
    if (index < 0 || index >= size) return Value::undefined(fmt::format("string index {} out of range", key.integer()));
    return Value(encode(characters.substr(static_cast<size_t>(index), 1)));
  }
  if (key.is_string()) return get_attribute(object, key.string(), at);
  return Value::undefined(fmt::format("'{}' object has no item {}", object.type_name(), key.repr()));
}

Value get_slice(const Value& object, const Value* start, const Value* stop, const Value* step, const Location& at) {
  if (object.is_undefined()) undefined_error(object, at);
  if (!object.is_list() && !object.is_string())
    at.error(fmt::format("'{}' object is not subscriptable", object.type_name()));
  at.charge(object.is_string() ? object.bytes() / kBytesPerStep : object.list().size());
  const std::u32string characters = object.is_string() ? decode(object.string()) : std::u32string();
  const auto size = static_cast<int64_t>(object.is_list() ? object.list().size() : characters.size());
  auto bound = [&](const Value* value) -> std::optional<int64_t> {
    if (!value || value->is_none()) return std::nullopt;
    return need_int(*value, "slice index", at);
  };
  const int64_t stride = bound(step).value_or(1);
  if (stride == 0) at.error("slice step cannot be zero");
  // Python's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> index, int64_t fallback) {
    if (!index) return fallback;
    int64_t value = *index;
    if (value < 0) {
      value += size;
      if (value < 0) value = stride < 0 ? -1 : 0;
    } else if (value >= size) {
      value = stride < 0 ? size - 1 : size;
    }
    return value;
  };
  const int64_t first = adjust(bound(start), stride < 0 ? size - 1 : 0);
  const int64_t last = adjust(bound(stop), stride < 0 ? -1 : size);
  List items;
  std::u32string text;
  for (int64_t i = first; stride > 0 ? i < last : i > last; i += stride) {
    if (object.is_list())
      items.push_back(object.list()[static_cast<size_t>(i)]);
    else
      text.push_back(characters[static_cast<size_t>(i)]);
  }
  return object.is_list() ? Value(std::move(items)) : Value(encode(text));
}

List iterate(const Value& value, const Location& at) {
  switch (value.kind()) {
    case Value::Kind::Undefined:
      return {};
    case Value::Kind::List:
      at.charge(value.list().size());
      return value.list();
    case Value::Kind::String: {
      const size_t count = count_code_points(value.string());
      at.grow(0, repeated_size(sizeof(Value), count) + value.bytes(), "the list of the string's characters");
      List characters;
      characters.reserve(count);
      for (char32_t c : decode(value.string())) characters.emplace_back(encode(std::u32string(1, c)));
      return characters;
    }
    case Value::Kind::Dict: {
      if (value.is_namespace()) break;
      at.charge(value.dict().entries.size());
      List keys;
      for (const auto& entry : value.dict().entries) keys.emplace_back(entry.first);
      return keys;
    }
    default:
      break;
  }
  at.error(fmt::format("'{}' object is not iterable", value.type_name()));
}

Value apply_filter(const std::string& name, const Value& input, CallArguments& arguments, const Location& at) {
  const auto& table = filters();
  const auto found = table.find(name);
  if (found == table.end()) at.error("unknown filter '" + name + "'");
  if (input.is_string()) at.charge(input.bytes() / kBytesPerStep);
  return found->second(input, arguments, at);
}

bool apply_test(const std::string& name, const Value& input, CallArguments& arguments, const Location& at) {
  const auto& table = tests();
  const auto found = table.find(name);
  if (found == table.end()) at.error("unknown test '" + name + "'");
  if (input.is_string()) at.charge(input.bytes() / kBytesPerStep);
  return found->second(input, arguments, at);
}

std::optional<Value> global_function(const std::string& name) {
  if (name == "namespace" || name == "dict") {
    const bool is_namespace = name == "namespace";
    return Value(Function{name, [is_namespace](Arguments& arguments) {
                            const Location& at = arguments.at;
                            Dict dict;
                            dict.is_namespace = is_namespace;
                            for (const Value& positional : arguments.positional) {
                              if (!positional.is_dict())
                                at.error("namespace()/dict() take keyword arguments or a dict");
                              for (const auto& [key, value] : positional.dict().entries) dict.set(key, value);
                            }
                            for (const auto& [key, value] : arguments.keyword) dict.set(key, value);
                            return Value(std::move(dict));
                          }});
  }
  if (name == "range") {
    return Value(Function{name, [](Arguments& arguments) {
                            const Location& at = arguments.at;
                            if (arguments.positional.empty() || arguments.positional.size() > 3 ||
                                !arguments.keyword.empty())
                              at.error("range() takes 1 to 3 positional arguments");
                            std::vector<int64_t> bounds;
                            for (const Value& value : arguments.positional)
                              bounds.push_back(need_int(value, "range argument", at));
                            const int64_t start = bounds.size() == 1 ? 0 : bounds[0];
                            const int64_t stop = bounds.size() == 1 ? bounds[0] : bounds[1];
                            const int64_t step = bounds.size() == 3 ? bounds[2] : 1;
                            if (step == 0) at.error("range() arg 3 must not be zero");
                            // The count first: range(999999999) would allocate gigabytes.
                            const __int128 span = step > 0 ? __int128{stop} - start : __int128{start} - stop;
                            const __int128 magnitude = step > 0 ? __int128{step} : -__int128{step};
                            const __int128 count = span <= 0 ? 0 : (span + magnitude - 1) / magnitude;
                            const __int128 bytes = count * static_cast<__int128>(sizeof(Value));
                            at.grow(0, bytes > kMaxValueBytes ? kMaxValueBytes + 1 : static_cast<uint64_t>(bytes),
                                    fmt::format("range({})", fmt::join(bounds, ", ")));
                            List values;
                            values.reserve(static_cast<size_t>(count));
                            for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) values.emplace_back(i);
                            return Value(std::move(values));
                          }});
  }
  if (name == "raise_exception") {
    return Value(Function{name, [](Arguments& arguments) -> Value {
                            const Location& at = arguments.at;
                            at.error("the template raised an exception: " + argument(arguments, 0, "message").str());
                          }});
  }
  if (name == "strftime_now") {
    // transformers passes strftime_now(format) = datetime.now().strftime(format).
    return Value(Function{name, [](Arguments& arguments) {
                            const Location& at = arguments.at;
                            const std::string& format =
                                need_string(argument(arguments, 0, "format"), "strftime format", at);
                            const std::time_t now = std::time(nullptr);
                            std::tm local{};
                            localtime_r(&now, &local);
                            char buffer[256];
                            const size_t length = std::strftime(buffer, sizeof(buffer), format.c_str(), &local);
                            return Value(std::string(buffer, length));
                          }});
  }
  return std::nullopt;
}

}  // namespace kiln::jinja
