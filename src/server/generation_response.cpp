#include "server/generation_response.h"

#include <chrono>
#include <random>

namespace kiln::server {

ApiError generation_failure(const TextDelta& end) {
  if (end.finish_reason == FinishReason::Cancelled)
    return ApiError(503, end.error.empty() ? "the request was cancelled" : "the request was cancelled: " + end.error,
                    "", "cancelled");
  return ApiError(500, "generation failed: " + end.error, "", "generation_error");
}

// A generator per thread seeded with one 32-bit random_device word gave each new handler thread's
// first id only 2^32 possibilities: a soak of 45,000 streams (one handler thread each) met a
// duplicate id (docs/reliability.md).
std::string random_id(const char* prefix) {
  std::random_device entropy;
  return fmt::format("{}{:08x}{:08x}{:08x}", prefix, entropy(), entropy(), entropy());
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace kiln::server
