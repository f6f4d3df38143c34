#include "text/tool_call_grammar.h"

#include <map>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"
#include "engine/grammar/char_set.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex.h"

namespace kiln {

namespace {

using json = nlohmann::ordered_json;
using grammar::CharSet;
using grammar::Grammar;
using grammar::Sequence;
using grammar::Symbol;
using grammar::concat;
using grammar::literal;

Symbol ref(int32_t rule) { return Symbol::reference(rule); }

// Keywords that say nothing about a value.
const std::set<std::string, std::less<>> kAnnotations = {"title",   "description", "default",  "examples",
                                                         "$comment", "deprecated", "readOnly", "writeOnly"};

// Raw text that never holds a given marker, as a small automaton over characters: each state's
// moves (a character set and the state it leads to). State 0 is the start; every state may end.
struct TextAutomaton {
  std::vector<std::vector<std::pair<CharSet, int>>> moves;
};

// Qwen XML: no "</" (which would start </parameter> or </tool_call>). State 1: after '<'.
TextAutomaton text_without_closing_tags() {
  const CharSet open = CharSet::of('<');
  const CharSet open_or_slash = CharSet::of('<').add('/', '/');
  return {{{{open.complement(), 0}, {open, 1}}, {{open_or_slash.complement(), 0}, {open, 1}}}};
}

// MiniCPM XML inside CDATA: no "]]>". State 1: after one ']'; state 2: after two or more.
TextAutomaton text_without_cdata_end() {
  const CharSet bracket = CharSet::of(']');
  const CharSet bracket_or_close = CharSet::of(']').add('>', '>');
  return {{{{bracket.complement(), 0}, {bracket, 1}},
           {{bracket.complement(), 0}, {bracket, 2}},
           {{bracket_or_close.complement(), 0}, {bracket, 2}}}};
}

class ToolCallGrammar {
 public:
  ToolCallGrammar(ToolCallSyntax syntax, Grammar& rules) : syntax_(syntax), rules_(rules) {}

  // The text of one call of `name` with these parameters.
  Sequence call(const std::string& name, const json& parameters) {
    if (syntax_ == ToolCallSyntax::Hermes || syntax_ == ToolCallSyntax::LlamaJson) return json_call(name, parameters);
    return xml_call(name, parameters);
  }

 private:
  // {"name":"N","arguments":{…}} (Hermes, in <tool_call> lines) or {"name":"N","parameters":{…}}.
  Sequence json_call(const std::string& name, const json& parameters) {
    // Hermes arguments sit inside <tool_call> markup: no string in them may write its closing tag.
    const int32_t arguments = grammar::add_json_schema(rules_, parameters, syntax_ == ToolCallSyntax::Hermes);
    const std::string quoted = json(name).dump();
    Sequence body = syntax_ == ToolCallSyntax::Hermes
                        ? literal("<tool_call>\n{\"name\":" + quoted + ",\"arguments\":")
                        : literal("{\"name\":" + quoted + ",\"parameters\":");
    body.push_back(ref(arguments));
    return concat(body, literal(syntax_ == ToolCallSyntax::Hermes ? "}\n</tool_call>" : "}"));
  }

  Sequence xml_call(const std::string& name, const json& parameters) {
    const bool qwen = syntax_ == ToolCallSyntax::QwenXml;
    check_markup_name(name, "tool name");
    if (!parameters.is_object() || (parameters.contains("type") && parameters["type"] != "object") ||
        parameters.contains("anyOf") || parameters.contains("oneOf") || parameters.contains("allOf") ||
        parameters.contains("$ref"))
      fail("its parameters must be an object schema to be written as XML parameters");
    const json properties = parameters.value("properties", json::object());
    std::set<std::string> required;
    for (const json& key : parameters.value("required", json::array())) {
      if (!key.is_string() || !properties.contains(key.get<std::string>()))
        fail("\"required\" names {}, which is not in \"properties\"", key.dump());
      required.insert(key.get<std::string>());
    }
    Sequence body = literal(qwen ? "<tool_call>\n<function=" + name + ">\n" : "<function name=\"" + name + "\">");
    for (const auto& [key, property] : properties.items()) {
      check_markup_name(key, "parameter name");
      Sequence parameter =
          literal(qwen ? "<parameter=" + key + ">\n" : "<param name=\"" + key + "\">");
      parameter = concat(parameter, value(key, property, parameters));
      parameter = concat(parameter, literal(qwen ? "\n</parameter>\n" : "</param>"));
      if (required.count(key)) {
        body = concat(body, parameter);
      } else {
        const int32_t optional = rules_.add_rule(fmt::format("{} {} optional", name, key), {{}, parameter});
        body.push_back(ref(optional));
      }
    }
    return concat(body, literal(qwen ? "</function>\n</tool_call>" : "</function>"));
  }

