#include "cli/jsonl.h"

#include <fmt/format.h>

#include <fstream>
#include <iostream>

#include "core/error.h"

namespace kiln::cli {

void for_each_jsonl_line(const std::string& path,
                         const std::function<void(const nlohmann::ordered_json& value, const std::string& where)>& on_line) {
  std::ifstream file;
  if (path != "-") {
    file.open(path, std::ios::binary);
    if (!file) fail("{}: cannot open", path);
  }
  std::istream& in = path == "-" ? std::cin : file;
  std::string line;
  for (size_t line_number = 1; std::getline(in, line); ++line_number) {
    const std::string where = fmt::format("{}:{}", path, line_number);
    nlohmann::ordered_json value;
    try {
      value = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::ordered_json::exception& error) {
      fail("{}: not valid JSON: {}", where, error.what());
    }
    on_line(value, where);
  }
}

}  // namespace kiln::cli
