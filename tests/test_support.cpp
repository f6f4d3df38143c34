#include "test_support.h"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sys/wait.h>

namespace kiln::testing {

std::filesystem::path source_dir() { return KILN_SOURCE_DIR; }

std::filesystem::path kiln_binary() { return KILN_BINARY; }

std::filesystem::path fixtures_dir() { return source_dir() / "tests/data/fixtures"; }

std::filesystem::path stories_dir() { return source_dir() / "models/stories260K"; }

CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer;
  size_t count;
  while ((count = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), count);
  int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

std::string kiln_command(const std::string& arguments) { return kiln_binary().string() + " " + arguments; }

void expect_one_line_error(const FailingCommand& command) {
  const CommandResult result = run_command("{ " + kiln_command(command.arguments) + " 2>&1 >/dev/null; }");
  EXPECT_NE(result.exit_code, 0) << command.arguments;
  std::string output = result.output;
  while (!output.empty() && output.back() == '\n') output.pop_back();
  EXPECT_EQ(output.find('\n'), std::string::npos) << command.arguments << ": more than one line:\n" << output;
  EXPECT_NE(output.find(command.expected), std::string::npos) << command.arguments << ": " << output;
}

TempDir::TempDir() {
  std::random_device random;
  path_ = std::filesystem::temp_directory_path() / ("kiln-test-" + std::to_string(random()));
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace kiln::testing
