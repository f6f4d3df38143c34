// Reading the JSON-lines inputs of the commands that take --jsonl (render, tokenize).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace kiln::cli {

// Calls on_line(value, where) for each line of `path` ("-": standard input) in order, `where` being
// "path:line" for the caller's errors. Fails, naming the file, when it cannot be opened, and naming
// the line, when a line is not JSON.
void for_each_jsonl_line(const std::string& path,
                         const std::function<void(const nlohmann::ordered_json& value, const std::string& where)>& on_line);

}  // namespace kiln::cli
