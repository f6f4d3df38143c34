#include "tokenizer/jinja_limits.h"

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::jinja {

void Location::error(const std::string& message) const {
  if (!origin) fail("{}", message);
  fail("{}: line {}: {}", *origin, line, message);
}

void Location::charge(uint64_t units) const {
  if (budget) budget->charge(units, *this);
}

void Location::grow(uint64_t current, uint64_t added, std::string_view what) const {
  if (added > kMaxValueBytes || current > kMaxValueBytes - added)
    error(fmt::format("{} would exceed {}, the limit on a template value", what, describe_bytes(kMaxValueBytes)));
  charge(added / kBytesCopiedPerStep);
}

void Budget::charge(uint64_t units, const Location& at) {
  steps_ += units;
  if (steps_ > limits_.steps)
    at.error(fmt::format("rendering takes more than {} steps, the limit of a template render (an endless loop?)",
                         limits_.steps));
}

std::string describe_bytes(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 20) && bytes % (uint64_t{1} << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  return fmt::format("{} bytes", bytes);
}

}  // namespace kiln::jinja
