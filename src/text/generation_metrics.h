// What a TextGeneration reports as it runs: the server's metrics (server/metrics.h) implement it.
#pragma once

#include <cstdint>
#include <string>

#include "engine/finish_reason.h"

namespace kiln {

class GenerationMetrics {
 public:
  virtual ~GenerationMetrics() = default;
  // A request that ended, by `endpoint` (a label of the caller's) and finish reason.
  virtual void count_request(const std::string& endpoint, FinishReason finish_reason) = 0;
  virtual void add_tokens(int64_t prompt_tokens, int64_t generated_tokens) = 0;
  virtual void observe_time_to_first_token(double seconds) = 0;
  virtual void observe_inter_token_latency(double seconds) = 0;
  virtual void observe_request_duration(double seconds) = 0;
};

}  // namespace kiln
