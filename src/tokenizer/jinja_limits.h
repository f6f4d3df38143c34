// The budgets of kiln's Jinja interpreter. Chat templates come from model folders people download,
// and their variables from clients, so both are untrusted: every way a template can nest, loop or
// grow is bounded here, and going over a bound is a kiln::Error naming the template and the limit,
// never a stack overflow, an endless render or a gigabyte allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::jinja {

// The limits of one template; the defaults are what kiln uses (tests may lower them).
struct Limits {
  // Nesting of blocks and expressions in the source ((((x))), not not x, a|f|f|f, nested {% if %}):
  // the parser and the renderer recurse once per level. Real templates nest about ten deep
  // (Qwen3.5's, the deepest llama.cpp ships, about 15).
  int parse_depth = 128;
  // Nested macro calls. Jinja2 runs about ten Python frames per macro call under Python's default
  // recursion limit of 1000, so transformers itself fails beyond about 100; real templates recurse
  // only to walk a JSON schema (a few levels).
  int call_depth = 200;
  // Nesting of nodes and expressions being rendered, across macro calls: what bounds the stack.
  // A level takes about 1.7 KB of stack in Release (gcc 12 -O3) and 9.8 KB in the Debug ASan build
  // (measured 2026-12-06 with a macro chain at this depth), so a render stays within 1.7 MiB, far
  // from the 8 MiB of a connection thread (tests/jinja_budget_test.cpp renders at this depth on
  // half of one). A simple recursive macro takes about four levels a call: it meets call_depth first.
  int render_depth = 1000;
  // Expression evaluations, rendered nodes, loop variables' entries, and the items and bytes
  // builtins walk (see below). 8 MiB of conversation in 1024 messages takes about 8 million
  // through Reka-Edge's template (it appends each message to the text so far three times, copying
  // 13 GB, as Jinja2 does too); 20 million evaluations take about a second, so an endless loop
  // ends quickly (copying, the slowest step, can take ten).
  uint64_t steps = 20'000'000;
  // The rendered text (and each captured block). The server accepts request bodies up to 8 MiB;
  // eight times that leaves room for any template's markup around the messages.
  uint64_t output_bytes = uint64_t{64} << 20;
};

// Any single value a template builds or receives (a string, or a list / dict with everything in
// it, counting each element as sizeof(Value)), bounded like the output. Checked before allocating.
inline constexpr uint64_t kMaxValueBytes = uint64_t{64} << 20;
// How deep lists and dicts nest, in template variables and in what a template builds: converting,
// printing, comparing and freeing a value recurse once per level. Client JSON (messages, tool
// schemas) nests a few dozen levels at most.
inline constexpr int kMaxValueDepth = 256;
// Bytes a step copies (memcpy runs near 10 GB/s; fewer would fail Reka-Edge's template on a large
// conversation) and bytes a step decodes or searches (UTF-8 decoding into code points is slower).
inline constexpr uint64_t kBytesCopiedPerStep = 2048;
inline constexpr uint64_t kBytesPerStep = 64;

class Budget;

// Where a builtin runs, for errors ("<origin>: line N: message") and for the budget it spends.
struct Location {
  const std::string* origin = nullptr;
  int line = 0;
  Budget* budget = nullptr;

  [[noreturn]] void error(const std::string& message) const;
  // Spends `units` steps of the render's budget.
  void charge(uint64_t units) const;
  // Before a value grows from `current` by `added` bytes: an error naming `what` past
  // kMaxValueBytes; else spends the steps of copying `added` bytes.
  void grow(uint64_t current, uint64_t added, std::string_view what) const;
};

// The steps one render has spent against its Limits.
class Budget {
 public:
  explicit Budget(const Limits& limits) : limits_(limits) {}
  const Limits& limits() const { return limits_; }
  void charge(uint64_t units, const Location& at);

 private:
  const Limits& limits_;
  uint64_t steps_ = 0;
};

// One level of nesting while alive: counts up `depth`, calling `too_deep` (which throws) past `limit`.
class NestingLevel {
 public:
  template <typename TooDeep>
  NestingLevel(int& depth, int limit, TooDeep&& too_deep) : depth_(depth) {
    if (depth_ >= limit) too_deep();
    ++depth_;
  }
  ~NestingLevel() { --depth_; }
  NestingLevel(const NestingLevel&) = delete;
  NestingLevel& operator=(const NestingLevel&) = delete;

 private:
  int& depth_;
};

// "64 MiB", "1000 bytes": limits in errors.
std::string describe_bytes(uint64_t bytes);

}  // namespace kiln::jinja
