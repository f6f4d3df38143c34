#include "engine/generation.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>

#include "core/error.h"
#include "engine/generation_core.h"
#include "engine/step_plan.h"

namespace kiln {

StepBatch step_batch(const std::vector<SequenceStep>& sequences, const ModelCache& cache, const char* what) {
  StepBatch batch;
  for (const SequenceStep& sequence : sequences) {
    if (sequence.tokens.empty()) fail("a {} step must carry at least one token", what);
    if (sequence.first_position + static_cast<int64_t>(sequence.tokens.size()) > cache.capacity())
      fail("the {} sequence in slot {} would reach position {}, beyond its cache of {} positions", what, sequence.slot,
           sequence.first_position + sequence.tokens.size() - 1, cache.capacity());
    batch.spans.push_back({sequence.slot, static_cast<int32_t>(batch.token_ids.size()),
                           static_cast<int32_t>(sequence.tokens.size()), sequence.first_position});
    batch.token_ids.insert(batch.token_ids.end(), sequence.tokens.begin(), sequence.tokens.end());
  }
  return batch;
}

Tensor upload_row_indices(Backend& backend, const std::vector<int32_t>& indices) {
  Tensor host_rows = Tensor::empty({static_cast<int64_t>(indices.size())}, DType::I32);
  std::memcpy(host_rows.raw(), indices.data(), indices.size() * sizeof(int32_t));
  return backend.upload(host_rows);
}

Tensor run_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences, Tensor* hidden) {
  return model.backend().download(forward_step(model, cache, sequences, hidden));
}

Tensor forward_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences, Tensor* hidden) {
  Backend& backend = model.backend();
  const StepBatch batch = step_batch(sequences, cache, "model's");
  std::vector<int32_t> logit_rows;
  std::vector<int32_t> hidden_rows;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const SequenceStep& sequence = sequences[i];
    const int32_t first_token = batch.spans[i].first_token;
    const auto count = static_cast<int32_t>(sequence.tokens.size());
    if (sequence.last_logits < 1 || sequence.last_logits > count)
      fail("a sequence step of {} tokens asks for the logits of its last {}", count, sequence.last_logits);
    for (int32_t row = sequence.all_logits ? 0 : count - sequence.last_logits; row < count; ++row)
      logit_rows.push_back(first_token + row);
    if (sequence.hidden_states)
      for (int32_t row = 0; row < count; ++row) hidden_rows.push_back(first_token + row);
  }
  const BatchLayout layout = backend.make_layout(batch.spans, batch.token_ids);
  Tensor logits = backend.alloc({static_cast<int64_t>(logit_rows.size()), model.config().vocab_size}, DType::F32);
  if (hidden_rows.empty()) {
    model.forward(layout, upload_row_indices(backend, logit_rows), cache, logits);
  } else {
    if (!hidden) fail("a sequence step asks for hidden states, but run_step was given nowhere to put them");
    *hidden = backend.alloc({static_cast<int64_t>(hidden_rows.size()), model.config().hidden_size},
                            backend.activation_dtype());
    model.forward_with_hidden(layout, upload_row_indices(backend, logit_rows), upload_row_indices(backend, hidden_rows),
                              cache, logits, *hidden);
  }
  return logits;
}

Tensor prompt_logits(Model& model, const std::vector<int32_t>& prompt, int64_t chunk) {
  const auto length = static_cast<int64_t>(prompt.size());
  if (length == 0) fail("the prompt is empty");
  if (chunk != kWholePrompt) check_prefill_chunk(chunk);
  const int64_t vocab = model.config().vocab_size;
  auto cache = model.make_cache(1, length);
  Tensor all = Tensor::empty({length, vocab}, DType::F32);
  for (int64_t start = 0; start < length;) {
    const int64_t end = chunk == kWholePrompt ? length : prefill_chunk_end(length, start, chunk);
    SequenceStep sequence{0, static_cast<int32_t>(start),
                          std::vector<int32_t>(prompt.begin() + start, prompt.begin() + end), true};
    Tensor logits = run_step(model, *cache, {sequence});
    std::memcpy(all.data<float>() + start * vocab, logits.raw(), logits.nbytes());
    start = end;
  }
  return all;
}

GenerationResult generate(Model& model, const std::vector<int32_t>& prompt, const GenerationOptions& options,
                          const std::function<bool(const SampledToken&)>& on_token) {
  ServingSizes sizes;
  sizes.max_batch = 1;
  sizes.prefill_chunk = options.prefill_chunk;
  check_serving_sizes(sizes, model.config());
  GenerationRequest request{prompt, options.max_tokens, options.sampling, options.stop_ids, 0};
  request.reasoning_budget = options.reasoning_budget;
  request.speculation = options.speculation;
  bound_request(request, sizes.context(model.config()), model.config().vocab_size);
  // The cache holds this request's tokens, not the model's whole context.
  GenerationCore core(model, 1, static_cast<int64_t>(prompt.size()) + std::max<int64_t>(request.max_tokens, 1),
                      sizes.prefill_chunk, sizes.step_token_budget());
  auto stream = std::make_shared<RequestStream>();
  core.admit(std::move(request), stream);

  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  std::optional<Clock::time_point> first_token;
  GenerationResult result;
  bool ended = false;  // the request finished, or the callback asked to stop (later events are dropped)
  // Takes the events of a step: tokens for the callback, and the end of the request.
  const auto take = [&](TokenEvent event) {
    if (ended) return;
    if (event.token >= 0) {
      if (!first_token) first_token = Clock::now();
      result.tokens.push_back(event.token);
      if (on_token && !on_token({event.token, event.logprob})) {
        stream->cancel();
        result.finish_reason = FinishReason::Stop;
        ended = true;
        return;
      }
    }
    if (!event.finished) return;
    if (event.finish_reason == FinishReason::Error) fail("{}", event.error);
    result.finish_reason = event.finish_reason;
    ended = true;
  };
  const auto nothing_waits = [] { return false; };
  while (core.running() > 0) {
    core.step(nothing_waits);
    while (std::optional<TokenEvent> event = stream->next(std::chrono::milliseconds(0))) take(std::move(*event));
  }
  const Clock::time_point finished = Clock::now();
  result.prefill_seconds = std::chrono::duration<double>(first_token.value_or(finished) - start).count();
  result.decode_seconds = std::chrono::duration<double>(finished - first_token.value_or(finished)).count();
  result.speculation = core.speculation_counts();
  return result;
}

}  // namespace kiln
