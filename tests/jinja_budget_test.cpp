// The budgets of kiln's Jinja interpreter (issue 33): templates and their variables are untrusted,
// so deep nesting, endless recursion and loops, and huge values are errors naming the template and
// the limit, never a stack overflow, a hang or a gigabyte allocation; real templates with a large
// conversation still render. Deep inputs run on a thread with an 8 MiB stack, as the server's
// connection threads have.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <ctime>
#include <exception>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_stack.h"
#include "npm_reference.h"
#include "test_support.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/jinja_template.h"

namespace {

namespace fs = std::filesystem;
using kiln::jinja::Limits;
using kiln::jinja::Template;
using ordered_json = nlohmann::ordered_json;

constexpr size_t kConnectionThreadStack = size_t{8} << 20;  // glibc's default thread stack

// AddressSanitizer makes frames several times larger (a render level takes about 9.8 KB in the
// Debug ASan build against 1.7 KB in Release, measured 2026-12-06): under it the stacks these tests
// give are scaled, so that they check the Release margins, not ASan's frames.
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kSanitizerStackScale = 8;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr size_t kSanitizerStackScale = 8;
#else
constexpr size_t kSanitizerStackScale = 1;
#endif
#else
constexpr size_t kSanitizerStackScale = 1;
#endif

// The same for CPU time: the loop tests below take about 2 s in Release and 170 s in the Debug
// ASan build (measured 2026-12-06); their bounds only tell seconds from hours.
constexpr double kSanitizerSlowdown = kSanitizerStackScale > 1 ? 20.0 : 1.0;

// Runs `action` on a thread with a `stack_bytes` stack (scaled under sanitizers), passing back any
// exception.
void on_thread_with_stack(size_t stack_bytes, const std::function<void()>& action) {
  kiln::run_with_stack(stack_bytes * kSanitizerStackScale, action);
}

std::string render(const std::string& source, const ordered_json& variables = ordered_json::object(),
                   const Limits& limits = {}) {
  return Template(source, "budget.jinja", limits).render(variables);
}

// Expects rendering (parsing included) on a connection-sized stack to fail naming the template
// and `fragments`.
void expect_limit_error(const std::string& source, const std::vector<std::string>& fragments,
                        const ordered_json& variables = ordered_json::object(), const Limits& limits = {}) {
  std::vector<std::string> expected = {"budget.jinja"};
  expected.insert(expected.end(), fragments.begin(), fragments.end());
  kiln::testing::expect_error_mentions(
      [&] { on_thread_with_stack(kConnectionThreadStack, [&] { render(source, variables, limits); }); }, expected);
}

std::string repeat(const std::string& text, size_t times) {
  std::string out;
  for (size_t i = 0; i < times; ++i) out += text;
  return out;
}

// CPU seconds of the process (the machine running the tests may be shared, so not wall time).
double cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

long peak_resident_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

TEST(JinjaBudget, RecursiveMacroIsAnError) {
  expect_limit_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
                     {"line 1", "macro 'f'", "deeper than 200 levels"});
  // A macro recursing through blocks and arguments meets the render depth or the call depth.
  expect_limit_error(
      "{% macro f(n) %}{% for x in [n] %}{% if x is defined %}{{ f(n + 1) }}{% endif %}{% endfor %}{% endmacro %}"
      "{{ f(0) }}",
      {"deeper than"});
}

TEST(JinjaBudget, DeepNestingIsAParseError) {
  const size_t depth = 20000;
  const std::vector<std::string> sources = {
      "{{ " + repeat("(", depth) + "1" + repeat(")", depth) + " }}",
      "{{ " + repeat("[", depth) + "1" + repeat("]", depth) + " }}",
      "{{ " + repeat("{'a': ", depth) + "1" + repeat("}", depth) + " }}",
      "{{ " + repeat("not ", depth) + "1 }}",
      "{{ " + repeat("-", depth) + "1 }}",
      "{{ 1" + repeat("|string", depth) + " }}",
      "{{ 1" + repeat(" + 1", depth) + " }}",
      "{{ x" + repeat(".a", depth) + " }}",
      "{{ f" + repeat("()", depth) + " }}",
      "{{ 1" + repeat(" if 1 else 1", depth) + " }}",
      repeat("{% if true %}", depth) + repeat("{% endif %}", depth),
      repeat("{% for x in [1] %}", depth) + repeat("{% endfor %}", depth),
  };
  for (const std::string& source : sources)
    kiln::testing::expect_error_mentions(
        [&] { on_thread_with_stack(kConnectionThreadStack, [&] { Template(source, "budget.jinja"); }); },
        {"budget.jinja", "line 1", "deeper than 128 levels"});
}

TEST(JinjaBudget, NestingWithinTheLimitRenders) {
  const size_t depth = Limits{}.parse_depth - 1;
  EXPECT_EQ(render("{{ " + repeat("(", depth) + "1" + repeat(")", depth) + " }}"), "1");
  EXPECT_EQ(render(repeat("{% if true %}", depth) + "x" + repeat("{% endif %}", depth)), "x");
  Limits shallow;
  shallow.parse_depth = 3;
  EXPECT_EQ(render("{% if true %}{{ (1) }}{% endif %}", ordered_json::object(), shallow), "1");
  expect_limit_error("{% if true %}{% if true %}{{ ((1)) }}{% endif %}{% endif %}", {"deeper than 3 levels"},
                     ordered_json::object(), shallow);
}

