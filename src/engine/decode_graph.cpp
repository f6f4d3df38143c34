#include "engine/decode_graph.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/error.h"

namespace kiln {
namespace {

// The one per-step upload of a step of `rows` rows (the bucket) of `row_tokens` tokens each, T =
// rows · row_tokens token rows, in consecutive blocks: token ids [T], positions [T], slots [T], the
// span table [rows, 4] (slot, first_token, tokens, first_position), the sampling settings
// [T, kSamplingSettingsWords], then the feed [T] (the row of the previous step whose token a row
// takes, or −1).
struct StepWords {
  int64_t tokens;  // T
  int64_t rows;
  int64_t positions() const { return tokens; }
  int64_t slots() const { return 2 * tokens; }
  int64_t spans() const { return 3 * tokens; }
  int64_t settings() const { return 3 * tokens + 4 * rows; }
  int64_t feed() const { return settings() + kSamplingSettingsWords * tokens; }
  int64_t total() const { return feed() + tokens; }
};

// A row's kSamplingSettingsWords words (backend.h) for `params` with the draw `uniform`.
void write_sampling_settings(int32_t* settings, const SamplingParams& params, double uniform) {
  settings[0] = std::bit_cast<int32_t>(params.temperature);
  settings[1] = params.top_k;
  settings[2] = std::bit_cast<int32_t>(params.top_p);
  settings[3] = std::bit_cast<int32_t>(params.min_p);
  const auto uniform_bits = std::bit_cast<uint64_t>(uniform);
  settings[4] = static_cast<int32_t>(static_cast<uint32_t>(uniform_bits));
  settings[5] = static_cast<int32_t>(static_cast<uint32_t>(uniform_bits >> 32));
}

}  // namespace

std::vector<SampledToken> sample_rows_on_device(Backend& backend, const Tensor& logits,
                                                std::span<Sampler* const> samplers) {
  GraphOps* ops = backend.graph_ops();
  if (!ops) fail("device sampling: the {} backend chooses no tokens on its device", backend.name());
  const int64_t rows = logits.dim(0);
  if (rows != static_cast<int64_t>(samplers.size()))
    fail("device sampling: {} logit rows but {} samplers", rows, samplers.size());
  Tensor settings = Tensor::empty({rows, kSamplingSettingsWords}, DType::I32);
  bool sorting = false;
  for (int64_t row = 0; row < rows; ++row) {
    Sampler* sampler = samplers[row];
    SamplingParams params;
    if (sampler) params = sampler->params();
    else params.temperature = 0.0f;
    sorting = sorting || params.temperature != 0.0f;
    write_sampling_settings(settings.data<int32_t>() + row * kSamplingSettingsWords, params,
                            params.temperature != 0.0f ? sampler->next_uniform() : 0.0);
  }
  Tensor tokens = backend.alloc({rows}, DType::I32);
  Tensor logprobs = backend.alloc({rows}, DType::F32);
  ops->sample_tokens(logits, backend.upload(settings), sorting, tokens, logprobs);
  const Tensor host_tokens = backend.download(tokens);
  const Tensor host_logprobs = backend.download(logprobs);
  std::vector<SampledToken> sampled(static_cast<size_t>(rows));
  for (int64_t row = 0; row < rows; ++row)
    sampled[row] = {host_tokens.data<int32_t>()[row], host_logprobs.data<float>()[row]};
  return sampled;
}

int64_t decode_bucket(int64_t rows) {
  if (rows < 1) fail("a decode step needs at least one row, got {}", rows);
  if (rows <= 8) return static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(rows)));
  return (rows + 7) / 8 * 8;
}

std::vector<int32_t> padding_slots(std::span<const int32_t> live_slots, int64_t count, int64_t cache_slots) {
  std::vector<int32_t> chosen;
  for (int32_t slot = 0; slot < cache_slots && static_cast<int64_t>(chosen.size()) < count; ++slot)
    if (std::find(live_slots.begin(), live_slots.end(), slot) == live_slots.end()) chosen.push_back(slot);
  if (static_cast<int64_t>(chosen.size()) < count)
    fail("decode step: {} padding rows need free cache slots but only {} of the cache's {} slots are free of the "
         "step's {} rows (make the cache decode_bucket(rows) slots)",
         count, chosen.size(), cache_slots, live_slots.size());
  return chosen;
}

struct DecodeGraphs::Graph {
  int64_t rows = 0;
  int64_t row_tokens = 1;
  Tensor host_inputs[kMaxQueuedSteps];  // [StepWords::total()] I32 views of the shared pinned buffers
  Tensor inputs;       // the device copy; the layout, settings and feed are views of it
  BatchLayout layout;
  Tensor settings;     // [T, kSamplingSettingsWords]
  Tensor feed;         // [T]
  Tensor logit_rows;   // 0 .. T − 1
  Tensor logits;       // [T, vocab] f32
  Tensor tokens, logprobs;  // [T] views of outputs_
  std::unique_ptr<CapturedWork> work;  // last: destroyed before the buffers it addresses
};

