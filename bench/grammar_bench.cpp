// Structured output's cost: building the vocabulary trie, compiling grammars against it, and the
// token mask of each step.
//   kiln_grammar_bench TOKENIZER_DIR_OR_JSON [STEPS] [SCHEMA_JSON_FILE] [--regex PATTERN] [--gbnf GBNF_FILE]
// For a JSON schema, json_object, a regex and a GBNF grammar it walks STEPS tokens (default 2000)
// through the masks, choosing a random allowed token (half of the time one that closes a string,
// array or object, so the walk visits the structure and not only long strings), and prints the
// mask time per step (mean, p50, p99, max) in the thread's CPU time. A schema file, a pattern or a
// GBNF file replaces the built-in one.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/grammar/gbnf.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex.h"
#include "engine/grammar/token_mask.h"
#include "tokenizer/tokenizer.h"

namespace {

using json = nlohmann::ordered_json;
using namespace kiln::grammar;

// CPU time of the calling thread: on a shared machine wall time also counts other processes.
double thread_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

void walk(const char* name, const std::shared_ptr<const CompiledGrammar>& grammar, int steps) {
  std::mt19937 random(42);
  const TokenVocabulary& vocabulary = grammar->vocabulary();
  std::vector<double> times;
  TokenMask mask = empty_mask(vocabulary.size());
  std::vector<int32_t> allowed;
  int documents = 0;
  auto matcher = std::make_unique<GrammarMatcher>(grammar);
  while (static_cast<int>(times.size()) < steps) {
    if (!matcher->can_continue()) {
      matcher = std::make_unique<GrammarMatcher>(grammar);
      ++documents;
    }
    const double start = thread_seconds();
    matcher->fill_mask(mask);
    times.push_back(thread_seconds() - start);
    allowed.clear();
    for (int32_t id = 0; id < vocabulary.size(); ++id)
      if (mask_allows(mask, id)) allowed.push_back(id);
    if (allowed.empty()) kiln::fail("{}: no token allowed", name);
    int32_t id = allowed[random() % allowed.size()];
    if (random() % 2 == 0) {
      std::vector<int32_t> closing;
      for (int32_t candidate : allowed)
        if (vocabulary.bytes(candidate).find_first_of("\"]}") != std::string::npos) closing.push_back(candidate);
      if (!closing.empty()) id = closing[random() % closing.size()];
    }
    matcher->accept_token(id);
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  double total = 0;
  for (double time : times) total += time;
  std::printf("%-12s mask per step: mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us (%d steps, %d documents)\n",
              name, 1e6 * total / times.size(), 1e6 * sorted[sorted.size() / 2], 1e6 * sorted[sorted.size() * 99 / 100],
              1e6 * sorted.back(), steps, documents);
}

// A file's whole text.
std::string read_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) kiln::fail("{}: cannot open", path);
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

std::shared_ptr<const CompiledGrammar> compile_timed(const char* name, Grammar grammar,
                                                     const std::shared_ptr<const TokenVocabulary>& vocabulary) {
  const double start = thread_seconds();
  auto compiled = std::make_shared<const CompiledGrammar>(std::move(grammar), vocabulary);
  std::printf("%s: %zu grammar positions compiled in %.1f ms\n", name, compiled->grammar().positions(),
              1e3 * (thread_seconds() - start));
  return compiled;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  // A sentence-like regex and a GBNF grammar of nested lists with quoted words.
  std::string pattern = "[A-Z][a-z]{1,12}( [a-z]{1,12}){2,20}(, [a-z]+ \\d{1,4})?\\.( [A-Z][a-z]+[^\\n]{0,40}\\.)*";
  std::string gbnf =
      "root ::= list\n"
      "list ::= \"[\" ws (item (\",\" ws item)*)? \"]\"\n"
      "item ::= list | [0-9]{1,6} | \"\\\"\" [^\"\\\\\\x00-\\x1F]* \"\\\"\"\n"
      "ws ::= [ \\n]?\n";
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if ((argument == "--regex" || argument == "--gbnf") && i + 1 < argc) {
      (argument == "--regex" ? pattern : gbnf) = argument == "--regex" ? std::string(argv[i + 1]) : read_file(argv[i + 1]);
      ++i;
    } else {
      positional.push_back(argument);
    }
  }
  if (positional.empty()) {
    std::fprintf(stderr,
                 "usage: kiln_grammar_bench TOKENIZER_DIR_OR_JSON [STEPS] [SCHEMA_JSON_FILE] [--regex PATTERN] "
                 "[--gbnf GBNF_FILE]\n");
    return 2;
  }
  try {
    const int steps = positional.size() > 1 ? std::stoi(positional[1]) : 2000;
    const kiln::Tokenizer tokenizer = kiln::Tokenizer::load(positional[0]);
    double start = thread_seconds();
    std::vector<std::string> bytes(tokenizer.vocab_size());
    for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) bytes[id] = tokenizer.token_bytes(id);
    const auto vocabulary = std::make_shared<const TokenVocabulary>(std::move(bytes));
    std::printf("vocabulary: %d tokens, trie of %zu nodes built in %.1f ms\n", vocabulary->size(),
                vocabulary->trie().nodes(), 1e3 * (thread_seconds() - start));

    json schema = json::parse(R"({
      "type": "object",
      "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]}
      },
      "required": ["name", "age", "active"]
    })");
    if (positional.size() > 2) schema = json::parse(read_file(positional[2]));
    const auto schema_grammar = compile_timed("json_schema", json_schema_grammar(schema), vocabulary);
    const auto object_grammar = compile_timed("json_object", json_object_grammar(), vocabulary);
    const auto regex_compiled = compile_timed("regex", regex_grammar(pattern), vocabulary);
    const auto gbnf_compiled = compile_timed("gbnf", gbnf_grammar(gbnf), vocabulary);
    walk("json_schema", schema_grammar, steps);
    walk("json_object", object_grammar, steps);
    walk("regex", regex_compiled, steps);
    walk("gbnf", gbnf_compiled, steps);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "kiln_grammar_bench: %s\n", error.what());
    return 1;
  }
}
