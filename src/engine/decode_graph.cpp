#include "engine/decode_graph.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/error.h"

namespace kiln {
namespace {

// Words per row of the one per-step upload, stored as consecutive blocks of `bucket` words:
// token ids, positions, slots, the span table (4 words a row: slot, first_token, tokens,
// first_position), the sampling settings (kSamplingSettingsWords a row), then the feed (the row
// of the previous step whose token the row takes, or −1).
constexpr int64_t kFeedWord = 3 + 4 + kSamplingSettingsWords;
constexpr int64_t kRowWords = kFeedWord + 1;

}  // namespace

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
  Tensor host_inputs[kMaxQueuedSteps];  // [kRowWords · rows] I32 views of the shared pinned buffers
  Tensor inputs;       // the device copy; the layout, settings and feed are views of it
  BatchLayout layout;
  Tensor settings;     // [rows, kSamplingSettingsWords]
  Tensor feed;         // [rows]
  Tensor logit_rows;   // 0 .. rows − 1
  Tensor logits;       // [rows, vocab] f32
  Tensor tokens, logprobs;  // [rows] views of outputs_
  std::unique_ptr<CapturedWork> work;  // last: destroyed before the buffers it addresses
};

DecodeGraphs::DecodeGraphs(Model& model, ModelCache& cache) : model_(model), cache_(cache) {
  if (!supported(model))
    fail("decode graphs: the {} backend cannot capture decode steps (it has no GraphOps)", model.backend().name());
  Backend& backend = model_.backend();
  const int64_t slots = cache_.slots();
  outputs_ = backend.alloc({2, slots}, DType::I32);
  backend.zero(outputs_);
  for (int buffer = 0; buffer < kMaxQueuedSteps; ++buffer) {
    host_inputs_[buffer] = backend.graph_ops()->alloc_pinned({kRowWords * slots}, DType::I32);
    host_outputs_[buffer] = backend.graph_ops()->alloc_pinned({2, slots}, DType::I32);
  }
}

DecodeGraphs::~DecodeGraphs() = default;

bool DecodeGraphs::supported(const Model& model) {
  return model.backend().graph_ops() != nullptr && model.capturable();
}

const Tensor& DecodeGraphs::last_logits() const {
  if (!last_) fail("decode graphs: no step has run yet, so there are no logits");
  return last_->logits;
}