DecodeGraphs::DecodeGraphs(Model& model, ModelCache& cache) : model_(model), cache_(cache) {
  if (!supported(model))
    fail("decode graphs: the {} backend cannot capture decode steps (it has no GraphOps)", model.backend().name());
  Backend& backend = model_.backend();
  const int64_t token_rows = cache_.slots() * kMaxDecodeRowTokens;
  outputs_ = backend.alloc({2, token_rows}, DType::I32);
  backend.zero(outputs_);
  const int64_t words = StepWords{token_rows, cache_.slots()}.total();
  for (int buffer = 0; buffer < kMaxQueuedSteps; ++buffer) {
    host_inputs_[buffer] = backend.graph_ops()->alloc_pinned({words}, DType::I32);
    host_outputs_[buffer] = backend.graph_ops()->alloc_pinned({2, token_rows}, DType::I32);
  }
}

DecodeGraphs::~DecodeGraphs() = default;

bool DecodeGraphs::supported(const Model& model) {
  return model.backend().graph_ops() != nullptr;
}

const Tensor& DecodeGraphs::last_logits() const {
  if (!last_) fail("decode graphs: no step has run yet, so there are no logits");
  return last_->logits;
}

DecodeGraphs::Graph& DecodeGraphs::graph_for(int64_t bucket, int64_t row_tokens, bool sorting) {
  auto& slot = graphs_[{bucket, row_tokens, sorting}];
  if (slot) return *slot;
  Backend& backend = model_.backend();
  auto graph = std::make_unique<Graph>();
  graph->rows = bucket;
  graph->row_tokens = row_tokens;
  const StepWords words{bucket * row_tokens, bucket};
  const int64_t tokens = words.tokens;
  for (int buffer = 0; buffer < kMaxQueuedSteps; ++buffer)
    graph->host_inputs[buffer] =
        Tensor::borrow(host_inputs_[buffer].raw(), {words.total()}, DType::I32,
                       std::make_shared<const Tensor>(host_inputs_[buffer]), Device::CPU);
  graph->inputs = backend.alloc({words.total()}, DType::I32);
  const auto owner = std::make_shared<const Tensor>(graph->inputs);
  auto view = [&](int64_t offset, Shape shape) {
    return Tensor::borrow(graph->inputs.data<int32_t>() + offset, std::move(shape), DType::I32, owner,
                          graph->inputs.device());
  };
  graph->layout.total_tokens = tokens;
  graph->layout.token_ids = view(0, {tokens});
  graph->layout.positions = view(words.positions(), {tokens});
  graph->layout.slots = view(words.slots(), {tokens});
  graph->layout.spans_device = view(words.spans(), {bucket, 4});
  graph->settings = view(words.settings(), {tokens, kSamplingSettingsWords});
  graph->feed = view(words.feed(), {tokens});
  // The host spans only serve the checks made while capturing; replays read the device tensors.
  graph->layout.spans.resize(static_cast<size_t>(bucket));

  Tensor host_rows = Tensor::empty({tokens}, DType::I32);
  for (int32_t row = 0; row < tokens; ++row) host_rows.data<int32_t>()[row] = row;
  graph->logit_rows = backend.upload(host_rows);
  graph->logits = backend.alloc({tokens, model_.config().vocab_size}, DType::F32);
  const auto outputs_owner = std::make_shared<const Tensor>(outputs_);
  graph->tokens =
      Tensor::borrow(outputs_.data<int32_t>(), {tokens}, DType::I32, outputs_owner, outputs_.device());
  graph->logprobs = Tensor::borrow(outputs_.data<int32_t>() + outputs_.dim(1), {tokens}, DType::F32, outputs_owner,
                                   outputs_.device());
  slot = std::move(graph);
  return *slot;
}

std::vector<SampledToken> DecodeGraphs::step(const std::vector<DecodeRow>& rows) {
  if (!queued_.empty()) fail("decode step: {} launched steps are still to be collected", queued_.size());
  launch(rows);
  return collect();
}

