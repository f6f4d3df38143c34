#include "text/text_generation.h"

#include <utility>

#include "core/error.h"

namespace kiln {

TextGeneration::TextGeneration(Scheduler& scheduler, const TextCodec& codec, TextGenerationRequest request,
                               GenerationMetrics& metrics, std::string endpoint, Clock::time_point arrival)
    : metrics_(metrics),
      endpoint_(std::move(endpoint)),
      logprobs_(request.logprobs),
      prompt_tokens_(request.prompt.size()),
      decoder_(codec.text_stream(request.prompt)),
      stop_matcher_(std::move(request.stop)),
      arrival_(arrival),
      last_disconnect_check_(Clock::now()) {
  GenerationRequest generation;
  generation.prompt = std::move(request.prompt);
  generation.max_tokens = request.max_tokens;
  generation.sampling = request.sampling;
  if (!request.ignore_eos) generation.stop_ids = codec.stop_token_ids();
  generation.top_logprobs = request.logprobs ? request.top_logprobs : 0;
  generation.grammar = std::move(request.grammar);
  generation.reasoning_budget = std::move(request.reasoning_budget);
  generation.speculation = std::move(request.speculation);
  stream_ = scheduler.submit(std::move(generation));
}

TextGeneration::~TextGeneration() {
  if (finished_) return;
  stream_->cancel();
  metrics_.count_request(endpoint_, FinishReason::Cancelled);
  metrics_.add_tokens(prompt_tokens(), completion_tokens_);
}

bool TextGeneration::absorb(const std::string& text) {
  StopMatcher::Output output = stop_matcher_.push(text);
  pending_.text += output.text;
  if (!output.matched) return false;
  pending_.stop_sequence = std::move(output.matched);
  return true;
}

TextDelta TextGeneration::finish(FinishReason reason) {
  finished_ = true;
  TextDelta delta = std::exchange(pending_, {});
  delta.finished = true;
  delta.finish_reason = reason;
  metrics_.count_request(endpoint_, delta.finish_reason);
  metrics_.add_tokens(prompt_tokens(), completion_tokens_);
  metrics_.observe_request_duration(std::chrono::duration<double>(Clock::now() - arrival_).count());
  return delta;
}

TextDelta TextGeneration::next(const std::function<bool()>& client_gone) {
  for (;;)
    if (std::optional<TextDelta> delta = next_within(client_gone, kDisconnectPoll)) return std::move(*delta);
}

std::optional<TextDelta> TextGeneration::next_within(const std::function<bool()>& client_gone,
                                                     std::chrono::milliseconds wait) {
  if (finished_) fail("TextGeneration::next called after the end");
  const Clock::time_point now = Clock::now();
  if (now - last_disconnect_check_ >= kDisconnectPoll) {
    last_disconnect_check_ = now;
    if (client_gone()) {
      stream_->cancel();
      pending_.error = "the client disconnected";
      return finish(FinishReason::Cancelled);
    }
  }
  std::optional<TokenEvent> event = stream_->next(wait);
  if (!event) return std::nullopt;
  if (event->token >= 0) {
    const Clock::time_point arrived = Clock::now();
    if (last_token_time_)
      metrics_.observe_inter_token_latency(std::chrono::duration<double>(arrived - *last_token_time_).count());
    else
      metrics_.observe_time_to_first_token(
          *(time_to_first_token_ = std::chrono::duration<double>(arrived - arrival_).count()));
    last_token_time_ = arrived;
    ++completion_tokens_;
    std::string text = decoder_->push(event->token);
    if (logprobs_) pending_.tokens.push_back({event->token, text, event->logprob, std::move(event->top_logprobs)});
    if (absorb(text)) {
      stream_->cancel();  // the rest of the generation is not wanted: free the slot now
      return finish(FinishReason::Stop);
    }
  }
  if (event->finished) {
    pending_.error = event->error;
    if (ended_normally(event->finish_reason)) {
      if (absorb(decoder_->finish())) return finish(FinishReason::Stop);
      pending_.text += stop_matcher_.flush();
    }
    return finish(event->finish_reason);
  }
  if (!pending_.text.empty()) return std::exchange(pending_, {});
  return std::nullopt;
}

}  // namespace kiln
