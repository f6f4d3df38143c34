#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace kiln::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)), counts_(upper_bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t bucket = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  ++counts_[bucket];
  sum_ += value;
  ++total_;
}

uint64_t Histogram::count() const { return total_; }

std::string Histogram::render(const std::string& name, const std::string& help) const {
  std::string text = fmt::format("# HELP {0} {1}\n# TYPE {0} histogram\n", name, help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < upper_bounds_.size(); ++i) {
    cumulative += counts_[i];
    text += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, upper_bounds_[i], cumulative);
  }
  text += fmt::format("{0}_bucket{{le=\"+Inf\"}} {1}\n{0}_sum {2}\n{0}_count {1}\n", name, total_, sum_);
  return text;
}

namespace {

// Bucket bounds in seconds, from a millisecond (a tiny model's step) to the tens of seconds a
// long prompt can wait on a loaded server.
std::vector<double> latency_bounds() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

// A label value in the exposition format: backslash, double quote and newline escaped.
std::string escaped_label_value(const std::string& value) {
  std::string escaped;
  for (char c : value) {
    if (c == '\\' || c == '"') escaped += '\\';
    if (c == '\n') {
      escaped += "\\n";
      continue;
    }
    escaped += c;
  }
  return escaped;
}

// `text` with `label` (name="value") added to every sample line: first among a series' labels, or
// as its only label.
std::string with_label(const std::string& text, const std::string& label) {
  std::string labelled;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    if (line.empty() || line[0] == '#') {
      labelled += line;
    } else {
      const size_t name_end = line.find_first_of("{ ");
      if (name_end != std::string::npos && line[name_end] == '{')
        labelled += line.substr(0, name_end + 1) + label + "," + line.substr(name_end + 1);
      else
        labelled += line.substr(0, name_end) + "{" + label + "}" + line.substr(name_end);
    }
    labelled += '\n';
    start = end + 1;
  }
  return labelled;
}

void append_metric(std::string& text, const std::string& name, const std::string& type, const std::string& help,
                   double value) {
  text += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, value);
}

}  // namespace

ServerMetrics::ServerMetrics(std::string model_name)
    : model_label_("model_name=\"" + escaped_label_value(model_name) + "\""),
      time_to_first_token_(latency_bounds()),
      inter_token_latency_(latency_bounds()),
      request_duration_(latency_bounds()) {}

void ServerMetrics::count_request(const std::string& endpoint, FinishReason finish_reason) {
  std::lock_guard lock(mutex_);
  ++requests_[{endpoint, std::string(finish_reason_name(finish_reason))}];
}

void ServerMetrics::count_response(int status) {
  std::lock_guard lock(mutex_);
  ++responses_[status];
}

void ServerMetrics::add_tokens(int64_t prompt_tokens, int64_t generated_tokens) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += static_cast<uint64_t>(prompt_tokens);
  generated_tokens_ += static_cast<uint64_t>(generated_tokens);
}

void ServerMetrics::observe_time_to_first_token(double seconds) {
  std::lock_guard lock(mutex_);
  time_to_first_token_.observe(seconds);
}

void ServerMetrics::observe_inter_token_latency(double seconds) {
  std::lock_guard lock(mutex_);
  inter_token_latency_.observe(seconds);
}

void ServerMetrics::observe_request_duration(double seconds) {
  std::lock_guard lock(mutex_);
  request_duration_.observe(seconds);
}

