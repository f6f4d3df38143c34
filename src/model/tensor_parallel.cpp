#include "model/tensor_parallel.h"

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "backend/collective.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/tensor_parallel_rank.h"

namespace kiln {
namespace {

// N persistent threads, thread r running rank r's work on its own thread pool.
class RankThreads {
 public:
  RankThreads(int ranks, int threads_per_rank) : errors_(ranks) {
    if (threads_per_rank < 1) fail("tensor parallelism needs at least 1 thread per rank, got {}", threads_per_rank);
    for (int rank = 0; rank < ranks; ++rank)
      threads_.emplace_back([this, rank, threads_per_rank] { loop(rank, threads_per_rank); });
  }

  ~RankThreads() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    start_.notify_all();
    for (auto& thread : threads_) thread.join();
  }

  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  // Runs job(r) on every rank thread r concurrently and waits for all; rethrows the error of the
  // lowest failing rank.
  void run(const std::function<void(int rank)>& job) {
    {
      std::lock_guard lock(mutex_);
      job_ = &job;
      pending_ = static_cast<int>(threads_.size());
      for (auto& error : errors_) error = nullptr;
      ++generation_;
    }
    start_.notify_all();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    for (const auto& error : errors_)
      if (error) std::rethrow_exception(error);
  }

 private:
  void loop(int rank, int threads_per_rank) {
    ThreadPool pool(threads_per_rank);
    ThreadPool::use_on_this_thread(&pool);
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock lock(mutex_);
        start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) break;
        seen = generation_;
        job = job_;
      }
      std::exception_ptr error;
      try {
        (*job)(rank);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(mutex_);
      errors_[rank] = error;
      if (--pending_ == 0) done_.notify_all();
    }
    ThreadPool::use_on_this_thread(nullptr);
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* job_ = nullptr;
  std::vector<std::exception_ptr> errors_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
};

class TensorParallelCache final : public ModelCache {
 public:
  explicit TensorParallelCache(std::vector<std::unique_ptr<ModelCache>> ranks) : ranks_(std::move(ranks)) {}
  int64_t slots() const override { return ranks_.front()->slots(); }
  int64_t capacity() const override { return ranks_.front()->capacity(); }
  // Every rank's pool holds its KV heads of the same blocks: one table, copied to each rank.
  int64_t blocks() const override { return ranks_.front()->blocks(); }
  int64_t table_width() const override { return ranks_.front()->table_width(); }
  void assign_blocks(int32_t slot, int64_t first_entry, std::span<const int32_t> blocks) override {
    for (auto& rank : ranks_) rank->assign_blocks(slot, first_entry, blocks);
  }
  void reset_slot(int32_t slot) override {
    for (auto& rank : ranks_) rank->reset_slot(slot);
  }
  bool resumes_at_any_position() const override { return ranks_.front()->resumes_at_any_position(); }
  void save_slot_state(int32_t slot) override {
    for (auto& rank : ranks_) rank->save_slot_state(slot);
  }
  void restore_slot_state(int32_t slot) override {
    for (auto& rank : ranks_) rank->restore_slot_state(slot);
  }
  // Each rank keeps its heads' part of every snapshot, under the same entry.
  void allocate_snapshots(int64_t count) override {
    for (auto& rank : ranks_) rank->allocate_snapshots(count);
  }
  int64_t snapshots() const override { return ranks_.front()->snapshots(); }
  void save_snapshot(int32_t slot, int64_t snapshot) override {
    for (auto& rank : ranks_) rank->save_snapshot(slot, snapshot);
  }
  void restore_snapshot(int64_t snapshot, int32_t slot) override {
    for (auto& rank : ranks_) rank->restore_snapshot(snapshot, slot);
  }
  size_t bytes() const override {
    size_t total = 0;
    for (const auto& rank : ranks_) total += rank->bytes();
    return total;
  }
  ModelCache& rank(int index) { return *ranks_[index]; }

 private:
  std::vector<std::unique_ptr<ModelCache>> ranks_;
};

class TensorParallelModel final : public Model {
 public:
  TensorParallelModel(const ModelPlan& plan, const std::vector<Backend*>& backends, std::optional<DType> dtype,
                      int threads_per_rank, std::vector<std::unique_ptr<Collective>> collectives)
      : config_(plan.config),
        backends_(backends),
        collectives_(std::move(collectives)),
        models_(backends.size()),
        threads_(static_cast<int>(backends.size()), threads_per_rank) {
    const ModelImplementation& implementation = *plan.implementation;
    const TensorParallelSupport& support = implementation.tensor_parallel;
    // Each rank loads on its own thread (its own pool converts its shard).
    threads_.run([&](int index) {
      const TensorParallelRank rank{index, ranks(), collectives_[index].get()};
      WeightMap weights(plan.checkpoint, plan.load_plan);
      weights.shard([&](const std::string& canonical, const Shape& shape) {
        return support.shard(plan.config, rank, canonical, shape);
      });
      if (dtype) weights.convert_to(*dtype);
      check_resolved_profile(plan.config, plan.resolved);
      models_[index] = support.create(weights, plan.config, plan.resolved, *backends_[index], rank);
      if (!models_[index])
        fail("model implementation {} returned no model for rank {} of {} ({})", implementation.id, index, ranks(),
             plan.model_dir.string());
      weights.require_all_used();
    });
  }

