// The layers may only include downwards: core < io < backend < model < engine < text < server < cli;
// tokenizer sits beside io (it needs only core); text is the library's text API (tokenizer, chat
// template and generation together), which the server and the command line both build on. A test
// fails when a lower layer includes a higher, or when a layer above the backends includes a
// concrete backend (backend/cpu/, backend/cuda/) instead of the headers directly under backend/:
// the interface (backend.h, collective.h, op_contract.h) and the measuring backend, which runs no
// kernel of its own but stands in for whichever backend it is given (the memory plan's dry run).
// Only the command line chooses which backend runs.
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "test_support.h"

namespace {

// Rank of each top-level directory under src/; a file may include only ranks <= its own, and
// never a sibling of equal rank in another directory unless listed.
const std::map<std::string, int> kLayerRank = {
    {"core", 0}, {"io", 1}, {"tokenizer", 1}, {"backend", 2}, {"model", 3},
    {"engine", 4}, {"text", 5}, {"server", 6}, {"cli", 7},
};

std::string layer_of(const std::filesystem::path& relative) { return relative.begin()->string(); }

// Calls `visit(relative path, line number, included path)` for every quoted include under src/.
template <class Visit>
int for_each_include(Visit visit) {
  const auto src = kiln::testing::source_dir() / "src";
  const std::regex include_pattern(R"re(^\s*#\s*include\s*"([^"]+)")re");
  int files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(src)) {
    if (!entry.is_regular_file()) continue;
    ++files;
    const auto relative = std::filesystem::relative(entry.path(), src);
    std::ifstream in(entry.path());
    std::string line;
    int line_number = 0;
    while (std::getline(in, line)) {
      ++line_number;
      std::smatch match;
      if (std::regex_search(line, match, include_pattern)) visit(relative, line_number, match[1].str());
    }
  }
  return files;
}

}  // namespace

TEST(Layering, LowerLayersNeverIncludeHigherOnes) {
  const int files = for_each_include([](const std::filesystem::path& relative, int line_number,
                                        const std::string& included) {
    const std::string layer = layer_of(relative);
    ASSERT_TRUE(kLayerRank.count(layer)) << "unknown layer directory src/" << layer;
    const std::string target = included.substr(0, included.find('/'));
    if (included.find('/') == std::string::npos || !kLayerRank.count(target)) return;
    const bool allowed = target == layer || kLayerRank.at(target) < kLayerRank.at(layer);
    EXPECT_TRUE(allowed) << "src/" << relative.string() << ":" << line_number << " (layer " << layer << ") includes "
                         << target << "/, a layer that is not below it";
  });
  EXPECT_GT(files, 5);
}

TEST(Layering, OnlyTheCommandLineIncludesAConcreteBackend) {
  const std::regex concrete_backend(R"re(^backend/[a-z_]+/)re");
  int concrete_includes = 0;
  for_each_include([&](const std::filesystem::path& relative, int line_number, const std::string& included) {
    if (!std::regex_search(included, concrete_backend)) return;
    const std::string layer = layer_of(relative);
    ++concrete_includes;
    EXPECT_TRUE(layer == "backend" || layer == "cli")
        << "src/" << relative.string() << ":" << line_number << " (layer " << layer << ") includes " << included
        << ": above the backends only the headers directly under backend/ may be included (the interface and "
           "the measuring backend); the command line picks the concrete backend";
  });
  // The backends themselves include their own headers, so the pattern is known to match.
  EXPECT_GT(concrete_includes, 0);
}

TEST(Layering, TheApiDialectsAreSiblings) {
  // Each dialect parses its requests and writes its answers; what both need lives in shared files
  // under server/, so neither includes the other.
  const std::map<std::string, std::string> dialects = {{"server/openai_api", "server/anthropic_api"},
                                                       {"server/anthropic_api", "server/openai_api"}};
  for_each_include([&](const std::filesystem::path& relative, int line_number, const std::string& included) {
    const std::string file = (relative.parent_path() / relative.stem()).string();
    const auto dialect = dialects.find(file);
    if (dialect == dialects.end()) return;
    EXPECT_NE(included, dialect->second + ".h")
        << "src/" << relative.string() << ":" << line_number << " includes the other dialect, " << included;
  });
}
