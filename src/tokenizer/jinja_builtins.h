// The operators, filters, tests, methods and global functions of kiln's Jinja interpreter, with
// the semantics of Jinja2 and Python (what transformers renders chat templates with).
#pragma once

#include <optional>
#include <string>

#include "tokenizer/jinja_value.h"

namespace kiln::jinja {

Value binary_operation(const std::string& op, const Value& left, const Value& right, const Location& at);
bool compare(const std::string& op, const Value& left, const Value& right, const Location& at);
Value unary_operation(const std::string& op, const Value& operand, const Location& at);

// obj.name: a dict key (a method for items/keys/values/get), a string or dict method, or Undefined.
Value get_attribute(const Value& object, const std::string& name, const Location& at);
// obj[key]: a list or string element (negative indices count from the end), a dict value, or Undefined.
Value get_item(const Value& object, const Value& key, const Location& at);
// obj[start:stop:step] with Python's slice rules (null bounds are omitted ones).
Value get_slice(const Value& object, const Value* start, const Value* stop, const Value* step, const Location& at);

// Python iteration: list elements, string characters, dict keys; Undefined is empty. Builtins
// spend the steps of the items and bytes they walk, and check what they build before allocating.
List iterate(const Value& value, const Location& at);

Value apply_filter(const std::string& name, const Value& input, CallArguments& arguments, const Location& at);
bool apply_test(const std::string& name, const Value& input, CallArguments& arguments, const Location& at);

// namespace(), range(), dict(), raise_exception(), strftime_now(): the globals transformers sets.
std::optional<Value> global_function(const std::string& name);

}  // namespace kiln::jinja
