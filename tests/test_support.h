// Helpers shared by the test files: where ../shared is, and skipping clearly when it is absent.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include <gtest/gtest.h>

namespace kiln::testing {

// ../shared beside the repository (or $KILN_SHARED_DIR), if it exists.
std::optional<std::filesystem::path> shared_dir();

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

// A fresh temporary directory, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace kiln::testing

// Skips the test with a message naming the missing folder when ../shared is not there.
#define KILN_REQUIRE_SHARED(var)                                                              \
  auto var##_opt = ::kiln::testing::shared_dir();                                             \
  if (!var##_opt) GTEST_SKIP() << "../shared is not present next to the repository (set "     \
                                  "KILN_SHARED_DIR): this test needs its fixtures";             \
  const std::filesystem::path var = *var##_opt
