#include "tokenizer/jinja_builtins.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <ctime>

#include "tokenizer/jinja_builtins_internal.h"

namespace kiln::jinja {

namespace builtins {

// The argument at `index` or named `name`, else `fallback` (Undefined when absent and required).
Value argument(const Arguments& arguments, size_t index, std::string_view name, const Value& fallback) {
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

}  // namespace builtins

using namespace builtins;

namespace {

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
