#include "server/request_log.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/json_fields.h"

namespace kiln::server {

LogFormat parse_log_format(const std::string& name) {
  if (name == "text") return LogFormat::Text;
  if (name == "json") return LogFormat::Json;
  fail("unknown log format '{}' (text or json)", name);
}

std::string format_request_log(const RequestRecord& record, double duration_seconds, LogFormat format) {
  if (format == LogFormat::Json) {
    nlohmann::ordered_json line = {{"request_id", record.id}, {"method", record.method}, {"path", record.path},
                                   {"status", record.status}, {"stream", record.stream}};
    if (record.prompt_tokens) line["prompt_tokens"] = *record.prompt_tokens;
    if (record.generated_tokens) line["generated_tokens"] = *record.generated_tokens;
    if (record.cached_tokens) line["cached_tokens"] = *record.cached_tokens;
    if (record.time_to_first_token_seconds) line["time_to_first_token_ms"] = *record.time_to_first_token_seconds * 1e3;
    line["duration_ms"] = duration_seconds * 1e3;
    return dump_json(line);
  }
  // The path comes from the client: quoted so that it cannot forge a line of its own.
  std::string text = fmt::format("request {} {} {} {}", record.id, quote_client_text(record.method), quote_client_text(record.path),
                                 record.status);
  if (record.prompt_tokens)
    text += fmt::format(" prompt={} generated={} cached={}", *record.prompt_tokens, record.generated_tokens.value_or(0),
                        record.cached_tokens.value_or(0));
  if (record.stream) text += " stream";
  if (record.time_to_first_token_seconds) text += fmt::format(" ttft={:.1f}ms", *record.time_to_first_token_seconds * 1e3);
  text += fmt::format(" duration={:.1f}ms", duration_seconds * 1e3);
  return text;
}

}  // namespace kiln::server
