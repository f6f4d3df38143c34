// The one collective a tensor-parallel graph needs: a deterministic all-reduce (sum) of the
// row-parallel layers' partial outputs (o_proj, down_proj) across the N ranks of one model.
//
// Determinism contract: every rank receives the same bits, and each element is
//   ((partial₀ + partial₁) + partial₂) + … + partial_{N−1}
// summed in f32 in rank order 0..N−1 and rounded once to the tensor's dtype — whatever the message
// size. NCCL's all-reduce picks ring or tree (and their chunking) by message size, so its result
// would depend on how many tokens share the step (the batch composition); a tensor-parallel
// backend must therefore implement this as an all-gather of the N partials followed by this local
// fixed-order sum, never as a library all-reduce.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"

namespace kiln {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // Every rank calls this with its partial (same shape and dtype on every rank, on its backend's
  // device); on return each holds the fixed-order sum above. Blocks until all ranks have joined.
  virtual void all_reduce_sum(Tensor& partial) = 0;
  // Releases every rank blocked in (or later entering) all_reduce_sum with an error: a rank that
  // failed calls it so that the others do not wait for it forever.
  virtual void abort() = 0;
  // Clears an abort, once no rank is inside all_reduce_sum (the failed step is over).
  virtual void reset() = 0;
};

// The CPU collective (always present): one communicator per rank, all sharing one rendezvous in
// this process; rank i is element i. Implemented in backend/cpu/cpu_collective.cpp.
std::vector<std::unique_ptr<Collective>> make_cpu_collectives(int ranks);

}  // namespace kiln
