// Helpers shared by the test files: where the test data and the default model are, running
// commands, temporary folders, and expecting a kiln::Error that names what is wrong.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"

namespace kiln::testing {

// The fixtures kept in the repository (tests/data/fixtures: tiny checkpoints with transformers'
// reference logits, see its README).
std::filesystem::path fixtures_dir();

// The default model (models/stories260K): a real trained tiny Llama with its tokenizer, chat
// template and reference outputs.
std::filesystem::path stories_dir();

// The repository root (for tests that scan sources or run scripts).
std::filesystem::path source_dir();

// The built `kiln` binary.
std::filesystem::path kiln_binary();

// Runs a shell command, returning its exit status and captured stdout+stderr.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
CommandResult run_command(const std::string& command);

// The command line that runs the built `kiln` with `arguments`.
std::string kiln_command(const std::string& arguments);

// A `kiln` command that must fail, and what its error must say.
struct FailingCommand {
  std::string arguments;
  std::string expected;
};

// Expects the command to exit non-zero with one line on stderr (stdout dropped) containing
// `expected`.
void expect_one_line_error(const FailingCommand& command);

// A fresh temporary directory, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Runs `action`, expecting a kiln::Error whose message holds every one of `fragments`.
inline void expect_error_mentions(const std::function<void()>& action, const std::vector<std::string>& fragments) {
  try {
    action();
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const auto& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "the error \"" << message << "\" does not mention \""
                                                             << fragment << "\"";
    return;
  }
  ADD_FAILURE() << "expected a kiln::Error mentioning " << ::testing::PrintToString(fragments);
}

}  // namespace kiln::testing

