// The layers may only include downwards: core < io < backend < model < engine < server < cli;
// tokenizer sits beside io (it needs only core). A test fails when a lower layer includes a higher.
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
    {"engine", 4}, {"server", 5}, {"cli", 6},
};

std::string layer_of(const std::filesystem::path& relative) { return relative.begin()->string(); }

}  // namespace

TEST(Layering, LowerLayersNeverIncludeHigherOnes) {
  const auto src = kiln::testing::source_dir() / "src";
  const std::regex include_pattern(R"re(^\s*#\s*include\s*"([a-z_]+)/)re");
  int files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(src)) {
    if (!entry.is_regular_file()) continue;
    const auto relative = std::filesystem::relative(entry.path(), src);
    const std::string layer = layer_of(relative);
    ASSERT_TRUE(kLayerRank.count(layer)) << "unknown layer directory src/" << layer;
    ++files;
    std::ifstream in(entry.path());
    std::string line;
    int line_number = 0;
    while (std::getline(in, line)) {
      ++line_number;
      std::smatch match;
      if (!std::regex_search(line, match, include_pattern)) continue;
      const std::string target = match[1];
      if (!kLayerRank.count(target)) continue;
      const bool allowed = target == layer || kLayerRank.at(target) < kLayerRank.at(layer);
      EXPECT_TRUE(allowed) << "src/" << relative.string() << ":" << line_number << " (layer " << layer
                           << ") includes " << target << "/, a layer that is not below it";
    }
  }
  EXPECT_GT(files, 5);
}
