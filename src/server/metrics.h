// Server metrics in the Prometheus text exposition format (GET /metrics): request and token
// counters, queue depth, KV-cache use, and time-to-first-token / inter-token latency histograms.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/scheduler.h"
#include "text/generation_metrics.h"

namespace kiln::server {

// A cumulative histogram with fixed upper bounds (seconds), as Prometheus defines it.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // The "_bucket"/"_sum"/"_count" series of `name`.
  std::string render(const std::string& name, const std::string& help) const;
  uint64_t count() const;

 private:
  std::vector<double> upper_bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t total_ = 0;
};

class ServerMetrics final : public GenerationMetrics {
 public:
  // `model_name` labels every series (model_name="..."), as vLLM's metrics do, so that one
  // Prometheus scrapes several servers apart.
  explicit ServerMetrics(std::string model_name);

  // A request that ran, by endpoint ("chat", "completions", "messages", "embeddings") and end (an
  // embedding request that was answered counts as "stop").
  void count_request(const std::string& endpoint, FinishReason finish_reason) override;
  void count_response(int status);
  void add_tokens(int64_t prompt_tokens, int64_t generated_tokens) override;
  void observe_time_to_first_token(double seconds) override;
  void observe_inter_token_latency(double seconds) override;
  void observe_request_duration(double seconds) override;

  std::string render(const SchedulerStats& scheduler) const;

 private:
  std::string model_label_;  // model_name="...", escaped
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, std::string>, uint64_t> requests_;
  std::map<int, uint64_t> responses_;
  uint64_t prompt_tokens_ = 0;
  uint64_t generated_tokens_ = 0;
  Histogram time_to_first_token_;
  Histogram inter_token_latency_;
  Histogram request_duration_;
};

}  // namespace kiln::server