void DecodeGraphs::launch(const std::vector<DecodeRow>& rows) {
  if (static_cast<int>(queued_.size()) >= kMaxQueuedSteps)
    fail("decode step: {} steps are queued already (collect one first)", queued_.size());
  const auto count = static_cast<int64_t>(rows.size());
  const int64_t bucket = decode_bucket(count);
  const int64_t row_tokens = 1 + static_cast<int64_t>(rows.front().proposal.size());
  if (row_tokens > kMaxDecodeRowTokens)
    fail("decode step: a row appends {} tokens, more than the {} a row may", row_tokens, kMaxDecodeRowTokens);
  std::vector<int32_t> live_slots;
  bool sorting = false;
  for (const DecodeRow& row : rows) {
    if (row.slot < 0 || row.slot >= cache_.slots())
      fail("decode step: slot {} is outside the cache's {} slots", row.slot, cache_.slots());
    if (std::find(live_slots.begin(), live_slots.end(), row.slot) != live_slots.end())
      fail("decode step: slot {} appears in two rows", row.slot);
    if (1 + static_cast<int64_t>(row.proposal.size()) != row_tokens)
      fail("decode step: slot {} appends {} tokens, but the step's first row appends {} (every row of a step "
           "appends as many)",
           row.slot, 1 + row.proposal.size(), row_tokens);
    if (row.position < 0 || row.position + row_tokens > cache_.capacity())
      fail("decode step: slot {} would write positions {} to {}, outside the cache capacity of {} tokens", row.slot,
           row.position, row.position + row_tokens - 1, cache_.capacity());
    if (row.fed_from >= previous_rows_)
      fail("decode step: slot {} takes its token from row {} of the previous step, which had {} one-token rows",
           row.slot, row.fed_from, previous_rows_);
    if (row.fed_from >= 0 && row_tokens > 1)
      fail("decode step: slot {} verifies proposals, so its token must come from the host, not a previous step",
           row.slot);
    live_slots.push_back(row.slot);
    sorting = sorting || (row.sampler && row.sampler->params().temperature != 0.0f);
  }
  const std::vector<int32_t> padding = padding_slots(live_slots, bucket - count, cache_.slots());

  Graph& graph = graph_for(bucket, row_tokens, sorting);
  const StepWords layout{bucket * row_tokens, bucket};
  // The buffer two launches back is free: that step was collected before this launch (at most
  // kMaxQueuedSteps are queued), so its upload and its download have run.
  const int buffer = static_cast<int>(launches_ % kMaxQueuedSteps);
  int32_t* words = graph.host_inputs[buffer].data<int32_t>();
  for (int64_t index = 0; index < bucket; ++index) {
    const bool live = index < count;
    const int32_t slot = live ? rows[index].slot : padding[index - count];
    const int32_t position = live ? rows[index].position : 0;
    const bool fed = live && rows[index].fed_from >= 0;
    const auto first_token = static_cast<int32_t>(index * row_tokens);
    int32_t* span = words + layout.spans() + 4 * index;
    span[0] = slot;
    span[1] = first_token;
    span[2] = static_cast<int32_t>(row_tokens);
    span[3] = position;
    graph.layout.spans[index] = {slot, first_token, static_cast<int32_t>(row_tokens), position};

    const Sampler* sampler = live ? rows[index].sampler : nullptr;
    SamplingParams params;
    if (sampler) params = sampler->params();
    else params.temperature = 0.0f;
    for (int64_t j = 0; j < row_tokens; ++j) {
      const int64_t token_row = first_token + j;
      words[token_row] = !live || fed ? 0 : j == 0 ? rows[index].token : rows[index].proposal[j - 1];
      words[layout.positions() + token_row] = position + static_cast<int32_t>(j);
      words[layout.slots() + token_row] = slot;
      words[layout.feed() + token_row] = fed ? rows[index].fed_from : -1;
      // A one-token step takes its row's draw; a verify step reads the row's next draws ahead (the
      // engine takes one per token it emits).
      double uniform = 0.0;
      if (params.temperature != 0.0f)
        uniform = row_tokens == 1 ? rows[index].sampler->next_uniform() : rows[index].sampler->uniform_ahead(j);
      write_sampling_settings(words + layout.settings() + kSamplingSettingsWords * token_row, params, uniform);
    }
  }

  Backend& backend = model_.backend();
  GraphOps& ops = *backend.graph_ops();
  ops.upload_into(graph.host_inputs[buffer], graph.inputs);
  if (!graph.work) {
    // The first step of this bucket and kind runs while it is captured (GraphOps::capture).
    graph.work = ops.capture([this, &graph, &ops, sorting] {
      const Tensor previous_tokens = Tensor::borrow(outputs_.raw(), {outputs_.dim(1)}, DType::I32,
                                                    std::make_shared<const Tensor>(outputs_), outputs_.device());
      ops.feed_tokens(previous_tokens, graph.feed, graph.layout.token_ids);
      model_.forward(graph.layout, graph.logit_rows, cache_, graph.logits);
      ops.sample_tokens(graph.logits, graph.settings, sorting, graph.tokens, graph.logprobs);
    });
  } else {
    graph.work->replay();
  }
  last_ = &graph;
  queued_.push_back({count * row_tokens, buffer, ops.download_later(outputs_, host_outputs_[buffer])});
  ++launches_;
  previous_rows_ = row_tokens == 1 ? count : 0;
}

std::vector<SampledToken> DecodeGraphs::collect() {
  if (queued_.empty()) fail("decode step: no launched step is waiting to be collected");
  Queued step = std::move(queued_.front());
  queued_.pop_front();
  step.download->wait();
  const int32_t* words = host_outputs_[step.buffer].data<int32_t>();
  std::vector<SampledToken> sampled(static_cast<size_t>(step.rows));
  for (int64_t index = 0; index < step.rows; ++index) {
    sampled[index].token = words[index];
    sampled[index].logprob = std::bit_cast<float>(words[outputs_.dim(1) + index]);
  }
  return sampled;
}

}  // namespace kiln
