#include "engine/generation.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/error.h"
#include "engine/decode_graph.h"

namespace kiln {

Tensor run_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences) {
  Backend& backend = model.backend();
  std::vector<SequenceSpan> spans;
  std::vector<int32_t> token_ids;
  std::vector<int32_t> logit_rows;
  for (const SequenceStep& sequence : sequences) {
    if (sequence.tokens.empty()) fail("a sequence step must carry at least one token");
    if (sequence.first_position + static_cast<int64_t>(sequence.tokens.size()) > cache.capacity())
      fail("sequence in slot {} would reach position {}, beyond the cache capacity of {} tokens", sequence.slot,
           sequence.first_position + sequence.tokens.size() - 1, cache.capacity());
    const auto first_token = static_cast<int32_t>(token_ids.size());
    spans.push_back({sequence.slot, first_token, static_cast<int32_t>(sequence.tokens.size()), sequence.first_position});
    token_ids.insert(token_ids.end(), sequence.tokens.begin(), sequence.tokens.end());
    const auto count = static_cast<int32_t>(sequence.tokens.size());
    for (int32_t i = sequence.all_logits ? 0 : count - 1; i < count; ++i) logit_rows.push_back(first_token + i);
  }
  const BatchLayout layout = backend.make_layout(spans, token_ids);
  Tensor host_rows = Tensor::empty({static_cast<int64_t>(logit_rows.size())}, DType::I32);
  std::memcpy(host_rows.raw(), logit_rows.data(), logit_rows.size() * sizeof(int32_t));
  Tensor rows = backend.upload(host_rows);
  Tensor logits = backend.alloc({static_cast<int64_t>(logit_rows.size()), model.config().vocab_size}, DType::F32);
  model.forward(layout, rows, cache, logits);
  return backend.download(logits);
}

Tensor prompt_logits(Model& model, const std::vector<int32_t>& prompt, int64_t chunk) {
  const auto length = static_cast<int64_t>(prompt.size());
  if (length == 0) fail("the prompt is empty");
  const int64_t vocab = model.config().vocab_size;
  auto cache = model.make_cache(1, length);
  Tensor all = Tensor::empty({length, vocab}, DType::F32);
  const int64_t step = chunk > 0 ? chunk : length;
  for (int64_t start = 0; start < length; start += step) {
    const int64_t count = std::min(step, length - start);
    SequenceStep sequence{0, static_cast<int32_t>(start),
                          std::vector<int32_t>(prompt.begin() + start, prompt.begin() + start + count), true};
    Tensor logits = run_step(model, *cache, {sequence});
    std::memcpy(all.data<float>() + start * vocab, logits.raw(), logits.nbytes());
  }
  return all;
}

GenerationResult generate(Model& model, const std::vector<int32_t>& prompt, const GenerationOptions& options,
                          const std::function<bool(const SampledToken&)>& on_token) {
  if (prompt.empty()) fail("the prompt is empty");
  if (options.max_tokens < 0) fail("max_tokens must be ≥ 0, got {}", options.max_tokens);
  const int64_t context = model.config().max_position_embeddings;
  const auto prompt_length = static_cast<int64_t>(prompt.size());
  if (context > 0 && prompt_length > context)
    fail("the prompt has {} tokens but the model's context is {} tokens", prompt_length, context);
  const int64_t budget = context > 0 ? std::min(options.max_tokens, context - prompt_length) : options.max_tokens;

  GenerationResult result;
  Sampler sampler(options.sampling);
  auto cache = model.make_cache(1, prompt_length + std::max<int64_t>(budget, 1));
  const int64_t vocab = model.config().vocab_size;
  using Clock = std::chrono::steady_clock;

  auto start = Clock::now();
  const int64_t step = options.prefill_chunk > 0 ? options.prefill_chunk : prompt_length;
  Tensor logits;
  for (int64_t offset = 0; offset < prompt_length; offset += step) {
    const int64_t count = std::min(step, prompt_length - offset);
    SequenceStep sequence{0, static_cast<int32_t>(offset),
                          std::vector<int32_t>(prompt.begin() + offset, prompt.begin() + offset + count), false};
    logits = run_step(model, *cache, {sequence});
  }
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();

  start = Clock::now();
  result.finish_reason = "length";
  int64_t position = prompt_length;
  // Takes one generated token; false when generation ends with it.
  auto accept = [&](const SampledToken& token) {
    result.tokens.push_back(token.token);
    const bool keep_going = on_token ? on_token(token) : true;
    const bool stop_id =
        std::find(options.stop_ids.begin(), options.stop_ids.end(), token.token) != options.stop_ids.end();
    if (stop_id || !keep_going) {
      result.finish_reason = "stop";
      return false;
    }
    return static_cast<int64_t>(result.tokens.size()) < budget;
  };
  // The first token comes from the prefill's logits on the host; decode steps run as captured
  // graphs that sample on the device where the backend can (the same random stream either way).
  SampledToken first = sampler.sample({logits.data<float>(), static_cast<size_t>(vocab)});
  if (budget > 0 && accept(first)) {
    if (DecodeGraphs::supported(model)) {
      // Each step is queued before the previous step's token is read: it takes that token on the
      // device (DecodeRow::fed_from), so the device never waits for the host between steps. The
      // step queued past a stop is collected and dropped (it wrote one cache row past the end).
      DecodeGraphs graphs(model, *cache);
      graphs.launch({DecodeRow{0, static_cast<int32_t>(position++), first.token, &sampler}});
      for (;;) {
        if (static_cast<int64_t>(result.tokens.size()) + graphs.queued() < budget)
          graphs.launch({DecodeRow{0, static_cast<int32_t>(position++), 0, &sampler, 0}});
        if (!accept(graphs.collect().front())) break;
      }
      while (graphs.queued() > 0) graphs.collect();
    } else {
      SampledToken next = first;
      do {
        logits = run_step(model, *cache, {SequenceStep{0, static_cast<int32_t>(position++), {next.token}, false}});
        next = sampler.sample({logits.data<float>(), static_cast<size_t>(vocab)});
      } while (accept(next));
    }
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

}  // namespace kiln
