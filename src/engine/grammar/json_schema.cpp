#include "engine/grammar/json_schema.h"

#include <array>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "core/error.h"

namespace kiln::grammar {

namespace {

using json = nlohmann::ordered_json;

// A counted repetition (maxLength, minItems, ...) becomes one rule per count; past this many the
// grammar, and the token tables compiled for each of its positions, would grow without bound.
constexpr int64_t kMaxCountedRepeats = 1000;
// Compiling costs a walk of the vocabulary per grammar position (a wide one, inside a string, some
// tens of microseconds per thousand tokens), and a schema comes from a request: past this many
// positions it is refused rather than compiled for seconds.
constexpr size_t kMaxGrammarPositions = 20000;
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
    "maxLength", "format"};

Symbol ref(int32_t rule) { return Symbol::reference(rule); }
Symbol bytes(uint8_t first, uint8_t last) { return Symbol::byte_set(ByteSet::range(first, last)); }
Symbol byte(char c) { return Symbol::byte_set(ByteSet::of(static_cast<uint8_t>(c))); }

class SchemaCompiler {
 public:
  SchemaCompiler(Grammar& grammar, const json& root) : root_(root), grammar_(grammar) {}

  // Checks the limits, then compiles.
  int32_t compile(const json& schema, const std::string& path);
  int32_t any_value();
  int32_t any_object();

 private:
  int32_t compile_object(const json& schema, const std::string& path);
  int32_t compile_array(const json& schema, const std::string& path);
  int32_t compile_string(const json& schema, const std::string& path);
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
  const ByteSet unescaped = ByteSet::range(0x20, 0x7F).without(ByteSet::of('"').add('\\', '\\'));
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
      member = concat(member, literal(json(listed[i].first).dump() + ":"));
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
  if (schema.contains("format")) {
    if (schema.contains("minLength") || schema.contains("maxLength"))
      fail("JSON schema at {}: \"format\" together with minLength or maxLength is not supported", path);
    if (!schema["format"].is_string()) fail("JSON schema \"format\" at {} must be a string", path);
    const std::string format = schema["format"];
    const Symbol digit = bytes('0', '9');
    const Symbol hex = Symbol::byte_set(ByteSet::range('0', '9').add('a', 'f').add('A', 'F'));
    const int32_t month = grammar_.add_rule("month", {{byte('0'), bytes('1', '9')}, {byte('1'), bytes('0', '2')}});
    const int32_t day = grammar_.add_rule(
        "day", {{byte('0'), bytes('1', '9')}, {bytes('1', '2'), digit}, {byte('3'), bytes('0', '1')}});
    const Sequence date = {digit, digit, digit, digit, byte('-'), ref(month), byte('-'), ref(day)};
    const int32_t hour = grammar_.add_rule("hour", {{bytes('0', '1'), digit}, {byte('2'), bytes('0', '3')}});
    const Sequence minute = {bytes('0', '5'), digit};
    const int32_t fraction = grammar_.add_rule("second_fraction", {{}, {byte('.'), digit, ref(digits_rule())}});
    const int32_t offset = grammar_.add_rule(
        "time_offset", {{byte('Z')}, concat({Symbol::byte_set(ByteSet::of('+').add('-', '-')), ref(hour), byte(':')},
                                             minute)});
    const Sequence time = concat(concat(concat({ref(hour), byte(':')}, minute), concat({byte(':')}, minute)),
                                 {ref(fraction), ref(offset)});
    Sequence body;
    if (format == "date") {
      body = date;
    } else if (format == "time") {
      body = time;
    } else if (format == "date-time") {
      body = concat(concat(date, {byte('T')}), time);
    } else if (format == "uuid") {
      for (int group : {8, 4, 4, 4, 12}) {
        if (!body.empty()) body.push_back(byte('-'));
        body.insert(body.end(), group, hex);
      }
    } else {
      fail("unsupported JSON schema format \"{}\" at {} (supported: date, time, date-time, uuid)", format, path);
    }
    return grammar_.add_rule(fmt::format("{} {}", path, format), {concat(concat({byte('"')}, body), {byte('"')})});
  }
  if (min == 0 && max == kUnbounded) return string_rule();
  std::map<int64_t, int32_t> made;
  return grammar_.add_rule(fmt::format("{} string", path), {{byte('"'), ref(characters(0, min, max, made))}});
}

int32_t SchemaCompiler::compile_type(const std::string& type, const json& schema, const std::string& path) {
  if (type == "object") return compile_object(schema, path);
  if (type == "array") return compile_array(schema, path);
  if (type == "string") return compile_string(schema, path);
  if (type == "number") return number_rule();
  if (type == "integer") return integer_rule();
  if (type == "boolean") return grammar_.add_rule("boolean", {literal("true"), literal("false")});
  if (type == "null") return grammar_.add_rule("null", {literal("null")});
  fail("JSON schema \"type\" at {} is \"{}\"; expected object, array, string, number, integer, boolean or null", path,
       type);
}

int32_t SchemaCompiler::compile(const json& schema, const std::string& path) {
  if (grammar_.positions() > kMaxGrammarPositions)
    fail("the JSON schema is too large: its grammar passes {} positions at {} (counted repetitions such as maxLength "
         "make one rule per count)",
         kMaxGrammarPositions, path);
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
  if (schema.contains("const")) return grammar_.add_rule(path + " const", {literal(schema["const"].dump())});
  if (schema.contains("enum")) {
    if (!schema["enum"].is_array() || schema["enum"].empty())
      fail("JSON schema \"enum\" at {} must be a non-empty array", path);
    std::vector<Sequence> values;
    for (const json& value : schema["enum"]) values.push_back(literal(value.dump()));
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

int32_t add_json_schema(Grammar& grammar, const nlohmann::ordered_json& schema) {
  SchemaCompiler compiler(grammar, schema);
  const int32_t rule = compiler.compile(schema, "/");
  if (grammar.positions() > kMaxGrammarPositions)
    fail("the JSON schema is too large: its grammar has {} positions, at most {} are supported (counted repetitions "
         "such as maxLength make one rule per count)",
         grammar.positions(), kMaxGrammarPositions);
  return rule;
}

Grammar json_schema_grammar(const nlohmann::ordered_json& schema) {
  Grammar grammar;
  grammar.set_root(add_json_schema(grammar, schema));
  return grammar;
}

Grammar json_object_grammar() {
  const json schema = json::object();
  Grammar grammar;
  SchemaCompiler compiler(grammar, schema);
  grammar.set_root(compiler.any_object());
  return grammar;
}

}  // namespace kiln::grammar