  const ModelConfig& config() const override { return config_; }
  Backend& backend() const override { return *backends_.front(); }

  // Every rank reads its shard and its replicas each step.
  size_t decode_weight_bytes() const override {
    size_t bytes = 0;
    for (const auto& model : models_) bytes += model->decode_weight_bytes();
    return bytes;
  }

  std::unique_ptr<ModelCache> make_cache(int64_t slots, int64_t capacity, int64_t blocks) const override {
    std::vector<std::unique_ptr<ModelCache>> caches;
    for (const auto& model : models_) caches.push_back(model->make_cache(slots, capacity, blocks));
    return std::make_unique<TensorParallelCache>(std::move(caches));
  }

  void forward(const BatchLayout& layout, const Tensor& logit_rows, ModelCache& model_cache,
               Tensor& logits) override {
    run_every_rank(&Model::forward, layout, logit_rows, model_cache, logits);
  }

  void forward_hidden(const BatchLayout& layout, const Tensor& rows, ModelCache& model_cache,
                      Tensor& hidden) override {
    run_every_rank(&Model::forward_hidden, layout, rows, model_cache, hidden);
  }

  bool computes_logits() const override { return models_.front()->computes_logits(); }

 private:
  using RankStep = void (Model::*)(const BatchLayout&, const Tensor&, ModelCache&, Tensor&);

  // Rank 0 runs `step` on the caller's layout and writes `out`; every other rank gets its own copy
  // of the step on its backend and computes the same rows (the final norm and lm_head are
  // replicated), which it drops. A step that fails on any rank fails with the first rank error,
  // and leaves the model usable.
  void run_every_rank(RankStep rank_step, const BatchLayout& layout, const Tensor& rows, ModelCache& model_cache,
                      Tensor& out) {
    auto& cache = dynamic_cast<TensorParallelCache&>(model_cache);
    const Tensor host_ids = backends_.front()->download(layout.token_ids);
    const Tensor host_rows = backends_.front()->download(rows);
    const std::vector<int32_t> ids(host_ids.data<const int32_t>(), host_ids.data<const int32_t>() + host_ids.numel());
    std::mutex failure_mutex;
    std::exception_ptr first_failure;  // recorded before the abort, so never the abort's own error
    auto step = [&](int index) {
      if (index == 0) {
        (models_[0].get()->*rank_step)(layout, rows, cache.rank(0), out);
        return;
      }
      Backend& backend = *backends_[index];
      const BatchLayout rank_layout = backend.make_layout(layout.spans, ids);
      const Tensor rank_rows = backend.upload(host_rows);
      Tensor rank_out = backend.alloc(out.shape(), out.dtype());
      (models_[index].get()->*rank_step)(rank_layout, rank_rows, cache.rank(index), rank_out);
    };
    try {
      threads_.run([&](int index) {
        try {
          step(index);
        } catch (...) {
          {
            std::lock_guard lock(failure_mutex);
            if (!first_failure) first_failure = std::current_exception();
          }
          // The other ranks may be waiting for this one inside an all-reduce: release them.
          collectives_[index]->abort();
          throw;
        }
      });
    } catch (...) {
      // Every rank has left the step: the collective can be used again.
      for (auto& collective : collectives_) collective->reset();
      std::rethrow_exception(first_failure ? first_failure : std::current_exception());
    }
  }

  int ranks() const { return static_cast<int>(backends_.size()); }

  ModelConfig config_;
  std::vector<Backend*> backends_;
  std::vector<std::unique_ptr<Collective>> collectives_;
  std::vector<std::unique_ptr<Model>> models_;
  RankThreads threads_;  // last: its threads stop before the models they run are destroyed
};

}  // namespace

std::unique_ptr<Model> build_tensor_parallel_model(const ModelPlan& plan, const std::vector<Backend*>& backends,
                                                   std::optional<DType> dtype, int threads_per_rank) {
  const int ranks = static_cast<int>(backends.size());
  const std::string& profile = plan.resolved.profile.id();
  if (ranks < 1) fail("tensor parallelism needs at least 1 rank, got {}", ranks);
  const ModelImplementation& implementation = *plan.implementation;
  if (!implementation.tensor_parallel.supported())
    fail("model profile {}: implementation {} (graph {}) cannot be split over tensor-parallel ranks", profile,
         implementation.id, graph_name(implementation.graph));
  implementation.tensor_parallel.check(plan.config, ranks);
  // A rank's column block of a packed matrix would split its groups' codes and scales apart.
  if (ranks > 1 && plan.config.quantization.method != QuantMethod::None)
    fail("model profile {}: tensor parallelism over quantized weights ({}) is not supported", profile,
         quant_method_name(plan.config.quantization.method));
  for (int rank = 0; rank < ranks; ++rank)
    if (backends[rank]->device() != plan.device)
      fail("model profile {}: tensor-parallel rank {} runs on {}, but the model was planned for {}", profile, rank,
           backends[rank]->name(), device_name(plan.device));
  if (plan.device != Device::CPU)
    fail("tensor parallelism on {} needs the NCCL all-gather collective, which this kiln does not have yet",
         device_name(plan.device));
  return std::make_unique<TensorParallelModel>(plan, backends, dtype, threads_per_rank, make_cpu_collectives(ranks));
}

}  // namespace kiln