TEST(JinjaBudget, HugeValuesAreRefusedBeforeAllocating) {
  const long peak_before = peak_resident_kib();
  expect_limit_error("{{ range(999999999) }}", {"range(999999999)", "64 MiB"});
  expect_limit_error("{{ 'a' * 999999999999 }}", {"'*'", "64 MiB"});
  expect_limit_error("{{ [1, 2] * 999999999999 }}", {"'*'", "64 MiB"});
  expect_limit_error("{% set s = 'a' * 50000000 %}{{ s ~ s }}", {"'~'", "64 MiB"});
  expect_limit_error("{% set s = 'a' * 50000000 %}{{ s + s }}", {"'+'", "64 MiB"});
  expect_limit_error("{% set l = range(1000000) %}{{ (l + l)|length }}", {"'+'", "64 MiB"});
  expect_limit_error("{{ [1, 2, 3]|join('a' * 40000000) }}", {"joined string", "64 MiB"});
  expect_limit_error("{{ ('a' * 40000000).join(['x', 'y', 'z']) }}", {"joined string", "64 MiB"});
  expect_limit_error("{{ 'a\nb'|indent(999999999999) }}", {"indent", "64 MiB"});
  expect_limit_error("{{ ('\n' * 1000000)|indent(1000, blank=true) }}", {"indented string", "64 MiB"});
  expect_limit_error("{{ ('a' * 1000000).replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') }}",
                     {"replaced string", "64 MiB"});
  expect_limit_error("{{ (',' * 30000000).split(',')|length }}", {"split result", "64 MiB"});
  expect_limit_error("{% for c in 'a' * 30000000 %}{% endfor %}", {"characters", "64 MiB"});
  expect_limit_error("{{ [1]|tojson(indent=999999999999) }}", {"indent", "64 MiB"});
  // A list of references to one big string counts the string each time.
  expect_limit_error("{% set s = 'a' * 1000000 %}{{ [s] * 100 }}", {"'*'", "64 MiB"});
  // None of it came near a gigabyte.
  EXPECT_LT(peak_resident_kib() - peak_before, 1L << 20);
}

TEST(JinjaBudget, OutputIsBounded) {
  expect_limit_error("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
                     {"rendered text", "64 MiB"});
  Limits small;
  small.output_bytes = 10;
  EXPECT_EQ(render("{{ 'x' * 10 }}", ordered_json::object(), small), "xxxxxxxxxx");
  expect_limit_error("{{ 'x' * 10 }}!", {"rendered text", "10 bytes"}, ordered_json::object(), small);
  expect_limit_error("{% set s %}{{ 'x' * 11 }}{% endset %}", {"rendered text", "10 bytes"}, ordered_json::object(),
                     small);
}

TEST(JinjaBudget, NestedLoopsEndQuickly) {
  const double start = cpu_seconds();
  expect_limit_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     {"more than 20000000 steps"});
  expect_limit_error("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
                     {"more than 20000000 steps"});
  // Not a timing: without the budget these loops run for hours; with it, seconds even on a busy
  // machine or under ASan.
  EXPECT_LT(cpu_seconds() - start, 60.0 * kSanitizerSlowdown);
}

TEST(JinjaBudget, WorkInsideBuiltinsCountsAsSteps) {
  const double start = cpu_seconds();
  // One evaluation each, but each walks a large value.
  expect_limit_error("{% set l = range(1000000) %}{% for i in range(100000) %}{{ 5 in l }}{% endfor %}",
                     {"steps"});
  expect_limit_error("{% set s = 'a' * 60000000 %}{% for i in range(100000) %}{{ s|length }}{% endfor %}",
                     {"steps"});
  Limits fewer;
  fewer.steps = 1'000'000;
  expect_limit_error("{% set s = 'a' * 60000000 %}{% for i in range(100000) %}{% set t = s ~ '' %}{% endfor %}",
                     {"more than 1000000 steps"}, ordered_json::object(), fewer);
  expect_limit_error("{{ range(1000000)|unique|length }}", {"steps"});
  EXPECT_LT(cpu_seconds() - start, 120.0 * kSanitizerSlowdown);  // without the budget: hours
  EXPECT_EQ(render("{{ 1 ** 999999999999 }}"), "1");
  expect_limit_error("{{ 2 ** 999999999999 }}", {"overflows"});
  EXPECT_EQ(render("{{ 3 ** 5 }} {{ (-2) ** 63 }}"), "243 -9223372036854775808");
  Limits few;
  few.steps = 100;
  expect_limit_error("{% for i in range(1000) %}{% endfor %}", {"more than 100 steps"}, ordered_json::object(), few);
}

