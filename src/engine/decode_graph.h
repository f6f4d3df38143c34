// Decode steps as captured graphs, with tokens chosen on the device.
//
// A decode step (every sequence contributes exactly one token) runs the same kernels at every
// step; only the token ids, positions, slots, span table and sampling settings change. On a
// backend with GraphOps (CUDA) the whole step — model forward and token choice — is captured
// once per batch-size bucket and replayed: per step the host packs those inputs into one buffer,
// issues one host-to-device copy and one graph launch, and reads back only the token ids and
// their logprobs ([2, rows] words). The graph's kernels read every per-step length and position
// from device memory (the layout's device tensors), so a replay gives the same bits as running
// the step directly (tests/cuda/decode_graph_test.cpp).
//
// Steps can be queued ahead (launch, then collect): a row may take its token from a row of the
// step launched just before (DecodeRow::fed_from), which the graph copies on the device, so the
// next step is queued before the host has read the previous one's tokens and the device does not
// wait for the host between steps. Every step's token ids and logprobs go to one device buffer
// that the next step's feed reads; each step's copy back to the host is queued right behind it.
//
// Buckets are 1, 2, 4, 8 and then multiples of 8, not exact sizes: each captured size keeps its
// own scratch, including the sort buffers of sampling (rows × vocab × 24 bytes), so exact sizes
// up to a server's max batch of 64 would hold 64 graphs whose sort buffers alone sum to
// ~2000 × vocab × 24 bytes; with buckets there are at most 3 + max/8 graphs, and padding costs at
// most 7 rows of compute in a step that is bound by reading the weights once.
//
// A verify step of speculative decoding (engine/speculative.h) runs the same way: every row
// appends its token and the same number of proposed tokens (DecodeRow::proposal), and a token is
// chosen on the device for each of them, as a one-token step chooses one per row; each
// (bucket, tokens per row) pair is a graph of its own. Its rows' draws are read ahead of the
// request's stream, not taken: the engine takes one per token it emits (engine/speculative.h).
//
// Padded rows are inert: each takes its own slot that no live row holds (padding_slots), at
// position 0 with token 0, greedy, and its results are dropped. It writes only position 0 of a
// free slot, which that slot's next sequence overwrites before anything reads it (attention reads
// rows 0..position, all written by the sequence itself; hybrid conv and recurrent states restart
// at position 0). So the cache must have decode_bucket(rows) slots for `rows` live sequences.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/sampler.h"
#include "engine/speculative.h"
#include "model/model.h"

namespace kiln {

// The captured batch size serving `rows` decode rows: 1, 2, 4, 8, then the next multiple of 8.
int64_t decode_bucket(int64_t rows);

// `count` distinct slots below `cache_slots` that no live row holds, lowest first; fails
// (naming the counts) when the cache has too few free slots.
std::vector<int32_t> padding_slots(std::span<const int32_t> live_slots, int64_t count, int64_t cache_slots);

struct DecodeRow {
  int32_t slot = 0;
  int32_t position = 0;  // position of `token` in its sequence
  int32_t token = 0;
  Sampler* sampler = nullptr;  // the row's request sampler (null: greedy); a non-greedy one gives one draw,
                               // at launch
  int32_t fed_from = -1;       // ≥ 0: the token is the one row `fed_from` of the previous launched step
                               // samples (`token` is then ignored)
  // A verify step's proposed tokens, appended after `token` at the following positions; every row
  // of a step has as many. Such a row's token comes from the host (fed_from −1).
  std::vector<int32_t> proposal = {};
};

// The most tokens one row of a step appends: its token and the most proposals.
inline constexpr int64_t kMaxDecodeRowTokens = 1 + kMaxSpeculativeTokens;

// Chooses a token for each row of a direct step's logits [rows, vocab] (f32, on the device) with
// GraphOps::sample_tokens, and returns only the tokens and their log-probabilities: a step with
// prefill chunks runs outside the decode graphs, and this keeps its choice on the device too
// instead of downloading every row's logits to sample them one by one on the host. samplers[i]
// is row i's request sampler, which gives one draw (null: greedy, no draw), as DecodeRow::sampler.
std::vector<SampledToken> sample_rows_on_device(Backend& backend, const Tensor& logits,
                                                std::span<Sampler* const> samplers);

class DecodeGraphs {
 public:
  // Needs a backend with GraphOps; every step runs on `cache`, which must outlive this object.
  DecodeGraphs(Model& model, ModelCache& cache);
  ~DecodeGraphs();
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  // Whether `model`'s backend can run decode steps through this class.
  static bool supported(const Model& model);

  // Runs one decode step over `rows` (distinct slots, at least one) and returns each row's token
  // and its log-probability, in order (a verify step's: each row's chosen token after its token
  // and after each proposal, row by row). No launched step may be waiting to be collected.
  std::vector<SampledToken> step(const std::vector<DecodeRow>& rows);

  // Queues one decode step over `rows` and returns at once; collect() returns its tokens. At most
  // kMaxQueuedSteps steps are queued and not yet collected.
  static constexpr int kMaxQueuedSteps = 2;
  void launch(const std::vector<DecodeRow>& rows);
  // Waits for the oldest queued step and returns its rows' tokens and log-probabilities, in order.
  std::vector<SampledToken> collect();
  // Steps launched and not yet collected.
  int queued() const { return static_cast<int>(queued_.size()); }

  // The last step's logits on the device, [bucket · tokens per row, vocab]: row i · tokens + j
  // belongs to token j of rows[i] of that step (rows past its row count are padding). Valid after that step is collected, until the next
  // launch.
  const Tensor& last_logits() const;

  // How many graphs exist (one per bucket and greedy/sampling kind used so far).
  size_t graphs() const { return graphs_.size(); }

 private:
  struct Graph;
  Graph& graph_for(int64_t bucket, int64_t row_tokens, bool sorting);

  struct Queued {
    int64_t rows = 0;  // token rows: rows × tokens per row
    int buffer = 0;  // which of host_outputs_ receives its tokens
    std::unique_ptr<PendingDownload> download;
  };

  Model& model_;
  ModelCache& cache_;
  std::map<std::tuple<int64_t, int64_t, bool>, std::unique_ptr<Graph>> graphs_;  // (bucket, row tokens, sorting)
  const Graph* last_ = nullptr;
  // [2, cache slots × kMaxDecodeRowTokens] I32 on the device: every step's token ids, then its
  // logprobs' bits; the next step's feed reads the ids.
  Tensor outputs_;
  // Page-locked host buffers, two of each so that one can be filled while the other is in use:
  // the packed inputs of a step (sized for the most token rows) and the copy of outputs_.
  Tensor host_inputs_[kMaxQueuedSteps];
  Tensor host_outputs_[kMaxQueuedSteps];
  int64_t launches_ = 0;
  int64_t previous_rows_ = 0;  // rows of the last launched one-token step (0 before any, and after a verify step)
  std::deque<Queued> queued_;
};

}  // namespace kiln
