// A constructed model: a graph bound to weights on one backend.
//
// Precision of the graphs: activations between ops are in the backend's activation dtype (f32 on
// the CPU; bf16 on CUDA for bf16 weights, rounded where transformers rounds), except the residual
// stream and the two products added to it per layer (attention and MLP outputs), which every graph
// keeps in f32. transformers rounds the stream to bf16 at every add, and those errors accumulate
// over all layers; keeping it f32 is what puts kiln's bf16 path within the fixture bar (no further
// from the float64 truth than transformers' bf16, row by row).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/tensor.h"
#include "io/config.h"

namespace kiln {

// Per-sequence state that survives between forward calls (KV cache, recurrent state), for
// `slots` sequences of up to `capacity` tokens each, owned by the engine.
//
// The attention layers' KV cache is paged (backend.h): every layer has a pool of blocks() blocks of
// kKvBlockTokens positions, and one block table of table_width() entries per slot, shared by all
// layers, says which block holds each run of 64 positions of the slot's sequence. What a slot's
// other state holds (a hybrid model's recurrent and conv state) stays per slot.
class ModelCache {
 public:
  virtual ~ModelCache() = default;
  virtual int64_t slots() const = 0;
  virtual int64_t capacity() const = 0;
  // The blocks in each attention layer's pool.
  virtual int64_t blocks() const = 0;
  // The block-table entries of a slot: kv_table_width(capacity()).
  virtual int64_t table_width() const = 0;
  // Entries [first_entry, first_entry + blocks.size()) of `slot`'s block table ← blocks: positions
  // [64·(first_entry + i), 64·(first_entry + i) + 64) of the slot's sequence are then in pool block
  // blocks[i] of every layer. Fails naming the slot, entry or block that is out of range. On a
  // device the table is written by a copy queued in stream order (no host synchronisation): steps
  // queued before still read the old entries, steps queued after the new ones. The engine keeps
  // which blocks each slot holds; the cache only writes them.
  virtual void assign_blocks(int32_t slot, int64_t first_entry, std::span<const int32_t> blocks) = 0;
  // Forget a slot's contents (its next sequence starts at position 0).
  virtual void reset_slot(int32_t slot) = 0;
  // Whether a sequence may continue a slot at any position p below what the slot last held, the
  // rows under p kept: true where the state is a KV cache (attention reads rows 0..p only), false
  // where a recurrent state sums up the whole history (Gated DeltaNet).
  virtual bool resumes_at_any_position() const = 0;
  virtual size_t bytes() const = 0;

  // Speculative decoding (engine/speculative.h) appends proposed tokens and takes back the rejected
  // ones. A KV cache needs nothing for that: the rows past the accepted tokens are never read before
  // they are written again. A state that sums up the whole history (resumes_at_any_position false)
  // is saved before such an append and put back when part of it is rejected; the engine then runs
  // the accepted tokens again. One saved state per slot; saving again replaces it.
  virtual void save_slot_state(int32_t /*slot*/) {}
  virtual void restore_slot_state(int32_t /*slot*/) {}

  // The prefix cache (engine/generation_core.h) reuses a KV cache's rows from any block boundary. A
  // state that sums up the whole history resumes only where a copy of it was kept: `count` snapshot
  // entries beside the slots, allocated once before any step, each holding one slot's state (what
  // save_slot_state copies) as it stood at a block boundary, for a later sequence to resume from
  // in its own slot. A cache that resumes at any position needs none and allocates nothing.
  virtual void allocate_snapshots(int64_t /*count*/) {}
  virtual int64_t snapshots() const { return 0; }
  // Snapshot entry `snapshot` ← the state of `slot`; and back, into any slot. On a device both are
  // copies queued in stream order: a restore reads the entry as the steps and saves queued before
  // it left it.
  virtual void save_snapshot(int32_t /*slot*/, int64_t snapshot) {
    fail("snapshot {}: this cache keeps no snapshots (it resumes at any position)", snapshot);
  }
  virtual void restore_snapshot(int64_t snapshot, int32_t /*slot*/) {
    fail("snapshot {}: this cache keeps no snapshots (it resumes at any position)", snapshot);
  }
};

// A model's own proposer of draft tokens (engine/mtp_proposer.h, docs/speculative.md): Qwen3.5's
// multi-token-prediction (MTP) layers, loaded beside the model for --speculative mtp. Each token of
// a step is a pair: the token x_{p+1} that follows position p, and a hidden state at p — the
// target's final normed one there (Model::forward_with_hidden), or the head's own output for the
// pair before when it chains — run at position p in the head's own KV cache. Its logits are the
// head's guess of x_{p+2}.
class DraftHead {
 public:
  virtual ~DraftHead() = default;
  // The head's KV cache: `slots` sequences of up to `capacity` positions.
  virtual std::unique_ptr<ModelCache> make_cache(int64_t slots, int64_t capacity) const = 0;
  // One step over a flattened batch: `layout`'s tokens with `hidden` [tokens, hidden_size] (the
  // backend's activation dtype, on its device), writing for the tokens listed in `rows` their f32
  // logits [rows, vocab] and their output hidden states [rows, hidden_size] (what a chained step
  // takes as its hidden input), on the device.
  virtual void forward(const BatchLayout& layout, const Tensor& hidden, const Tensor& rows, ModelCache& cache,
                       Tensor& logits, Tensor& out_hidden) = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual Backend& backend() const = 0;