// Built by moving each level into the next: nlohmann copies (an initializer list, a copy
// constructor) recurse once per level and would overflow the test's own stack.
ordered_json nested_json(size_t depth) {
  ordered_json value = "leaf";
  for (size_t i = 0; i < depth; ++i) {
    ordered_json wrapper = ordered_json::array();
    wrapper.push_back(std::move(value));
    value = std::move(wrapper);
  }
  return value;
}

TEST(JinjaBudget, DeepVariablesAreAnError) {
  constexpr size_t kDeep = 20000;
  ordered_json variables = ordered_json::object();
  variables["x"] = nested_json(kDeep);
  expect_limit_error("{{ x }}", {"template variable 'x'", "deeper than 256 levels"}, variables);
  // Through ChatTemplate, as the server hands a client's messages over.
  const kiln::ChatTemplate chat("{{ messages }}", "budget.jinja", std::nullopt, std::nullopt);
  ordered_json messages = ordered_json::array();
  messages.push_back({{"role", "user"}});
  messages[0]["content"] = nested_json(kDeep);
  kiln::testing::expect_error_mentions(
      [&] {
        on_thread_with_stack(kConnectionThreadStack, [&] { chat.render(messages, kiln::ChatTemplateOptions{}); });
      },
      {"budget.jinja", "messages", "deeper than 256 levels"});
  kiln::ChatTemplateOptions options;
  options.tools = ordered_json::array();
  options.tools.push_back(nested_json(kDeep));
  kiln::testing::expect_error_mentions(
      [&] {
        on_thread_with_stack(kConnectionThreadStack,
                             [&] { chat.render(ordered_json::array({{{"role", "user"}}}), options); });
      },
      {"budget.jinja", "tools", "deeper than 256 levels"});
  // Within the limit, the value renders (and converts, prints and frees on this stack).
  const ordered_json within = nested_json(200);
  on_thread_with_stack(kConnectionThreadStack, [&] {
    EXPECT_EQ(render("{{ x|tojson }}", {{"x", within}}), within.dump());
  });
}

TEST(JinjaBudget, TemplatesCannotBuildDeepValues) {
  expect_limit_error(
      "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
      {"nests deeper than 256 levels"});
  expect_limit_error(
      "{% set ns = namespace(x={}) %}{% for i in range(100000) %}{% set ns.x = {'a': ns.x} %}{% endfor %}",
      {"nests deeper than 256 levels"});
  // A namespace in a namespace could make a cycle or a chain no value's depth records.
  expect_limit_error(
      "{% set ns = namespace(tail=namespace()) %}{% for i in range(100000) %}{% set n = namespace() %}"
      "{% set t = ns.tail %}{% set t.next = n %}{% set ns.tail = n %}{% endfor %}",
      {"cannot assign a namespace"});
  expect_limit_error("{% set ns = namespace() %}{% set ns.me = [ns] %}{{ ns|tojson }}", {"cannot assign a namespace"});
  expect_limit_error("{% set ns = namespace(a=1) %}{{ ns|tojson }}", {"Namespace is not JSON serializable"});
}

TEST(JinjaBudget, RenderDepthBoundsTheStack) {
  // A macro chain as deep as the render depth allows fits half a connection thread's stack (it
  // needs about 1.7 MiB in Release; jinja_limits.h).
  Limits limits;
  limits.call_depth = 100000;
  const std::string source = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(100000) }}";
  kiln::testing::expect_error_mentions(
      [&] { on_thread_with_stack(kConnectionThreadStack / 2, [&] { render(source, ordered_json::object(), limits); }); },
      {"budget.jinja", "deeper than 1000 levels"});
}

TEST(JinjaBudget, ModelTemplatesRenderALargeConversation) {
  // Every template llama.cpp ships, with 8 MiB of conversation (what the server accepts): none
  // meets a limit.
  KILN_REQUIRE_NPM();
  ordered_json messages = ordered_json::array();
  const std::string paragraph = repeat("The quick brown fox jumps over the lazy dog. ", 180);  // 8 KiB
  for (int i = 0; i < 1024; ++i)
    messages.push_back({{"role", i % 2 == 0 ? "user" : "assistant"}, {"content", paragraph}});
  size_t rendered = 0;
  for (const auto& entry : fs::directory_iterator(kiln::testing::llama_cpp_models_dir() / "templates")) {
    if (entry.path().extension() != ".jinja") continue;
    const kiln::ChatTemplate chat(kiln::testing::read_text_file(entry.path()), entry.path().filename().string(), "<s>",
                                  "</s>");
    kiln::ChatTemplateOptions options;
    options.add_generation_prompt = true;
    options.extra["date_string"] = "26 Jul 2024";
    try {
      on_thread_with_stack(kConnectionThreadStack, [&] {
        EXPECT_GT(chat.render(messages, options).size(), paragraph.size() * messages.size());
      });
      ++rendered;
    } catch (const kiln::Error& error) {
      // Some templates refuse this conversation on their own terms (raise_exception); no limit may.
      const std::string message = error.what();
      EXPECT_EQ(message.find("limit"), std::string::npos) << message;
    }
  }
  EXPECT_GE(rendered, 30u);
}

}  // namespace
