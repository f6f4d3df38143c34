// What the builtins of kiln's Jinja interpreter share between their files: jinja_builtins.cpp
// (operators, attribute and item access, methods, globals, and the helpers below),
// jinja_filters.cpp (filters and tests) and jinja_python_strings.cpp (Python's str functions).
// Nothing outside those files includes it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "tokenizer/jinja_builtins.h"

namespace kiln::jinja::builtins {

using Arguments = CallArguments;

// ---------------------------------------------------------------- arguments

// The argument at `index` or named `name`, else `fallback` (Undefined when absent and required).
Value argument(const Arguments& arguments, size_t index, std::string_view name, const Value& fallback = Value());
void check_arguments(const Arguments& arguments, size_t max_positional, std::initializer_list<std::string_view> names,
                     std::string_view function, const Location& at);
const std::string& need_string(const Value& value, std::string_view what, const Location& at);
int64_t need_int(const Value& value, std::string_view what, const Location& at);
[[noreturn]] void undefined_error(const Value& value, const Location& at);

// ---------------------------------------------------------------- Python's str

std::u32string decode(const std::string& text);
size_t count_code_points(const std::string& text);
// Appends to a list being built, checking its size as Value(List) will count it, before it grows.
void append_item(List& items, uint64_t& bytes, Value item, const Location& at, std::string_view what);
// size * times, saturated past kMaxValueBytes (what Location::grow then refuses).
uint64_t repeated_size(uint64_t size, uint64_t times);
std::string encode(const std::u32string& text);
// Python's str.isspace(): White_Space plus the information separators U+001C..U+001F.
bool python_space(char32_t c);
char32_t to_upper(char32_t c);
char32_t to_lower(char32_t c);
bool is_cased(char32_t c);
std::string map_characters(const std::string& text, char32_t (*mapping)(char32_t));
// str.strip / lstrip / rstrip with Python's whitespace or the given characters.
std::string strip(const std::string& text, const Value& characters, bool left, bool right, const Location& at);
List split(const std::string& text, const Value& separator, int64_t max_splits, const Location& at);
std::string replace(const std::string& text, const std::string& old, const std::string& replacement, int64_t count,
                    const Location& at);
std::string capitalize(const std::string& text);
// str.title(): a cased character after an uncased one starts a word.
std::string title_method(const std::string& text);
// Jinja2's title filter: words begin after '-', whitespace, '(', '{', '[' or '<'.
std::string title_filter(const std::string& text);
// str.format with {} / {0} / {name} fields (no format specs) and {{ }} escapes.
std::string format_string(const std::string& pattern, const Arguments& arguments, const Location& at);
List split_lines(const std::string& text, const Location& at);

// ---------------------------------------------------------------- comparisons and sorting

// Python's < for numbers, strings and lists.
bool less_than(const Value& left, const Value& right, const Location& at);
// The comparisons a sort of `count` items makes, at most.
uint64_t sort_steps(size_t count);
// A sort key: lowercased strings unless case_sensitive (Jinja2's ignore_case).
Value sort_key(const Value& value, bool case_sensitive);
Value attribute_path(const Value& value, const Value& attribute, const Location& at);

}  // namespace kiln::jinja::builtins
