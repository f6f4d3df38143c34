// One request's generation as text: submits prompt ids to the scheduler, turns the tokens that come
// back into text (incremental detokenisation), applies text-level stop strings (cutting the output
// at a match and cancelling the request), counts usage and records latency metrics.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/scheduler.h"
#include "engine/stop_matcher.h"
#include "text/generation_metrics.h"
#include "text/text_codec.h"

namespace kiln {

struct TextGenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 0;
  SamplingParams sampling;
  std::vector<std::string> stop;  // text-level stop strings
  bool ignore_eos = false;        // keep generating past end-of-text tokens
  bool logprobs = false;
  int32_t top_logprobs = 0;  // alternatives reported per token
  std::shared_ptr<const grammar::CompiledGrammar> grammar;  // structured output (GenerationRequest::grammar)
  std::optional<ReasoningBudget> reasoning_budget;          // GenerationRequest::reasoning_budget
  Speculation speculation;                                  // GenerationRequest::speculation
};

struct GeneratedToken {
  int32_t id = 0;
  std::string text;  // what the token added to the output (empty inside an unfinished character)
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // the most likely alternatives (when asked)
};

struct TextDelta {
  std::string text;                    // new output text (possibly empty on the final delta)
  std::vector<GeneratedToken> tokens;  // with logprobs: the tokens generated since the last delta
  bool finished = false;
  FinishReason finish_reason = FinishReason::Stop;  // when finished
  std::optional<std::string> stop_sequence;  // the stop string that ended the output
  std::string error;                         // why it was cancelled or failed
};

class TextGeneration {
 public:
  using Clock = std::chrono::steady_clock;

  // Submits the request: the scheduler's QueueFull when its queue is full, a kiln::Error when it
  // refuses the request (invalid, or the scheduler stopping). `endpoint` labels the request in the
  // metrics; `arrival` is when the request came, for its latencies.
  TextGeneration(Scheduler& scheduler, const TextCodec& codec, TextGenerationRequest request,
                 GenerationMetrics& metrics, std::string endpoint, Clock::time_point arrival);
  ~TextGeneration();  // cancels a generation that has not finished (its cache slot is freed)
  TextGeneration(const TextGeneration&) = delete;
  TextGeneration& operator=(const TextGeneration&) = delete;

  // Waits for more text or the end. `client_gone` is asked every kDisconnectPoll while waiting;
  // when it answers true the request is cancelled and a finished "cancelled" delta returns.
  TextDelta next(const std::function<bool()>& client_gone);
  // next() that waits at most `wait` for an event: nothing when none brought text or the end yet
  // (what did arrive is kept for the next call). Serves several generations from one thread.
  std::optional<TextDelta> next_within(const std::function<bool()>& client_gone, std::chrono::milliseconds wait);
  bool finished() const { return finished_; }

  int64_t prompt_tokens() const { return static_cast<int64_t>(prompt_tokens_); }
  int64_t completion_tokens() const { return completion_tokens_; }
  // Prompt tokens served from the prefix cache (0 until the scheduler admits the request).
  int64_t cached_tokens() const { return stream_->cached_tokens(); }
  // Seconds from the request's arrival to its first generated token, once there is one.
  std::optional<double> time_to_first_token() const { return time_to_first_token_; }

  static constexpr std::chrono::milliseconds kDisconnectPoll{20};

 private:
  // Feeds decoded text through the stop strings; true when one matched.
  bool absorb(const std::string& text);
  // The pending delta, ended with `reason`.
  TextDelta finish(FinishReason reason);

  GenerationMetrics& metrics_;
  std::string endpoint_;
  bool logprobs_;
  size_t prompt_tokens_;
  std::shared_ptr<RequestStream> stream_;
  std::unique_ptr<TokenTextStream> decoder_;
  StopMatcher stop_matcher_;
  Clock::time_point arrival_;
  std::optional<Clock::time_point> last_token_time_;
  Clock::time_point last_disconnect_check_;
  int64_t completion_tokens_ = 0;
  std::optional<double> time_to_first_token_;
  bool finished_ = false;
  TextDelta pending_;  // what arrived since the last delta returned
};

}  // namespace kiln
