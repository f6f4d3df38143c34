// kiln::Error — the one exception type kiln throws for user-facing failures.
// Every message is a single line that names what failed (file, tensor, field, profile).
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace kiln {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws kiln::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kiln
