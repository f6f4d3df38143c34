// Why a generation ended. Each API dialect maps it to its own wire names (server/openai_api.cpp,
// server/anthropic_api.cpp); finish_reason_name is kiln's own name, for metrics labels and logs.
#pragma once

#include <string_view>

namespace kiln {

enum class FinishReason {
  Stop,       // an end-of-generation id, a stop string, or the caller asked
  Length,     // max_tokens (or the context) reached
  Cancelled,  // the client went away or the server is shutting down
  Error,      // a step failed
};

// "stop" | "length" | "cancelled" | "error"
std::string_view finish_reason_name(FinishReason reason);

// Whether the generation ran to an end of its own (stop or length), not cut off by a cancel or a failure.
inline bool ended_normally(FinishReason reason) { return reason == FinishReason::Stop || reason == FinishReason::Length; }

}  // namespace kiln