DecodeGraphs::Graph& DecodeGraphs::graph_for(int64_t bucket, bool sorting) {
  auto& slot = graphs_[{bucket, sorting}];
  if (slot) return *slot;
  Backend& backend = model_.backend();
  auto graph = std::make_unique<Graph>();
  graph->rows = bucket;
  for (int buffer = 0; buffer < kMaxQueuedSteps; ++buffer)
    graph->host_inputs[buffer] =
        Tensor::borrow(host_inputs_[buffer].raw(), {kRowWords * bucket}, DType::I32,
                       std::make_shared<const Tensor>(host_inputs_[buffer]), Device::CPU);
  graph->inputs = backend.alloc({kRowWords * bucket}, DType::I32);
  const auto owner = std::make_shared<const Tensor>(graph->inputs);
  auto view = [&](int64_t offset, Shape shape) {
    return Tensor::borrow(graph->inputs.data<int32_t>() + offset, std::move(shape), DType::I32, owner,
                          graph->inputs.device());
  };
  graph->layout.total_tokens = bucket;
  graph->layout.token_ids = view(0, {bucket});
  graph->layout.positions = view(bucket, {bucket});
  graph->layout.slots = view(2 * bucket, {bucket});
  graph->layout.spans_device = view(3 * bucket, {bucket, 4});
  graph->settings = view(7 * bucket, {bucket, kSamplingSettingsWords});
  graph->feed = view(kFeedWord * bucket, {bucket});
  // The host spans only serve the checks made while capturing; replays read the device tensors.
  graph->layout.spans.resize(static_cast<size_t>(bucket));

  Tensor host_rows = Tensor::empty({bucket}, DType::I32);
  for (int32_t row = 0; row < bucket; ++row) host_rows.data<int32_t>()[row] = row;
  graph->logit_rows = backend.upload(host_rows);
  graph->logits = backend.alloc({bucket, model_.config().vocab_size}, DType::F32);
  const auto outputs_owner = std::make_shared<const Tensor>(outputs_);
  graph->tokens =
      Tensor::borrow(outputs_.data<int32_t>(), {bucket}, DType::I32, outputs_owner, outputs_.device());
  graph->logprobs = Tensor::borrow(outputs_.data<int32_t>() + cache_.slots(), {bucket}, DType::F32, outputs_owner,
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
  std::vector<int32_t> live_slots;
  bool sorting = false;
  for (const DecodeRow& row : rows) {
    if (row.slot < 0 || row.slot >= cache_.slots())
      fail("decode step: slot {} is outside the cache's {} slots", row.slot, cache_.slots());
    if (std::find(live_slots.begin(), live_slots.end(), row.slot) != live_slots.end())
      fail("decode step: slot {} appears in two rows", row.slot);
    if (row.position < 0 || row.position >= cache_.capacity())
      fail("decode step: slot {} would write position {}, outside the cache capacity of {} tokens", row.slot,
           row.position, cache_.capacity());
    if (row.fed_from >= previous_rows_)
      fail("decode step: slot {} takes its token from row {} of the previous step, which had {} rows", row.slot,
           row.fed_from, previous_rows_);
    live_slots.push_back(row.slot);
    sorting = sorting || (row.sampler && row.sampler->params().temperature != 0.0f);
  }
  const std::vector<int32_t> padding = padding_slots(live_slots, bucket - count, cache_.slots());

  Graph& graph = graph_for(bucket, sorting);
  // The buffer two launches back is free: that step was collected before this launch (at most
  // kMaxQueuedSteps are queued), so its upload and its download have run.
  const int buffer = static_cast<int>(launches_ % kMaxQueuedSteps);
  int32_t* words = graph.host_inputs[buffer].data<int32_t>();
  for (int64_t index = 0; index < bucket; ++index) {
    const bool live = index < count;
    const int32_t slot = live ? rows[index].slot : padding[index - count];
    const int32_t position = live ? rows[index].position : 0;
    const bool fed = live && rows[index].fed_from >= 0;
    words[index] = live && !fed ? rows[index].token : 0;
    words[bucket + index] = position;
    words[2 * bucket + index] = slot;
    int32_t* span = words + 3 * bucket + 4 * index;
    span[0] = slot;
    span[1] = static_cast<int32_t>(index);
    span[2] = 1;
    span[3] = position;
    graph.layout.spans[index] = {slot, static_cast<int32_t>(index), 1, position};
    words[kFeedWord * bucket + index] = fed ? rows[index].fed_from : -1;

    int32_t* settings = words + 7 * bucket + kSamplingSettingsWords * index;
    const Sampler* sampler = live ? rows[index].sampler : nullptr;
    SamplingParams params;
    if (sampler) params = sampler->params();
    else params.temperature = 0.0f;
    settings[0] = std::bit_cast<int32_t>(params.temperature);
    settings[1] = params.top_k;
    settings[2] = std::bit_cast<int32_t>(params.top_p);
    settings[3] = std::bit_cast<int32_t>(params.min_p);
    const double uniform = params.temperature != 0.0f ? rows[index].sampler->next_uniform() : 0.0;
    const auto uniform_bits = std::bit_cast<uint64_t>(uniform);
    settings[4] = static_cast<int32_t>(static_cast<uint32_t>(uniform_bits));
    settings[5] = static_cast<int32_t>(static_cast<uint32_t>(uniform_bits >> 32));
  }

  Backend& backend = model_.backend();
  GraphOps& ops = *backend.graph_ops();
  ops.upload_into(graph.host_inputs[buffer], graph.inputs);
  if (!graph.work) {
    // The first step of this bucket and kind runs while it is captured (GraphOps::capture).
    graph.work = ops.capture([this, &graph, &ops, sorting] {
      const Tensor previous_tokens = Tensor::borrow(outputs_.raw(), {cache_.slots()}, DType::I32,
                                                    std::make_shared<const Tensor>(outputs_), outputs_.device());
      ops.feed_tokens(previous_tokens, graph.feed, graph.layout.token_ids);
      model_.forward(graph.layout, graph.logit_rows, cache_, graph.logits);
      ops.sample_tokens(graph.logits, graph.settings, sorting, graph.tokens, graph.logprobs);
    });
  } else {
    graph.work->replay();
  }
  last_ = &graph;
  queued_.push_back({count, buffer, ops.download_later(outputs_, host_outputs_[buffer])});
  ++launches_;
  previous_rows_ = count;
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
    sampled[index].logprob = std::bit_cast<float>(words[cache_.slots() + index]);
  }
  return sampled;
}

}  // namespace kiln