  // A tool or parameter name is written raw inside the markup.
  void check_markup_name(const std::string& name, const char* what) const {
    const bool qwen = syntax_ == ToolCallSyntax::QwenXml;
    if (name.empty() || name.find_first_of(qwen ? "<>\n" : "<>\"") != std::string::npos)
      fail("the {} \"{}\" cannot be written in {} tool calls", what, name, tool_call_syntax_label());
  }

  const char* tool_call_syntax_label() const { return syntax_ == ToolCallSyntax::QwenXml ? "Qwen XML" : "MiniCPM XML"; }

  // A parameter's value as the reader takes it back.
  Sequence value(const std::string& key, const json& property, const json& parameters) {
    if (!xml_value_is_string(property)) {
      // The property's schema with the tool's definitions beside it, so that its $refs resolve.
      json schema = property;
      for (const char* definitions : {"$defs", "definitions"})
        if (parameters.contains(definitions) && schema.is_object() && !schema.contains(definitions))
          schema[definitions] = parameters[definitions];
      try {
        return {ref(grammar::add_json_schema(rules_, schema, true))};
      } catch (const Error& error) {
        fail("parameter {}: {}", key, error.what());
      }
    }
    const int32_t text = raw_string(key, property);
    if (syntax_ == ToolCallSyntax::QwenXml) return {ref(text)};
    return concat(concat(literal("<![CDATA["), {ref(text)}), literal("]]>"));
  }

  // A string value written as it is.
  int32_t raw_string(const std::string& key, const json& property) {
    if (!property.is_object()) return free_text(0, 0, -1);
    for (const auto& [keyword, unused] : property.items())
      if (!kAnnotations.count(keyword) && keyword != "type" && keyword != "enum" && keyword != "const" &&
          keyword != "format" && keyword != "minLength" && keyword != "maxLength")
        fail("parameter {}: \"{}\" on a string parameter is not supported in {} tool calls", key, keyword,
             tool_call_syntax_label());
    const bool qwen = syntax_ == ToolCallSyntax::QwenXml;
    const std::string_view forbidden = qwen ? "</" : "]]>";
    if (property.contains("enum") || property.contains("const")) {
      std::vector<Sequence> choices;
      for (const json& choice : property.contains("const") ? json::array({property["const"]}) : property["enum"]) {
        if (!choice.is_string()) continue;
        const std::string text = choice;
        if (text.find(forbidden) != std::string::npos)
          fail("parameter {}: the value {} cannot be written in {} tool calls", key, choice.dump(),
               tool_call_syntax_label());
        choices.push_back(literal(text));
      }
      if (choices.empty()) fail("parameter {}: its enum holds no string, and the parser reads its value as one", key);
      return rules_.add_rule(fmt::format("{} choices", key), choices);
    }
    const auto length = [&](const char* keyword, int64_t absent) {
      if (!property.contains(keyword)) return absent;
      const json& value = property[keyword];
      if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > kMaxCountedLength)
        fail("parameter {}: \"{}\" must be an integer from 0 to {}", key, keyword, kMaxCountedLength);
      return value.get<int64_t>();
    };
    const int64_t min = length("minLength", 0), max = length("maxLength", -1);
    if (property.contains("format")) {
      if (property.contains("minLength") || property.contains("maxLength"))
        fail("parameter {}: \"format\" together with minLength or maxLength is not supported", key);
      const std::optional<std::string> regex =
          property["format"].is_string() ? grammar::string_format_regex(property["format"].get<std::string>())
                                         : std::nullopt;
      if (!regex) fail("parameter {}: unsupported string format {}", key, property["format"].dump());
      // The formats' texts hold neither '<' nor "]]>".
      return grammar::add_regex(rules_, *regex);
    }
    if (max >= 0 && min > max) fail("parameter {}: minLength {} is above maxLength {}", key, min, max);
    return free_text(0, min, max);
  }

