#include "engine/grammar/json_schema.h"

#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "core/error.h"
#include "engine/grammar/regex.h"

namespace kiln::grammar {

namespace {

using json = nlohmann::ordered_json;

// A counted repetition (maxLength, minItems, ...) becomes one rule per count; past this many the
// grammar, and the token tables compiled for each of its positions, would grow without bound.
constexpr int64_t kMaxCountedRepeats = 1000;
// Nesting of subschemas, $ref chains included (the request body's own depth is bounded, a chain of
// definitions is not).
constexpr int kMaxSchemaDepth = 64;
constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();

const std::set<std::string, std::less<>> kAnnotations = {"title",   "description", "default",    "examples",
                                                         "$schema", "$id",         "$comment",   "deprecated",
                                                         "readOnly", "writeOnly",  "$defs",      "definitions"};
const std::set<std::string, std::less<>> kKeywords = {
    "type",     "enum",     "const",     "anyOf",     "oneOf",     "allOf",  "$ref",
    "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "minLength",
    "maxLength", "format", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
const std::array<const char*, 4> kBounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
// Integer bounds within ±10^18: their digits and the arithmetic on them stay inside 64 bits.
constexpr double kMaxBound = 1e18;

// The string formats, as regexes over the string's characters. A date's day exists in its month,
// February 29 only in leap years (divisible by 4, centuries only by 400; the year 0000 is one).
const std::string kYear = "\\d{4}";
const std::string kLeapYear = "(\\d\\d(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)";
const std::string kDate = "(" + kYear + "-(0[13578]|1[02])-(0[1-9]|[12]\\d|3[01])|" + kYear +
                          "-(0[469]|11)-(0[1-9]|[12]\\d|30)|" + kYear + "-02-(0[1-9]|1\\d|2[0-8])|" + kLeapYear +
                          "-02-29)";
const std::string kTime = "([01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(\\.\\d+)?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)";
const std::string kIpv4Octet = "(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)";
// Email: a practical subset of RFC 5322's addr-spec: a dot-atom local part (atext runs joined by
// single dots; no quoted strings or comments), then a domain of two or more LDH labels (letters,
// digits, hyphens inside; no IP literals).
const std::string kEmailAtom = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+";
const std::string kDomainLabel = "[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?";
const std::map<std::string, std::string, std::less<>> kFormats = {
    {"date", kDate},
    {"time", kTime},
    {"date-time", kDate + "T" + kTime},
    {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    {"email", kEmailAtom + "(\\." + kEmailAtom + ")*@" + kDomainLabel + "(\\." + kDomainLabel + ")+"},
    {"ipv4", kIpv4Octet + "(\\." + kIpv4Octet + "){3}"},
};

Symbol ref(int32_t rule) { return Symbol::reference(rule); }
Symbol bytes(uint8_t first, uint8_t last) { return Symbol::byte_set(ByteSet::range(first, last)); }
Symbol byte(char c) { return Symbol::byte_set(ByteSet::of(static_cast<uint8_t>(c))); }

class SchemaCompiler {
 public:
  SchemaCompiler(Grammar& grammar, const json& root, bool markup_safe)
      : root_(root), grammar_(grammar), markup_safe_(markup_safe) {}

  // Checks the limits, then compiles.
  int32_t compile(const json& schema, const std::string& path);
  int32_t any_value();
  int32_t any_object();

 private:
  int32_t compile_object(const json& schema, const std::string& path);
  int32_t compile_array(const json& schema, const std::string& path);
  int32_t compile_string(const json& schema, const std::string& path);
  // A string whose characters a regex describes (a format, a pattern), through its closing quote.
  int32_t regex_string(const std::string& regex, bool whole_text, const char* keyword, const std::string& path);
  int32_t compile_integer(const json& schema, const std::string& path);
  // The decimal texts (no leading zeros) of the naturals in [low, high] (no high: unbounded).
  void natural_range(uint64_t low, std::optional<uint64_t> high, std::vector<Sequence>& out);
  // A value's compact JSON text as the grammar writes it.
  std::string json_text(const json& value) const;
  int32_t compile_type(const std::string& type, const json& schema, const std::string& path);
  int32_t resolve(const std::string& reference, const std::string& path);
  int32_t compile_schema(const json& schema, const std::string& path);

  int32_t once(int32_t& rule, const std::function<int32_t()>& make) {
    if (rule < 0) rule = make();
    return rule;
  }
  int32_t string_rule();
  int32_t number_rule();
  int32_t integer_rule();
  int32_t digits_rule();
  int32_t escape_rule();
  // The alternatives of one string character (a UTF-8 sequence or an escape), each followed by `next`.
  std::vector<Sequence> character_then(int32_t next);
  // A string's characters after its opening quote, `count` of them written so far, through the
  // closing quote.
  int32_t characters(int64_t count, int64_t min, int64_t max, std::map<int64_t, int32_t>& made);

  const json& root_;
  Grammar& grammar_;
  const bool markup_safe_;
  int depth_ = 0;
  std::map<std::string, int32_t> references_;
  int32_t value_ = -1, object_ = -1, string_ = -1, number_ = -1, integer_ = -1, digits_ = -1, escape_ = -1;
};

// JSON pointers into the schema; the root is "/".
std::string child(const std::string& path, const std::string& key) { return (path == "/" ? "" : path) + "/" + key; }

[[noreturn]] void unsupported(const std::string& keyword, const std::string& path) {
  fail("unsupported JSON schema keyword \"{}\" at {}", keyword, path);
}

int64_t count_field(const json& schema, const char* keyword, const std::string& path, int64_t absent) {
  if (!schema.contains(keyword)) return absent;
  const json& value = schema[keyword];
  if (!value.is_number_integer() || value.get<int64_t>() < 0)
    fail("JSON schema keyword \"{}\" at {} must be a non-negative integer", keyword, path);
  if (value.get<int64_t>() > kMaxCountedRepeats)
    fail("JSON schema keyword \"{}\" at {} is {}; at most {} is supported", keyword, path,
         value.get<int64_t>(), kMaxCountedRepeats);
  return value.get<int64_t>();
}

int32_t SchemaCompiler::digits_rule() {
  return once(digits_, [&] {
    const int32_t rule = grammar_.add_rule("digits");
    grammar_.add_alternative(rule, {});
    grammar_.add_alternative(rule, {bytes('0', '9'), ref(rule)});
    return rule;
  });
}

int32_t SchemaCompiler::integer_rule() {
  return once(integer_, [&] {
    const int32_t natural = grammar_.add_rule("natural", {{byte('0')}, {bytes('1', '9'), ref(digits_rule())}});
    return grammar_.add_rule("integer", {{ref(natural)}, {byte('-'), ref(natural)}});
  });
}

int32_t SchemaCompiler::number_rule() {
  return once(number_, [&] {
    const int32_t fraction = grammar_.add_rule("fraction", {{}, {byte('.'), bytes('0', '9'), ref(digits_rule())}});
    const int32_t sign = grammar_.add_rule("exponent_sign", {{}, {byte('+')}, {byte('-')}});
    const int32_t exponent = grammar_.add_rule(
        "exponent", {{}, {Symbol::byte_set(ByteSet::of('e').add('E', 'E')), ref(sign), bytes('0', '9'), ref(digits_rule())}});
    return grammar_.add_rule("number", {{ref(integer_rule()), ref(fraction), ref(exponent)}});
  });
}

int32_t SchemaCompiler::escape_rule() {
  return once(escape_, [&] {
    ByteSet simple;
    for (char c : std::string_view("\"\\/bfnrt")) simple.add(static_cast<uint8_t>(c), static_cast<uint8_t>(c));
    const Symbol hex = Symbol::byte_set(ByteSet::range('0', '9').add('a', 'f').add('A', 'F'));
    return grammar_.add_rule("escape", {{Symbol::byte_set(simple)}, {byte('u'), hex, hex, hex, hex}});
  });
}

std::vector<Sequence> SchemaCompiler::character_then(int32_t next) {
  const Symbol tail = bytes(0x80, 0xBF);
  // Well-formed UTF-8 (RFC 3629 §4) and JSON's unescaped characters (RFC 8259 §7: not `"`, `\` or
  // a control character).
  ByteSet escaped = ByteSet::of('"').add('\\', '\\');
  if (markup_safe_) escaped.add('<', '<').add('>', '>').add('&', '&');
  const ByteSet unescaped = ByteSet::range(0x20, 0x7F).without(escaped);
  return {
      {Symbol::byte_set(unescaped), ref(next)},
      {bytes(0xC2, 0xDF), tail, ref(next)},
      {byte('\xE0'), bytes(0xA0, 0xBF), tail, ref(next)},
      {bytes(0xE1, 0xEC), tail, tail, ref(next)},
      {byte('\xED'), bytes(0x80, 0x9F), tail, ref(next)},
      {bytes(0xEE, 0xEF), tail, tail, ref(next)},
      {byte('\xF0'), bytes(0x90, 0xBF), tail, tail, ref(next)},
      {bytes(0xF1, 0xF3), tail, tail, tail, ref(next)},
      {byte('\xF4'), bytes(0x80, 0x8F), tail, tail, ref(next)},
      {byte('\\'), ref(escape_rule()), ref(next)},
  };
}

int32_t SchemaCompiler::characters(int64_t count, int64_t min, int64_t max, std::map<int64_t, int32_t>& made) {
  // Past min with no max, every count behaves alike: one looping rule.
  const int64_t key = max == kUnbounded && count > min ? min : count;
  if (const auto found = made.find(key); found != made.end()) return found->second;
  const int32_t rule = grammar_.add_rule(fmt::format("characters_{}", key));
  made[key] = rule;
  if (key >= min) grammar_.add_alternative(rule, {byte('"')});
  if (key < max) {
    const int32_t next = characters(key + 1, min, max, made);
    for (const Sequence& alternative : character_then(next)) grammar_.add_alternative(rule, alternative);
  }
  return rule;
}

int32_t SchemaCompiler::string_rule() {
  return once(string_, [&] {
    std::map<int64_t, int32_t> made;
    return grammar_.add_rule("string", {{byte('"'), ref(characters(0, 0, kUnbounded, made))}});
  });
}

int32_t SchemaCompiler::any_value() {
  return once(value_, [&] {
    const int32_t value = grammar_.add_rule("value");
    value_ = value;
    const int32_t elements = grammar_.add_rule("elements");
    grammar_.add_alternative(elements, literal("]"));
    grammar_.add_alternative(elements, {byte(','), ref(value), ref(elements)});
    const int32_t array = grammar_.add_rule("array", {literal("[]"), {byte('['), ref(value), ref(elements)}});
    for (const Sequence& alternative : std::vector<Sequence>{{ref(any_object())}, {ref(array)}, {ref(string_rule())},
                                                            {ref(number_rule())}, literal("true"), literal("false"),
                                                            literal("null")})
      grammar_.add_alternative(value, alternative);
    return value;
  });
}

int32_t SchemaCompiler::any_object() {
  return once(object_, [&] {
    const int32_t members = grammar_.add_rule("members");
    const int32_t object = grammar_.add_rule("object");
    object_ = object;
    const int32_t value = any_value();
    grammar_.add_alternative(members, literal("}"));
    grammar_.add_alternative(members, {byte(','), ref(string_rule()), byte(':'), ref(value), ref(members)});
    grammar_.add_alternative(object, literal("{}"));
    grammar_.add_alternative(object, {byte('{'), ref(string_rule()), byte(':'), ref(value), ref(members)});
    return object;
  });
}

int32_t SchemaCompiler::resolve(const std::string& reference, const std::string& path) {
  if (const auto found = references_.find(reference); found != references_.end()) return found->second;
  const json* target = nullptr;
  if (reference == "#") {
    target = &root_;
  } else {
    for (const char* container : {"#/$defs/", "#/definitions/"}) {
      const std::string prefix = container;
      if (reference.rfind(prefix, 0) != 0) continue;
      const std::string name = reference.substr(prefix.size());
      const auto definitions = root_.find(prefix.substr(2, prefix.size() - 3));
      if (definitions == root_.end() || !definitions->is_object()) continue;
      if (const auto found = definitions->find(name); found != definitions->end()) target = &*found;
    }
  }
  if (!target)
    fail("JSON schema $ref \"{}\" at {} does not name \"#\" or an entry of $defs or definitions", reference, path);
  // The rule exists before its body is compiled, so a schema may refer to itself.
  const int32_t rule = grammar_.add_rule("ref " + reference);
  references_[reference] = rule;
  grammar_.add_alternative(rule, {ref(compile(*target, reference == "#" ? "/" : reference.substr(1)))});
  return rule;
}

int32_t SchemaCompiler::compile_object(const json& schema, const std::string& path) {
  const json properties = schema.value("properties", json::object());
  if (!properties.is_object()) fail("JSON schema \"properties\" at {} must be an object", path);
  std::set<std::string> required;
  if (schema.contains("required")) {
    if (!schema["required"].is_array()) fail("JSON schema \"required\" at {} must be an array", path);
    for (const json& name : schema["required"]) {
      if (!name.is_string()) fail("JSON schema \"required\" at {} must list strings", path);
      if (!properties.contains(name.get<std::string>()))
        fail("JSON schema \"required\" at {} names \"{}\", which is not in \"properties\"", path, name.get<std::string>());
      required.insert(name.get<std::string>());
    }
  }
  // Further properties: additionalProperties' schema, any value when it is true (or when the
  // schema lists no properties and does not say), none otherwise.
  std::optional<int32_t> extra_value;
  const json additional = schema.value("additionalProperties", json(properties.empty()));
  // A further property could repeat a listed name with a value its schema forbids (the last of
  // duplicate keys wins in most parsers), and keeping the names out needs a grammar of strings
  // other than them; left for when a client needs it.
  if (!properties.empty() && additional != json(false))
    unsupported("additionalProperties\" other than false beside \"properties", path);
  if (additional.is_boolean()) {
    if (additional.get<bool>()) extra_value = any_value();
  } else if (additional.is_object()) {
    extra_value = compile(additional, child(path, "additionalProperties"));
  } else {
    fail("JSON schema \"additionalProperties\" at {} must be a boolean or a schema", path);
  }
  std::vector<std::pair<std::string, int32_t>> listed;
  for (const auto& [name, property] : properties.items())
    listed.emplace_back(name, compile(property, child(child(path, "properties"), name)));

  // rest[i][first]: what follows once properties before i are written or skipped; `first` says
  // none was written (no comma before the next).
  const size_t count = listed.size();
  std::vector<std::array<int32_t, 2>> rest(count + 1);
  for (int first = 0; first < 2; ++first) {
    const int32_t tail = grammar_.add_rule(fmt::format("{} extra properties", path));
    rest[count][first] = tail;
    grammar_.add_alternative(tail, literal("}"));
    if (extra_value) {
      Sequence member = first ? Sequence{} : literal(",");
      member.insert(member.end(), {ref(string_rule()), byte(':'), ref(*extra_value)});
      // Once one is written, the next needs a comma: the tail without `first`.
      member.push_back(ref(first ? rest[count][0] : tail));
      grammar_.add_alternative(tail, member);
    }
  }
  for (size_t i = count; i-- > 0;) {
    for (int first = 0; first < 2; ++first) {
      const int32_t rule = grammar_.add_rule(fmt::format("{} from property {}", path, listed[i].first));
      rest[i][first] = rule;
      Sequence member = first ? Sequence{} : literal(",");
      member = concat(member, literal(json_text(json(listed[i].first)) + ":"));
      member.push_back(ref(listed[i].second));
      member.push_back(ref(rest[i + 1][0]));
      grammar_.add_alternative(rule, member);
      if (!required.count(listed[i].first)) grammar_.add_alternative(rule, {ref(rest[i + 1][first])});
    }
  }
  return grammar_.add_rule(fmt::format("{} object", path), {{byte('{'), ref(rest[0][1])}});
}

int32_t SchemaCompiler::compile_array(const json& schema, const std::string& path) {
  const int32_t item = schema.contains("items") ? compile(schema["items"], child(path, "items")) : any_value();
  const int64_t min = count_field(schema, "minItems", path, 0);
  const int64_t max = schema.contains("maxItems") ? count_field(schema, "maxItems", path, 0) : kUnbounded;
  if (min > max) fail("JSON schema at {}: minItems {} is above maxItems {}", path, min, max);
  // after[k]: what follows the k-th item (k ≥ 1): "]" or another item.
  std::map<int64_t, int32_t> after;
  std::function<int32_t(int64_t)> after_item = [&](int64_t written) -> int32_t {
    const int64_t key = max == kUnbounded && written > std::max<int64_t>(min, 1) ? std::max<int64_t>(min, 1) : written;
    if (const auto found = after.find(key); found != after.end()) return found->second;
    const int32_t rule = grammar_.add_rule(fmt::format("{} after item {}", path, key));
    after[key] = rule;
    if (key >= min) grammar_.add_alternative(rule, literal("]"));
    if (key < max) grammar_.add_alternative(rule, {byte(','), ref(item), ref(after_item(key + 1))});
    return rule;
  };
  const int32_t array = grammar_.add_rule(fmt::format("{} array", path));
  if (min == 0) grammar_.add_alternative(array, literal("[]"));
  if (max > 0) grammar_.add_alternative(array, {byte('['), ref(item), ref(after_item(1))});
  return array;
}

int32_t SchemaCompiler::compile_string(const json& schema, const std::string& path) {
  const int64_t min = count_field(schema, "minLength", path, 0);
  const int64_t max = schema.contains("maxLength") ? count_field(schema, "maxLength", path, 0) : kUnbounded;
  if (min > max) fail("JSON schema at {}: minLength {} is above maxLength {}", path, min, max);
  const bool format = schema.contains("format"), pattern = schema.contains("pattern");
  if (format && pattern) fail("JSON schema at {}: \"format\" together with \"pattern\" is not supported", path);
  if (format || pattern) {
    const char* keyword = format ? "format" : "pattern";
    if (schema.contains("minLength") || schema.contains("maxLength"))
      fail("JSON schema at {}: \"{}\" together with minLength or maxLength is not supported", path, keyword);
    if (!schema[keyword].is_string()) fail("JSON schema \"{}\" at {} must be a string", keyword, path);
    const std::string value = schema[keyword];
    if (pattern) return regex_string(value, false, keyword, path);
    const auto found = kFormats.find(value);
    if (found == kFormats.end()) {
      std::string supported;
      for (const auto& [name, regex] : kFormats) supported += (supported.empty() ? "" : ", ") + name;
      fail("unsupported JSON schema format \"{}\" at {} (supported: {})", value, path, supported);
    }
    return regex_string(found->second, true, keyword, path);
  }
  if (min == 0 && max == kUnbounded) return string_rule();
  std::map<int64_t, int32_t> made;
  return grammar_.add_rule(fmt::format("{} string", path), {{byte('"'), ref(characters(0, min, max, made))}});
}

int32_t SchemaCompiler::regex_string(const std::string& regex, bool whole_text, const char* keyword,
                                     const std::string& path) {
  // A pattern constrains the string's value: its characters are written as a JSON string writes
  // them (a quote as \", a newline as \n), and, unanchored, may sit anywhere in the string.
  RegexOptions options;
  options.whole_text = whole_text;
  options.encoding = markup_safe_ ? CharEncoding::JsonStringMarkupSafe : CharEncoding::JsonString;
  int32_t characters;
  try {
    characters = add_regex(grammar_, regex, options);
  } catch (const Error& error) {
    fail("JSON schema \"{}\" at {}: {}", keyword, path, error.what());
  }
  return grammar_.add_rule(fmt::format("{} {}", path, keyword), {{byte('"'), ref(characters), byte('"')}});
}

void SchemaCompiler::natural_range(uint64_t low, std::optional<uint64_t> high, std::vector<Sequence>& out) {
  const std::string low_digits = std::to_string(low);
  const auto power_of_ten = [](size_t exponent) {
    uint64_t value = 1;
    for (size_t i = 0; i < exponent; ++i) value *= 10;
    return value;
  };
  // Texts of one length: digits equal up to where a and b part, then a's tail up to 9…9, the
  // digits between theirs followed by anything, and b's tail from 0…0.
  std::function<void(const std::string&, const std::string&, Sequence)> same_length =
      [&](const std::string& a, const std::string& b, Sequence prefix) {
        if (a.empty()) {
          out.push_back(std::move(prefix));
          return;
        }
        if (a[0] == b[0]) {
          prefix.push_back(byte(a[0]));
          same_length(a.substr(1), b.substr(1), std::move(prefix));
          return;
        }
        const std::string a_rest = a.substr(1), b_rest = b.substr(1);
        const bool a_from_zero = a_rest.find_first_not_of('0') == std::string::npos;
        const bool b_to_nine = b_rest.find_first_not_of('9') == std::string::npos;
        if (!a_from_zero) same_length(a_rest, std::string(a_rest.size(), '9'), concat(prefix, {byte(a[0])}));
        const char middle_first = static_cast<char>(a[0] + (a_from_zero ? 0 : 1));
        const char middle_last = static_cast<char>(b[0] - (b_to_nine ? 0 : 1));
        if (middle_first <= middle_last) {
          Sequence middle = concat(prefix, {bytes(middle_first, middle_last)});
          middle.insert(middle.end(), a_rest.size(), bytes('0', '9'));
          out.push_back(std::move(middle));
        }
        if (!b_to_nine) same_length(std::string(b_rest.size(), '0'), b_rest, concat(prefix, {byte(b[0])}));
      };
  const size_t last_length = high ? std::to_string(*high).size() : low_digits.size();
  for (size_t length = low_digits.size(); length <= last_length; ++length) {
    const uint64_t first = std::max(low, length == 1 ? 0 : power_of_ten(length - 1));
    const uint64_t last = high ? std::min(*high, power_of_ten(length) - 1) : power_of_ten(length) - 1;
    if (first <= last) same_length(std::to_string(first), std::to_string(last), {});
  }
  if (!high) {
    // Any longer number.
    Sequence longer = {bytes('1', '9')};
    longer.insert(longer.end(), low_digits.size(), bytes('0', '9'));
    longer.push_back(ref(digits_rule()));
    out.push_back(std::move(longer));
  }
}

int32_t SchemaCompiler::compile_integer(const json& schema, const std::string& path) {
  std::optional<int64_t> lower, upper;
  for (const char* keyword : kBounds) {
    if (!schema.contains(keyword)) continue;
    const json& value = schema[keyword];
    if (!value.is_number())
      fail("JSON schema \"{}\" at {} must be a number{}", keyword, path,
           value.is_boolean() ? " (draft 4's boolean form is not supported)" : "");
    const double bound = value.get<double>();
    if (!(std::abs(bound) <= kMaxBound))
      fail("JSON schema \"{}\" at {} is {}; bounds beyond ±10^18 are not supported", keyword, path, value.dump());
    const std::string_view name = keyword;
    // The integers the bound lets through begin or end here (a fractional bound rounds inwards).
    if (name == "minimum" || name == "exclusiveMinimum") {
      const int64_t first = value.is_number_integer() ? value.get<int64_t>() + (name == "minimum" ? 0 : 1)
                                                      : static_cast<int64_t>(name == "minimum" ? std::ceil(bound)
                                                                                              : std::floor(bound) + 1);
      lower = std::max(lower.value_or(first), first);
    } else {
      const int64_t last = value.is_number_integer() ? value.get<int64_t>() - (name == "maximum" ? 0 : 1)
                                                     : static_cast<int64_t>(name == "maximum" ? std::floor(bound)
                                                                                             : std::ceil(bound) - 1);
      upper = std::min(upper.value_or(last), last);
    }
  }
  if (!lower && !upper) return integer_rule();
  if (lower && upper && *lower > *upper) fail("JSON schema at {}: no integer lies within its bounds", path);
  std::vector<Sequence> alternatives, negatives;
  const auto magnitude = [](int64_t value) { return static_cast<uint64_t>(value < 0 ? -value : value); };
  if (upper && *upper < 0) {
    natural_range(magnitude(*upper), lower ? std::optional<uint64_t>(magnitude(*lower)) : std::nullopt, negatives);
  } else if (lower && *lower >= 0) {
    natural_range(static_cast<uint64_t>(*lower), upper ? std::optional<uint64_t>(*upper) : std::nullopt, alternatives);
  } else {
    natural_range(1, lower ? std::optional<uint64_t>(magnitude(*lower)) : std::nullopt, negatives);
    natural_range(0, upper ? std::optional<uint64_t>(*upper) : std::nullopt, alternatives);
  }
  for (const Sequence& negative : negatives) alternatives.push_back(concat({byte('-')}, negative));
  return grammar_.add_rule(path + " integer range", alternatives);
}

std::string SchemaCompiler::json_text(const json& value) const {
  const std::string text = value.dump();
  if (!markup_safe_) return text;
  // <, > and & appear only inside strings, where their escapes mean the same.
  std::string safe;
  for (char c : text) {
    if (c == '<')
      safe += "\\u003c";
    else if (c == '>')
      safe += "\\u003e";
    else if (c == '&')
      safe += "\\u0026";
    else
      safe += c;
  }
  return safe;
}

int32_t SchemaCompiler::compile_type(const std::string& type, const json& schema, const std::string& path) {
  if (type == "object") return compile_object(schema, path);
  if (type == "array") return compile_array(schema, path);
  if (type == "string") return compile_string(schema, path);
  if (type == "number") {
    for (const char* keyword : kBounds)
      if (schema.contains(keyword))
        fail("unsupported JSON schema keyword \"{}\" at {} for a number (it is supported for integers)", keyword,
             path);
    return number_rule();
  }
  if (type == "integer") return compile_integer(schema, path);
  if (type == "boolean") return grammar_.add_rule("boolean", {literal("true"), literal("false")});
  if (type == "null") return grammar_.add_rule("null", {literal("null")});
  fail("JSON schema \"type\" at {} is \"{}\"; expected object, array, string, number, integer, boolean or null", path,
       type);
}

int32_t SchemaCompiler::compile(const json& schema, const std::string& path) {
  if (grammar_.positions() > kMaxRequestGrammarPositions)
    fail("the JSON schema is too large: its grammar passes {} positions at {} (counted repetitions such as maxLength "
         "make one rule per count)",
         kMaxRequestGrammarPositions, path);
  if (depth_ == kMaxSchemaDepth) fail("the JSON schema nests deeper than {} at {}", kMaxSchemaDepth, path);
  ++depth_;
  const int32_t rule = compile_schema(schema, path);
  --depth_;
  return rule;
}

int32_t SchemaCompiler::compile_schema(const json& schema, const std::string& path) {
  if (schema.is_boolean()) {
    if (!schema.get<bool>()) fail("JSON schema at {} is false: nothing is allowed", path);
    return any_value();
  }
  if (!schema.is_object()) fail("JSON schema at {} must be an object or a boolean", path);
  for (const auto& [key, value] : schema.items())
    if (!kAnnotations.count(key) && !kKeywords.count(key)) unsupported(key, path);

  if (schema.contains("$ref")) {
    for (const auto& [key, value] : schema.items())
      if (kKeywords.count(key) && key != "$ref") unsupported(key + "\" beside \"$ref", path);
    if (!schema["$ref"].is_string()) fail("JSON schema \"$ref\" at {} must be a string", path);
    return resolve(schema["$ref"].get<std::string>(), path);
  }
  if (schema.contains("const")) return grammar_.add_rule(path + " const", {literal(json_text(schema["const"]))});
  if (schema.contains("enum")) {
    if (!schema["enum"].is_array() || schema["enum"].empty())
      fail("JSON schema \"enum\" at {} must be a non-empty array", path);
    std::vector<Sequence> values;
    for (const json& value : schema["enum"]) values.push_back(literal(json_text(value)));
    return grammar_.add_rule(path + " enum", values);
  }
  for (const char* combinator : {"anyOf", "oneOf", "allOf"}) {
    if (!schema.contains(combinator)) continue;
    const json& list = schema[combinator];
    if (!list.is_array() || list.empty()) fail("JSON schema \"{}\" at {} must be a non-empty array", combinator, path);
    if (std::string_view(combinator) == "allOf" && list.size() != 1) unsupported("allOf\" of several schemas", path);
    const int32_t rule = grammar_.add_rule(fmt::format("{} {}", path, combinator));
    for (size_t i = 0; i < list.size(); ++i)
      grammar_.add_alternative(rule, {ref(compile(list[i], child(child(path, combinator), std::to_string(i))))});
    return rule;
  }
  if (!schema.contains("type")) {
    // Without a type, a keyword that constrains one type would let every other through.
    for (const char* keyword : {"pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
      if (schema.contains(keyword))
        fail("JSON schema at {}: \"{}\" needs a \"type\" (string for pattern and format, integer for bounds)",
             path, keyword);
    if (schema.contains("properties") || schema.contains("additionalProperties")) return compile_object(schema, path);
    if (schema.contains("items")) return compile_array(schema, path);
    return any_value();
  }
  const json& type = schema["type"];
  if (type.is_string()) return compile_type(type.get<std::string>(), schema, path);
  if (!type.is_array() || type.empty()) fail("JSON schema \"type\" at {} must be a string or a non-empty array", path);
  const int32_t rule = grammar_.add_rule(path + " types");
  for (const json& each : type) {
    if (!each.is_string()) fail("JSON schema \"type\" at {} must list strings", path);
    grammar_.add_alternative(rule, {ref(compile_type(each.get<std::string>(), schema, path))});
  }
  return rule;
}

}  // namespace

int32_t add_json_schema(Grammar& grammar, const nlohmann::ordered_json& schema, bool markup_safe) {
  SchemaCompiler compiler(grammar, schema, markup_safe);
  const int32_t rule = compiler.compile(schema, "/");
  if (grammar.positions() > kMaxRequestGrammarPositions)
    fail("the JSON schema is too large: its grammar has {} positions, at most {} are supported (counted repetitions "
         "such as maxLength make one rule per count)",
         grammar.positions(), kMaxRequestGrammarPositions);
  return rule;
}

Grammar json_schema_grammar(const nlohmann::ordered_json& schema) {
  Grammar grammar;
  grammar.set_root(add_json_schema(grammar, schema));
  return grammar;
}

std::optional<std::string> string_format_regex(std::string_view format) {
  const auto found = kFormats.find(format);
  if (found == kFormats.end()) return std::nullopt;
  return found->second;
}

Grammar json_object_grammar() {
  const json schema = json::object();
  Grammar grammar;
  SchemaCompiler compiler(grammar, schema, false);
  grammar.set_root(compiler.any_object());
  return grammar;
}

}  // namespace kiln::grammar
