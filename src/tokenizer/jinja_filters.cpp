// The filters and tests of kiln's Jinja interpreter, with Jinja2's semantics.
#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "core/error.h"
#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_builtins_internal.h"

namespace kiln::jinja {

using namespace builtins;

namespace {

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

namespace {

// Calls the entry `name` of `table` (a filter or a test, `kind` says which), charging the steps a
// string input costs.
template <class Table>
auto apply_named(const Table& table, const char* kind, const std::string& name, const Value& input,
                 CallArguments& arguments, const Location& at) {
  const auto found = table.find(name);
  if (found == table.end()) at.error(std::string("unknown ") + kind + " '" + name + "'");
  if (input.is_string()) at.charge(input.bytes() / kBytesPerStep);
  return found->second(input, arguments, at);
}

}  // namespace

Value apply_filter(const std::string& name, const Value& input, CallArguments& arguments, const Location& at) {
  return apply_named(filters(), "filter", name, input, arguments, at);
}

bool apply_test(const std::string& name, const Value& input, CallArguments& arguments, const Location& at) {
  return apply_named(tests(), "test", name, input, arguments, at);
}

}  // namespace kiln::jinja
