// Structured output's cost: building the vocabulary trie, compiling grammars against it, and the
// token mask of each step.
//   kiln_grammar_bench TOKENIZER_DIR_OR_JSON [STEPS] [SCHEMA_JSON_FILE]
// For a JSON schema and for json_object it walks STEPS tokens (default 2000) through the masks,
// choosing a random allowed token (half of the time one that closes a string, array or object, so
// the walk visits the structure and not only long strings), and prints the mask time per step
// (mean, p50, p99, max) in the thread's CPU time. A schema file replaces the built-in schema.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/grammar/json_schema.h"
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kiln_grammar_bench TOKENIZER_DIR_OR_JSON [STEPS] [SCHEMA_JSON_FILE]\n");
    return 2;
  }
  try {
    const int steps = argc > 2 ? std::stoi(argv[2]) : 2000;
    const kiln::Tokenizer tokenizer = kiln::Tokenizer::load(argv[1]);
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
    if (argc > 3) {
      std::ifstream file(argv[3]);
      if (!file) kiln::fail("{}: cannot open", argv[3]);
      schema = json::parse(file);
    }
    start = thread_seconds();
    const auto schema_grammar = std::make_shared<const CompiledGrammar>(json_schema_grammar(schema), vocabulary);
    std::printf("json_schema: %zu grammar positions compiled in %.1f ms\n", schema_grammar->grammar().positions(),
                1e3 * (thread_seconds() - start));
    start = thread_seconds();
    const auto object_grammar = std::make_shared<const CompiledGrammar>(json_object_grammar(), vocabulary);
    std::printf("json_object: %zu grammar positions compiled in %.1f ms\n", object_grammar->grammar().positions(),
                1e3 * (thread_seconds() - start));
    walk("json_schema", schema_grammar, steps);
    walk("json_object", object_grammar, steps);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "kiln_grammar_bench: %s\n", error.what());
    return 1;
  }
}
