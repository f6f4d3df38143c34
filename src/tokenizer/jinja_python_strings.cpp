// Python's str functions as Jinja2 templates see them (methods and filters both use them).
#include <utf8proc.h>

#include <algorithm>

#include "tokenizer/jinja_builtins_internal.h"
#include "tokenizer/unicode.h"

namespace kiln::jinja::builtins {

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

}  // namespace kiln::jinja::builtins
