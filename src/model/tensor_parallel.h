// Tensor parallelism: one model split over N devices (`--tensor-parallel N`).
//
// One process drives all N devices, one host thread per rank. Why not one process per GPU: the
// scheduler, the server, the tokenizer and the sampler stay single and unchanged (they see one
// Model whose forward() returns rank 0's logits), and the ranks exchange nothing but all-reduce
// messages, so no inter-process control channel is needed. Each rank thread has its own CPU thread
// pool (core/thread_pool.h: a pool is not reentrant) and, on GPUs, binds its own device.
//
// The split is Megatron-LM's: the input projections are split by output rows — whole query heads
// with their KV heads (a KV head is replicated when there are fewer KV heads than ranks), whole
// Gated DeltaNet key heads with the value heads that read them, a block of the MLP's intermediate
// columns —; o_proj, the GDN out_proj and down_proj are split by input columns, so each rank
// computes a partial sum of their outputs, all-reduced before it joins the residual. Embedding,
// norms and lm_head are replicated. Each rank materialises only its shard of the checkpoint
// (WeightMap::shard: a row block stays a zero-copy view of the mapped file, a column block is a
// copy of only its bytes).
//
// Numerics: the all-reduce is deterministic and independent of the message size
// (backend/collective.h): every rank sums the N partials in rank order 0..N−1 in f32, so for a
// fixed N the logits are bit-identical across runs, batch compositions and chunkings, and every
// rank holds the same residual bits. Against N = 1 they differ only by the regrouping of the
// o_proj / down_proj dot products into N partial sums (within f32 / bf16 rounding).
//
// Only CPU backends are split today (the N-rank simulation); a CUDA tensor-parallel model needs
// the NCCL all-gather collective and is refused with an error until it exists.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "core/dtype.h"
#include "model/loader.h"
#include "model/model.h"

namespace kiln {

// Builds the plan's model split over `backends` (borrowed, one per rank, all of the plan's device;
// they must outlive the model), each rank thread computing with `threads_per_rank` CPU threads.
// Fails before any weight is read when the graph has no tensor-parallel support, the config does
// not split over backends.size() ranks (naming the field and N), or the device has no collective.
std::unique_ptr<Model> build_tensor_parallel_model(const ModelPlan& plan, const std::vector<Backend*>& backends,
                                                   std::optional<DType> dtype, int threads_per_rank);

}  // namespace kiln
