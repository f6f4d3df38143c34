// One log line per request (as llama-server and vLLM's access log write them): its id, method,
// path, status, tokens, time to first token and duration, as text or as one JSON object a line.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace kiln::server {

enum class LogFormat { Text, Json };

// Parses "text" or "json" (a kiln::Error names anything else).
LogFormat parse_log_format(const std::string& name);

struct RequestRecord {
  uint64_t id = 0;  // the server's count of requests, from 1
  std::string method;
  std::string path;
  std::chrono::steady_clock::time_point arrival;
  int status = 0;  // 0: no response was sent (the client went away first)
  bool stream = false;
  // Set once a generation was accepted.
  std::optional<int64_t> prompt_tokens;
  std::optional<int64_t> generated_tokens;
  // Prompt tokens served from the prefix cache rather than prefilled.
  std::optional<int64_t> cached_tokens;
  std::optional<double> time_to_first_token_seconds;
};

// The record's line (without a newline), `duration_seconds` after its arrival.
std::string format_request_log(const RequestRecord& record, double duration_seconds, LogFormat format);

}  // namespace kiln::server
