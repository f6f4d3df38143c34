// Values of kiln's Jinja interpreter, with Python's semantics (what Jinja2, and so transformers'
// chat templates, compute with): None, bools, ints, floats, strings, lists, insertion-ordered
// dicts, namespaces (dicts whose attributes `set` may change) and callables. Undefined stands for
// a missing variable, key or attribute, as Jinja2's Undefined does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "core/error.h"
#include "tokenizer/jinja_limits.h"

namespace kiln::jinja {

class Value;
using List = std::vector<Value>;

struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  bool is_namespace = false;
  const Value* find(std::string_view key) const;
  void set(std::string key, Value value);
};

struct CallArguments {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  Location at;  // where the call is, for errors and the budget
};

// A value over kMaxValueDepth or kMaxValueBytes; the renderer adds the template line.
class ValueLimitError : public Error {
 public:
  using Error::Error;
};

struct Function {
  std::string name;
  std::function<Value(CallArguments&)> call;
};

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Function };

  Value() = default;  // Undefined
  static Value undefined(std::string description);
  static Value none();
  Value(bool value) : data_(value) {}                      // NOLINT: implicit like Python literals
  Value(int64_t value) : data_(value) {}                   // NOLINT
  Value(int value) : data_(int64_t{value}) {}              // NOLINT
  Value(double value) : data_(value) {}                    // NOLINT
  Value(std::string value);                                // NOLINT
  Value(const char* value) : Value(std::string(value)) {}  // NOLINT
  Value(List value);                                       // NOLINT
  Value(Dict value);                                       // NOLINT
  Value(Function value);                                   // NOLINT

  // A ValueLimitError when the JSON nests deeper than kMaxValueDepth or holds more than kMaxValueBytes.
  static Value from_json(const nlohmann::ordered_json& json);

  Kind kind() const { return static_cast<Kind>(data_.index()); }
  bool is_undefined() const { return kind() == Kind::Undefined; }
  bool is_none() const { return kind() == Kind::None; }
  bool is_bool() const { return kind() == Kind::Bool; }
  bool is_int() const { return kind() == Kind::Int; }
  bool is_float() const { return kind() == Kind::Float; }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return kind() == Kind::String; }
  bool is_list() const { return kind() == Kind::List; }
  bool is_dict() const { return kind() == Kind::Dict; }
  bool is_namespace() const { return is_dict() && dict().is_namespace; }
  bool is_function() const { return kind() == Kind::Function; }

  bool boolean() const { return std::get<bool>(data_); }
  int64_t integer() const;  // an Int or a Bool
  double number() const;    // an Int, Float or Bool
  const std::string& string() const { return *std::get<std::shared_ptr<const std::string>>(data_); }
  const List& list() const { return *std::get<std::shared_ptr<const List>>(data_); }
  const Dict& dict() const { return *std::get<std::shared_ptr<Dict>>(data_); }
  Dict& namespace_dict() const { return *std::get<std::shared_ptr<Dict>>(data_); }
  const Function& function() const { return *std::get<std::shared_ptr<const Function>>(data_); }
  // What an Undefined stands for, e.g. "'messages' is undefined", for error messages.
  const std::string& undefined_description() const { return std::get<UndefinedData>(data_).description; }

  // How deep lists and dicts nest inside (0 for a scalar), and the bytes the value holds (string
  // bytes, sizeof(Value) per element): each at most kMaxValueDepth / kMaxValueBytes, or building
  // the value was a ValueLimitError. A namespace counts what it held when it was made.
  int depth() const { return depth_; }
  uint64_t bytes() const { return bytes_; }
  // Whether this is a namespace or holds one: a namespace may not hold another (that would make
  // cycles, and chains whose depth no value recorded).
  bool holds_namespace() const { return holds_namespace_; }

  // Python's truth value (Undefined is false).
  bool truthy() const;
  // Python's str(); Undefined is "".
  std::string str() const;
  // Python's repr() (strings quoted), used inside str() of lists and dicts.
  std::string repr() const;
  // The type name Python would give, for error messages ("str", "int", "list", ...).
  std::string type_name() const;

  // Python's ==.
  friend bool operator==(const Value& left, const Value& right);

 private:
  struct UndefinedData {
    std::string description;
  };
  struct NoneData {};
  std::variant<UndefinedData, NoneData, bool, int64_t, double, std::shared_ptr<const std::string>,
               std::shared_ptr<const List>, std::shared_ptr<Dict>, std::shared_ptr<const Function>>
      data_;
  int depth_ = 0;
  uint64_t bytes_ = 0;
  bool holds_namespace_ = false;
};

// Python's float repr (shortest round-trip digits, "1.0", "1e-05", "inf").
std::string python_float_repr(double value);

// Python's json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=...)
// as transformers' tojson filter calls it. indent < 0 means none.
struct JsonFormat {
  int indent = -1;
  std::string item_separator;  // default: ", " without indent, "," with
  std::string key_separator = ": ";
  bool separators_given = false;
  bool sort_keys = false;
  bool ensure_ascii = false;
};
// A ValueLimitError past kMaxValueBytes of text; an Error for what JSON cannot hold.
std::string to_json(const Value& value, const JsonFormat& format);

}  // namespace kiln::jinja