std::string ServerMetrics::render(const SchedulerStats& scheduler) const {
  std::lock_guard lock(mutex_);
  std::string text =
      "# HELP kiln_requests_total Requests served (generations and embeddings), by endpoint and finish reason.\n"
      "# TYPE kiln_requests_total counter\n";
  for (const auto& [key, count] : requests_)
    text +=
        fmt::format("kiln_requests_total{{endpoint=\"{}\",finish_reason=\"{}\"}} {}\n", key.first, key.second, count);
  text +=
      "# HELP kiln_http_responses_total HTTP responses, by status code.\n# TYPE kiln_http_responses_total counter\n";
  for (const auto& [status, count] : responses_)
    text += fmt::format("kiln_http_responses_total{{code=\"{}\"}} {}\n", status, count);
  append_metric(text, "kiln_prompt_tokens_total", "counter", "Prompt tokens prefilled (after chat templating).",
                static_cast<double>(prompt_tokens_));
  append_metric(text, "kiln_generation_tokens_total", "counter", "Tokens generated.",
                static_cast<double>(generated_tokens_));
  append_metric(text, "kiln_requests_waiting", "gauge", "Requests queued for a batch slot.",
                static_cast<double>(scheduler.waiting));
  append_metric(text, "kiln_requests_running", "gauge", "Requests in the decode batch.",
                static_cast<double>(scheduler.running));
  append_metric(text, "kiln_kv_cache_tokens_used", "gauge", "KV-cache token positions held by running requests.",
                static_cast<double>(scheduler.cache_tokens_used));
  append_metric(text, "kiln_kv_cache_tokens_total", "gauge", "KV-cache token positions (the block pool's).",
                static_cast<double>(scheduler.cache_tokens_total));
  append_metric(text, "kiln_kv_cache_usage_ratio", "gauge", "Fraction of the KV cache in use.",
                scheduler.cache_tokens_total > 0 ? static_cast<double>(scheduler.cache_tokens_used) /
                                                       static_cast<double>(scheduler.cache_tokens_total)
                                                 : 0.0);
  append_metric(text, "kiln_scheduler_steps_total", "counter", "Batched forward steps run.",
                static_cast<double>(scheduler.steps));
  append_metric(text, "kiln_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                static_cast<double>(scheduler.prefix_query_tokens));
  append_metric(text, "kiln_prefix_cache_hits_total", "counter",
                "Prompt tokens served from the prefix cache instead of prefilled.",
                static_cast<double>(scheduler.prefix_hit_tokens));
  append_metric(text, "kiln_kv_cache_blocks_total", "gauge", "Blocks of the paged KV cache (64 positions each).",
                static_cast<double>(scheduler.kv_blocks_total));
  append_metric(text, "kiln_kv_cache_blocks_free", "gauge", "KV-cache blocks holding nothing.",
                static_cast<double>(scheduler.kv_blocks_free));
  append_metric(text, "kiln_kv_cache_blocks_cached", "gauge",
                "KV-cache blocks holding a cached prefix that no running request holds (evicted least recently used "
                "first when blocks are needed).",
                static_cast<double>(scheduler.kv_blocks_cached));
  append_metric(text, "kiln_kv_cache_blocks_used", "gauge", "KV-cache blocks held by running requests.",
                static_cast<double>(scheduler.kv_blocks_used));
  append_metric(text, "kiln_preemptions_total", "counter",
                "Requests whose KV blocks were taken back for others to run (each runs again, recomputed).",
                static_cast<double>(scheduler.preemptions));
  append_metric(text, "kiln_prefix_cache_snapshots", "gauge",
                "Snapshots of a hybrid model's recurrent state that cached blocks hold, for prompts to resume from.",
                static_cast<double>(scheduler.prefix_snapshots));
  const SpeculationCounts& speculation = scheduler.speculation;
  append_metric(text, "kiln_speculative_verify_steps_total", "counter",
                "Verify steps of speculative decoding (one per sequence and step).",
                static_cast<double>(speculation.verify_steps));
  append_metric(text, "kiln_speculative_proposed_tokens_total", "counter", "Tokens proposed for verification.",
                static_cast<double>(speculation.proposed));
  append_metric(text, "kiln_speculative_accepted_tokens_total", "counter",
                "Proposed tokens accepted (each equal to the target's own choice).",
                static_cast<double>(speculation.accepted));
  append_metric(text, "kiln_speculative_acceptance_ratio", "gauge", "Accepted over proposed tokens so far.",
                speculation.proposed > 0 ? static_cast<double>(speculation.accepted) /
                                               static_cast<double>(speculation.proposed)
                                         : 0.0);
  text += time_to_first_token_.render("kiln_time_to_first_token_seconds",
                                      "Time from a request's arrival to its first generated token.");
  text += inter_token_latency_.render("kiln_inter_token_latency_seconds", "Time between consecutive generated tokens.");
  text += request_duration_.render("kiln_request_duration_seconds", "Time from arrival to the last token.");
  return with_label(text, model_label_);
}

}  // namespace kiln::server
