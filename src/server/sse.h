// Server-sent events (the WHATWG event-stream format): one JSON payload per event.
#pragma once

#include <string>

#include "server/json_fields.h"

namespace kiln::server {

// "data: {json}\n\n" (OpenAI's streams carry no event names).
inline std::string sse_data(const nlohmann::ordered_json& payload) { return "data: " + dump_json(payload) + "\n\n"; }

// "event: NAME\ndata: {json}\n\n" (Anthropic names every event).
inline std::string sse_event(const std::string& name, const nlohmann::ordered_json& payload) {
  return "event: " + name + "\ndata: " + dump_json(payload) + "\n\n";
}

// OpenAI's end-of-stream sentinel.
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace kiln::server