  // Raw text of `count` characters so far, between `min` and `max` (-1: no limit), in the
  // syntax's safe-text automaton; one rule per (count, state), counts past min folded where
  // there is no max.
  int32_t free_text(int64_t count, int64_t min, int64_t max) {
    if (!automaton_) {
      automaton_ = syntax_ == ToolCallSyntax::QwenXml ? text_without_closing_tags() : text_without_cdata_end();
      for (const auto& moves : automaton_->moves) {
        texts_.emplace_back();
        for (const auto& [chars, next] : moves)
          texts_.back().push_back(grammar::char_set_sequences(chars, grammar::CharEncoding::Utf8));
      }
    }
    made_.clear();
    return text_state(count, 0, min, max);
  }

  int32_t text_state(int64_t count, int state, int64_t min, int64_t max) {
    const int64_t key = max < 0 && count > min ? min : count;
    if (const auto found = made_.find({key, state}); found != made_.end()) return found->second;
    const int32_t rule = rules_.add_rule(fmt::format("text {} {}", key, state));
    made_[{key, state}] = rule;
    if (key >= min) rules_.add_alternative(rule, {});
    if (max < 0 || key < max) {
      const auto& moves = automaton_->moves[state];
      for (size_t i = 0; i < moves.size(); ++i) {
        const int32_t next = text_state(key + 1, moves[i].second, min, max);
        for (const Sequence& text : texts_[state][i]) rules_.add_alternative(rule, concat(text, {ref(next)}));
      }
      if (rules_.positions() > grammar::kMaxRequestGrammarPositions)
        fail("the tools' grammar passes {} positions (maxLength makes rules per count)",
             grammar::kMaxRequestGrammarPositions);
    }
    return rule;
  }

  static constexpr int64_t kMaxCountedLength = 1000;

  ToolCallSyntax syntax_;
  Grammar& rules_;
  std::optional<TextAutomaton> automaton_;
  std::vector<std::vector<std::vector<Sequence>>> texts_;  // per state and move: the moves' texts
  std::map<std::pair<int64_t, int>, int32_t> made_;
};

}  // namespace

grammar::Grammar tool_call_grammar(ToolCallSyntax syntax, const json& tools, const std::optional<std::string>& forced,
                                   bool several) {
  if (syntax == ToolCallSyntax::None) fail("forcing a tool call needs a chat template that describes tool calls");
  Grammar rules;
  ToolCallGrammar writer(syntax, rules);
  const int32_t call = rules.add_rule("call");
  for (const auto& tool : tools) {
    const std::string name = tool["function"]["name"];
    if (forced && name != *forced) continue;
    const json parameters = tool["function"].value("parameters", json{{"type", "object"}});
    try {
      rules.add_alternative(call, writer.call(name, parameters));
    } catch (const Error& error) {
      fail("the parameters of tool {}: {}", name, error.what());
    }
  }
  if (rules.alternatives(call).empty()) fail("no tool is named \"{}\"", forced.value_or(""));
  if (rules.positions() > grammar::kMaxRequestGrammarPositions)
    fail("the tools' grammar is too large: it has {} positions, at most {} are supported", rules.positions(),
         grammar::kMaxRequestGrammarPositions);
  if (forced || !several || syntax == ToolCallSyntax::LlamaJson) {
    rules.set_root(call);
  } else {
    const int32_t calls = rules.add_rule("calls");
    rules.add_alternative(calls, {ref(call)});
    rules.add_alternative(calls, concat({ref(call)}, concat(literal("\n"), {ref(calls)})));
    rules.set_root(calls);
  }
  rules.check();
  return rules;
}

}  // namespace kiln
