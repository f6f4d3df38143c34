// The CPU implementation of the deterministic all-reduce (backend/collective.h) between the N rank
// threads of one process: each rank publishes its partial, every rank sums all N in rank order.
#include "backend/collective.h"

#include <condition_variable>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln {
namespace {

// Elements one parallel_for chunk sums: each element is summed whole by one thread.
constexpr int64_t kElementsPerBlock = 4096;

float element_as_f32(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::F32: return tensor.data<const float>()[index];
    case DType::F16: return f16_to_f32(tensor.data<const uint16_t>()[index]);
    case DType::BF16: return bf16_to_f32(tensor.data<const uint16_t>()[index]);
    case DType::I32:
    case DType::U32:
    case DType::F8E4M3: break;
  }
  fail("all-reduce of a {} tensor (floating-point activations only)", dtype_name(tensor.dtype()));
}

void store_from_f32(Tensor& tensor, int64_t index, float value) {
  if (tensor.dtype() == DType::F32) tensor.data<float>()[index] = value;
  else if (tensor.dtype() == DType::F16) tensor.data<uint16_t>()[index] = f32_to_f16(value);
  else tensor.data<uint16_t>()[index] = f32_to_bf16(value);
}

// What the ranks share: the published partials and a reusable barrier that can be aborted.
class Rendezvous {
 public:
  explicit Rendezvous(int ranks) : partials_(ranks) {}

  int ranks() const { return static_cast<int>(partials_.size()); }

  void publish(int rank, const Tensor& partial) {
    std::lock_guard lock(mutex_);
    partials_[rank] = partial;
  }
  const Tensor& partial(int rank) const { return partials_[rank]; }

  // Blocks until all ranks have arrived (or fails once any rank aborted).
  void arrive_and_wait() {
    std::unique_lock lock(mutex_);
    if (aborted_) fail("tensor-parallel all-reduce aborted: another rank failed");
    const uint64_t generation = generation_;
    if (++arrived_ == ranks()) {
      arrived_ = 0;
      ++generation_;
      released_.notify_all();
      return;
    }
    released_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) fail("tensor-parallel all-reduce aborted: another rank failed");
  }

  void abort() {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    released_.notify_all();
  }

  void reset() {
    std::lock_guard lock(mutex_);
    aborted_ = false;
    arrived_ = 0;
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  std::vector<Tensor> partials_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
};

class CpuCollective final : public Collective {
 public:
  CpuCollective(std::shared_ptr<Rendezvous> rendezvous, int rank) : rendezvous_(std::move(rendezvous)), rank_(rank) {}

  int rank() const override { return rank_; }
  int ranks() const override { return rendezvous_->ranks(); }

  void all_reduce_sum(Tensor& partial) override {
    rendezvous_->publish(rank_, partial);
    rendezvous_->arrive_and_wait();  // every partial is published
    const int ranks = rendezvous_->ranks();
    for (int other = 0; other < ranks; ++other) {
      const Tensor& source = rendezvous_->partial(other);
      if (source.shape() != partial.shape() || source.dtype() != partial.dtype())
        fail("tensor-parallel all-reduce: rank {} sent {} {} but rank {} sent {} {}", other,
             dtype_name(source.dtype()), shape_string(source.shape()), rank_, dtype_name(partial.dtype()),
             shape_string(partial.shape()));
    }
    Tensor sum = Tensor::empty(partial.shape(), partial.dtype());
    ThreadPool::global().parallel_for(partial.numel(), kElementsPerBlock, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        float total = element_as_f32(rendezvous_->partial(0), index);
        for (int other = 1; other < ranks; ++other) total += element_as_f32(rendezvous_->partial(other), index);
        store_from_f32(sum, index, total);
      }
    });
    rendezvous_->arrive_and_wait();  // nobody overwrites its partial before every rank has read it
    std::memcpy(partial.raw(), sum.raw(), sum.nbytes());
  }

  void abort() override { rendezvous_->abort(); }
  void reset() override { rendezvous_->reset(); }

 private:
  std::shared_ptr<Rendezvous> rendezvous_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Collective>> make_cpu_collectives(int ranks) {
  if (ranks < 1) fail("tensor parallelism needs at least 1 rank, got {}", ranks);
  auto rendezvous = std::make_shared<Rendezvous>(ranks);
  std::vector<std::unique_ptr<Collective>> collectives;
  for (int rank = 0; rank < ranks; ++rank) collectives.push_back(std::make_unique<CpuCollective>(rendezvous, rank));
  return collectives;
}

}  // namespace kiln