  // Weight bytes one decode step reads (every matrix once; the embedding table contributes only
  // a row). Divided into measured time, it gives the bandwidth a benchmark reports.
  virtual size_t decode_weight_bytes() const = 0;
  // The weight bytes the forwards run since the previous call (or since construction) read
  // altogether, given that there were `forwards` of them: by default forwards ×
  // decode_weight_bytes(). A mixture of experts reads the experts its tokens chose (their union,
  // per layer and step), which it counts on the device as its forwards run — captured steps
  // replayed included, which is why the caller says how many there were — and reads back here: a
  // synchronisation, so `kiln bench` asks once before its timed decode steps (to start the count)
  // and once after them.
  virtual double weight_bytes_read(int64_t forwards) {
    return static_cast<double>(forwards) * static_cast<double>(decode_weight_bytes());
  }

  // A cache of `slots` sequences of up to `capacity` tokens whose attention layers each hold a pool
  // of `blocks` KV blocks (ModelCache). Slot s starts with blocks [s·W, s·W + W) (W =
  // kv_table_width(capacity)) when the pool has slots · W blocks or more; a smaller pool starts with
  // every entry at block 0, and the engine assigns a slot's blocks (ModelCache::assign_blocks)
  // before any of its positions are written or read.
  virtual std::unique_ptr<ModelCache> make_cache(int64_t slots, int64_t capacity, int64_t blocks) const = 0;
  // The cache with a block for every position of every slot, each slot holding its own blocks.
  std::unique_ptr<ModelCache> make_cache(int64_t slots, int64_t capacity) const {
    return make_cache(slots, capacity, slots * kv_table_width(capacity));
  }

  // Runs one step over a flattened batch (any mix of prefill chunks and decode tokens) and writes
  // the f32 logits of the tokens listed in `logit_rows` (indices into the batch) into
  // logits [logit_rows.size(), vocab] on the backend's device.
  virtual void forward(const BatchLayout& layout, const Tensor& logit_rows, ModelCache& cache,
                       Tensor& logits) = 0;
  // The same step, stopped before lm_head: writes the final hidden states of the tokens listed in
  // `rows` — the last layer's output after the final norm, what lm_head reads and transformers
  // returns as last_hidden_state — into hidden [rows.size(), hidden_size], in the backend's
  // activation dtype on its device. Embedding models pool them (engine/embedding_scheduler.h).
  virtual void forward_hidden(const BatchLayout& layout, const Tensor& rows, ModelCache& cache, Tensor& hidden) = 0;
  // forward() that also writes forward_hidden()'s states of the tokens listed in `hidden_rows` into
  // hidden [hidden_rows.size(), hidden_size], from the same step: what a draft head reads of the
  // target (draft_head()) with no second forward. A graph that has no draft head need not give them
  // (the default fails).
  virtual void forward_with_hidden(const BatchLayout& layout, const Tensor& logit_rows, const Tensor& hidden_rows,
                                   ModelCache& cache, Tensor& logits, Tensor& hidden);
  // The model's draft head, loaded when LoadOptions::mtp asked for it; null otherwise.
  virtual DraftHead* draft_head() { return nullptr; }
  // Whether forward() has an lm_head to compute logits with: not for a checkpoint of a bare
  // decoder (an embedding model's Qwen3Model) that stores none and does not tie it to the
  // embedding, which gives hidden states only.
  virtual bool computes_logits() const { return true; }
};

inline void Model::forward_with_hidden(const BatchLayout&, const Tensor&, const Tensor&, ModelCache&, Tensor&,
                                       Tensor&) {
  fail("this model has no draft head: its forward does not return hidden states beside its logits");
}

// The head every graph's Model::forward ends with: the logits of rows `logit_rows` of the step's
// final normed hidden states [tokens, hidden], gathered and then multiplied by lm_head.
inline void lm_head_logits(Backend& backend, const Tensor& normed, const Tensor& logit_rows, const Weight& lm_head,
                           Tensor& logits) {
  Tensor selected = backend.alloc({logit_rows.numel(), normed.dim(1)}, backend.activation_dtype());
  backend.gather_rows(normed, logit_rows, selected);
  backend.matmul(selected, lm_head, nullptr, logits);
}

}  // namespace kiln
