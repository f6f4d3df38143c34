// The memory plan (engine/memory_plan.h) that `kiln fit` prints and `kiln serve` checks, and the
// measuring backend it is made on (backend/measuring_backend.h): for each family the dry run's
// parts are exactly what the CPU backend hands out for the same work, the measuring backend
// keeps blocks as the allocator it stands in for does and still checks every op's shapes, a plan
// of an 8B model is made without its memory (its tensors fault on any element access, so no op
// can loop over elements unnoticed), and the verdict and the longest fitting context follow from
// the parts.
#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backend/measuring_backend.h"
#include "core/error.h"
#include "engine/memory_plan.h"
#include "io/config.h"
#include "model/family.h"
#include "model/loader.h"
#include "model/synth.h"
#include "forwarding_backend.h"
#include "mtp_support.h"
#include "profile_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

// The CPU backend with the memory of every tensor it hands out counted while the tensor lives:
// what alloc returns, what upload hands over (on the CPU the host tensor itself: a weight's
// mapped or converted bytes) and a layout's host tensors. With `as_caching_allocator` it answers
// the measuring backend's questions as a caching allocator of 512-byte granules would, and with
// `device` it reports that memory instead of the machine's (its ops stay the CPU's).
class CountingCpuBackend final : public ForwardingCpuBackend {
 public:
  explicit CountingCpuBackend(bool as_caching_allocator = false, std::optional<DeviceMemory> device = std::nullopt)
      : as_caching_allocator_(as_caching_allocator), device_(device) {}

  uint64_t live() const { return counts_->live; }
  uint64_t peak() const { return counts_->peak; }
  void restart_peak() { counts_->peak = counts_->live; }

  Tensor alloc(const Shape& shape, DType dtype) override {
    const Tensor tensor = cpu().alloc(shape, dtype);
    return counted(tensor, hold(tensor.nbytes()));
  }
  DeviceMemory memory() override { return device_ ? *device_ : cpu().memory(); }
  uint64_t allocation_bytes(uint64_t bytes) const override {
    return as_caching_allocator_ ? (bytes + 511) / 512 * 512 : ForwardingCpuBackend::allocation_bytes(bytes);
  }
  bool caches_freed_blocks() const override { return as_caching_allocator_; }
  Tensor upload(const Tensor& host) override { return counted(cpu().upload(host), hold(host.nbytes())); }
  BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) override {
    BatchLayout layout = cpu().make_layout(spans, token_ids);
    const auto held = hold(layout.token_ids.nbytes() + layout.positions.nbytes() + layout.slots.nbytes() +
                           layout.spans_device.nbytes());
    for (Tensor* tensor : {&layout.token_ids, &layout.positions, &layout.slots, &layout.spans_device})
      *tensor = counted(*tensor, held);
    return layout;
  }

 private:
  struct Counts {
    uint64_t live = 0, peak = 0;
  };

  // Counts `bytes` as live until the returned handle goes.
  std::shared_ptr<const void> hold(uint64_t bytes) {
    counts_->live += bytes;
    counts_->peak = std::max(counts_->peak, counts_->live);
    return std::shared_ptr<const void>(nullptr, [counts = counts_, bytes](const void*) { counts->live -= bytes; });
  }

  // `tensor`, keeping `held` for as long as it or a view of it lives.
  static Tensor counted(const Tensor& tensor, std::shared_ptr<const void> held) {
    auto owner = std::make_shared<const std::pair<Tensor, std::shared_ptr<const void>>>(tensor, std::move(held));
    return Tensor::borrow(tensor.raw(), tensor.shape(), tensor.dtype(), std::move(owner), tensor.device());
  }

  bool as_caching_allocator_;
  std::optional<DeviceMemory> device_;
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
};

TEST(MemoryPlan, EachPartIsWhatTheCpuBackendHandsOutForTheSameWork) {
  // The shared fixtures, and the project's mixtures of experts (routed on the backend: the dry
  // run's expert products allocate what the backend reports for them, whatever the routes).
  std::vector<std::filesystem::path> fixtures;
  for (const char* family : {"llama3-tiny", "qwen3-tiny", "qwen3_5-text-tiny", "qwen3_5-vl-tiny"})
    fixtures.push_back(fixtures_dir() / family);
  for (const char* family : {"qwen3-moe-tiny", "qwen3_5-moe-tiny"})
    fixtures.push_back(fixtures_dir() / family);
  for (const auto& family : fixtures) {
    for (const char* dtype : {"f32", "bf16"}) {
      SCOPED_TRACE(family.filename().string() + " " + dtype);
      const ModelPlan model_plan = plan_model(family / dtype, Device::CPU, true);
      CountingCpuBackend backend;
      const MemoryRequest request{3, 200, 64};
      const MemoryPlan plan = plan_memory(model_plan, backend, std::nullopt, request);
      EXPECT_EQ(plan.cache_slots, 3);  // the CPU backend runs no decode graphs
      EXPECT_EQ(plan.graph_scratch, 0u);
      EXPECT_EQ(plan.step_tokens, 3 * 64);
      EXPECT_TRUE(plan.steps_planned);
      EXPECT_EQ(backend.live(), 0u) << "the dry run handed out memory of the CPU backend";

      const std::unique_ptr<Model> model = build_model(model_plan, backend);
      EXPECT_EQ(plan.weights, backend.live());
      const std::unique_ptr<ModelCache> cache =
        model->make_cache(plan.cache_slots, request.context, engine_cache_blocks(request));
      EXPECT_EQ(plan.cache, backend.live() - plan.weights);
      EXPECT_EQ(plan.cache, cache->bytes());
      const uint64_t before_step = backend.live();
      backend.restart_peak();
      run_largest_step(*model, *cache, request);
      EXPECT_EQ(plan.step_scratch, backend.peak() - before_step);
      EXPECT_EQ(backend.live(), before_step);
      EXPECT_GT(plan.step_scratch, 0u);
    }
  }
}

TEST(MemoryPlan, AnEmbeddingServersStepIsWhatTheCpuBackendHandsOut) {
  for (const char* family : {"qwen3-tiny", "qwen3_5-text-tiny"}) {
    SCOPED_TRACE(family);
    const ModelPlan model_plan = plan_model(fixtures_dir() / family / "f32", Device::CPU, true);
    CountingCpuBackend backend;
    const MemoryRequest request{3, 200, 64, true};
    const MemoryPlan plan = plan_memory(model_plan, backend, std::nullopt, request);
    EXPECT_EQ(plan.graph_scratch, 0u);
    // Every token's hidden-state row instead of each sequence's logit row.
    EXPECT_NE(plan.step_scratch, plan_memory(model_plan, backend, std::nullopt, {3, 200, 64}).step_scratch);
    const std::unique_ptr<Model> model = build_model(model_plan, backend);
    const std::unique_ptr<ModelCache> cache =
        model->make_cache(plan.cache_slots, request.context, engine_cache_blocks(request));
    const uint64_t before_step = backend.live();
    backend.restart_peak();
    run_largest_step(*model, *cache, request);
    EXPECT_EQ(plan.step_scratch, backend.peak() - before_step);
  }
}

// A server whose requests may speculate holds, for a hybrid model, a saved recurrent state per slot:
// the plan counts what the CPU backend hands out for it; a KV cache saves nothing.
TEST(MemoryPlan, SpeculationCountsTheSavedStatesOfAHybridCache) {
  for (const char* family : {"llama3-tiny", "qwen3_5-text-tiny"}) {
    SCOPED_TRACE(family);
    const ModelPlan model_plan = plan_model(fixtures_dir() / family / "f32", Device::CPU, true);
    CountingCpuBackend backend;
    const MemoryPlan plain = plan_memory(model_plan, backend, std::nullopt, {3, 200, 64});
    const MemoryPlan speculative = plan_memory(model_plan, backend, std::nullopt, {3, 200, 64, false, true});
    const std::unique_ptr<Model> model = build_model(model_plan, backend);
    const std::unique_ptr<ModelCache> cache =
        model->make_cache(plain.cache_slots, 200, engine_cache_blocks(plain.request));
    const uint64_t before_save = backend.live();
    cache->save_slot_state(0);
    const uint64_t saved = backend.live() - before_save;
    EXPECT_EQ(speculative.cache - plain.cache, saved);
    if (std::string(family) == "llama3-tiny") EXPECT_EQ(saved, 0u);
    else EXPECT_GT(saved, 0u);
  }
}

// A hybrid model's prefix cache keeps snapshots of the recurrent state beside the slots: the plan
// counts what the CPU backend hands out for them (a slot's state each) and says so; a KV cache
// keeps none.
TEST(MemoryPlan, ThePrefixSnapshotsOfAHybridCacheArePlanned) {
  for (const char* family : {"llama3-tiny", "qwen3_5-text-tiny"}) {
    SCOPED_TRACE(family);
    const ModelPlan model_plan = plan_model(fixtures_dir() / family / "f32", Device::CPU, true);
    CountingCpuBackend backend;
    MemoryRequest request{3, 200, 64};
    const MemoryPlan without = plan_memory(model_plan, backend, std::nullopt, request);
    request.prefix_snapshots = 5;
    const MemoryPlan plan = plan_memory(model_plan, backend, std::nullopt, request);
    EXPECT_EQ(without.snapshots, 0u);
    EXPECT_EQ(plan.total() - without.total(), plan.snapshots);

    const std::unique_ptr<Model> model = build_model(model_plan, backend);
    const std::unique_ptr<ModelCache> cache =
        model->make_cache(plan.cache_slots, request.context, engine_cache_blocks(request));
    const uint64_t before_snapshots = backend.live();
    cache->allocate_snapshots(request.prefix_snapshots);
    EXPECT_EQ(plan.snapshots, backend.live() - before_snapshots);
    EXPECT_EQ(plan.cache + plan.snapshots, cache->bytes());
    const bool described = describe_memory_plan(plan, "cpu").find("prefix snapshots") != std::string::npos;
    if (std::string(family) == "llama3-tiny") {
      EXPECT_EQ(plan.snapshots, 0u);
      EXPECT_FALSE(described);
    } else {
      // Each snapshot is what a slot's state takes: the speculative save's copy of every slot.
      const uint64_t before_save = backend.live();
      cache->save_slot_state(0);
      EXPECT_EQ(plan.snapshots * plan.cache_slots, (backend.live() - before_save) * request.prefix_snapshots);
      EXPECT_GT(plan.snapshots, 0u);
      EXPECT_TRUE(described);
    }
  }
}

// A draft model served beside the target (kiln serve --speculative draft:DIR) is planned too: its
// weights, its cache of the request's slots and context and its largest step are what the CPU
// backend hands out for them, held beside the target's parts, and the total counts them.
TEST(MemoryPlan, ADraftModelIsPlannedBesideTheTarget) {
  const ModelPlan target = plan_model(fixtures_dir() / "qwen3_5-text-tiny" / "f32", Device::CPU, true);
  const ModelPlan draft_plan = plan_model(fixtures_dir() / "llama3-tiny" / "f32", Device::CPU, true);
  CountingCpuBackend backend;
  const MemoryPlan alone = plan_memory(target, backend, std::nullopt, {3, 200, 64});
  MemoryRequest request{3, 200, 64};
  request.draft = &draft_plan;
  const MemoryPlan with_draft = plan_memory(target, backend, std::nullopt, request);
  EXPECT_EQ(backend.live(), 0u) << "the dry run handed out memory of the CPU backend";

  backend.restart_peak();
  const std::unique_ptr<Model> draft = build_model(draft_plan, backend);
  const std::unique_ptr<ModelCache> cache = draft->make_cache(3, 200);
  run_largest_step(*draft, *cache, {3, 200, 64});
  EXPECT_EQ(with_draft.draft, backend.peak());
  EXPECT_GT(with_draft.draft, cache->bytes());
  EXPECT_EQ(with_draft.total() - alone.total(), with_draft.draft);
  EXPECT_NE(describe_memory_plan(with_draft, "cpu").find("draft model"), std::string::npos);
  EXPECT_EQ(describe_memory_plan(alone, "cpu").find("draft model"), std::string::npos);
}

// Requests that speculate with the MTP head: its weights are the model's (a load that keeps them),
// and its cache and its step over the largest step's hidden states are what the CPU backend hands
// out for them.
TEST(MemoryPlan, TheMtpHeadIsPlannedWithTheModel) {
  for (const char* family : {"qwen3_5-text-tiny", "qwen3_5-moe-tiny"}) {
    SCOPED_TRACE(family);
    TempDir dir;
    write_with_mtp(fixtures_dir() / family / "f32", dir.path());
    LoadOptions options;
    options.mtp = true;
    const ModelPlan model_plan = plan_model(dir.path(), Device::CPU, true, options);
    const ModelPlan without_head = plan_model(fixtures_dir() / family / "f32", Device::CPU, true);
    CountingCpuBackend backend;
    MemoryRequest request{3, 200, 64, false, true};
    const MemoryPlan ngram = plan_memory(without_head, backend, std::nullopt, request);
    request.mtp = true;
    const MemoryPlan plan = plan_memory(model_plan, backend, std::nullopt, request);
    EXPECT_EQ(backend.live(), 0u) << "the dry run handed out memory of the CPU backend";
    EXPECT_GT(plan.weights, ngram.weights);
    EXPECT_GT(plan.step_scratch, ngram.step_scratch);
    EXPECT_NE(describe_memory_plan(plan, "cpu").find("mtp head cache"), std::string::npos);
    EXPECT_EQ(describe_memory_plan(ngram, "cpu").find("mtp head cache"), std::string::npos);

    const std::unique_ptr<Model> model = build_model(model_plan, backend);
    EXPECT_EQ(plan.weights, backend.live());
    const std::unique_ptr<ModelCache> cache =
        model->make_cache(plan.cache_slots, request.context, engine_cache_blocks(request));
    cache->save_slot_state(0);
    EXPECT_EQ(plan.cache, cache->bytes());
    const uint64_t before_head = backend.live();
    const std::unique_ptr<ModelCache> head_cache = model->draft_head()->make_cache(3, request.context);
    EXPECT_EQ(plan.mtp, backend.live() - before_head);
    EXPECT_EQ(plan.mtp, head_cache->bytes());
    const uint64_t before_step = backend.live();
    backend.restart_peak();
    run_largest_step(*model, *cache, request, head_cache.get());
    EXPECT_EQ(plan.step_scratch, backend.peak() - before_step);
    EXPECT_EQ(backend.live(), before_step);
    EXPECT_EQ(plan.total(), plan.weights + plan.cache + plan.step_scratch + plan.reserve + plan.mtp);
  }
}

TEST(MemoryPlan, ConvertedWeightsArePlannedInTheLoadDtype) {
  for (const char* family : {"llama3-tiny", "qwen3_5-text-tiny"}) {
    SCOPED_TRACE(family);
    const ModelPlan bf16 = plan_model(fixtures_dir() / family / "bf16", Device::CPU, true);
    CountingCpuBackend backend;
    const MemoryPlan as_stored = plan_memory(bf16, backend, std::nullopt, {1, 64, 64});
    const MemoryPlan widened = plan_memory(bf16, backend, DType::F32, {1, 64, 64});
    EXPECT_GT(widened.weights, as_stored.weights);
    const std::unique_ptr<Model> model = build_model(bf16, backend, DType::F32);
    EXPECT_EQ(widened.weights, backend.live());
  }
}

TEST(MemoryPlan, ShapeOnlyWeightsHaveTheDtypeConstructionSees) {
  // The Qwen3.5 checkpoint stores its zero-centred norm gains as 1 + γ: the SubtractOne fix-up
  // makes them F32, whatever the checkpoint's dtype; --dtype converts every tensor.
  const ModelPlan plan = plan_model(fixtures_dir() / "qwen3_5-text-tiny/bf16", Device::CPU, true);
  WeightMap stored = WeightMap(plan.checkpoint, plan.load_plan);
  WeightMap shapes = WeightMap::shapes_only(plan.checkpoint, plan.load_plan, std::nullopt);
  WeightMap converted = WeightMap::shapes_only(plan.checkpoint, plan.load_plan, DType::F16);
  for (const PlannedTensor& planned : plan.load_plan.tensors) {
    SCOPED_TRACE(planned.canonical);
    const Tensor real = stored.take(planned.canonical, planned.canonical_shape);
    const Tensor shape_only = shapes.take(planned.canonical, planned.canonical_shape);
    EXPECT_EQ(shape_only.dtype(), real.dtype());
    EXPECT_EQ(converted.take(planned.canonical, planned.canonical_shape).dtype(), DType::F16);
  }
  EXPECT_NO_THROW(shapes.require_all_used());
  EXPECT_FAILS_MENTIONING(WeightMap::shapes_only(plan.checkpoint, plan.load_plan, DType::I32), "cannot be converted");
}

TEST(MeasuringBackend, AWrongShapeStillFails) {
  auto cpu = make_cpu_backend();
  MeasuringBackend measuring(*cpu);
  const Tensor x = measuring.alloc({4, 64}, DType::F32);
  const Tensor w = measuring.upload(Tensor::unbacked({32, 48}, DType::BF16));
  Tensor out = measuring.alloc({4, 32}, DType::F32);
  EXPECT_FAILS_MENTIONING(measuring.matmul(x, w, nullptr, out), "cpu matmul", "x has shape [4, 64]", "K = 48");
  const Weight weight = w;
  const MatmulTarget products[] = {{&weight, nullptr, &out}};
  EXPECT_FAILS_MENTIONING(measuring.matmul_group(x, products), "cpu matmul", "K = 48");
  // The activation dtype is the target's: BF16 activations are refused where the CPU refuses them.
  const Tensor bf16_x = measuring.alloc({4, 48}, DType::BF16);
  EXPECT_FAILS_MENTIONING(measuring.matmul(bf16_x, w, nullptr, out), "cpu matmul", "x has dtype BF16");
  Tensor gate = measuring.alloc({4, 32}, DType::F32);
  const Tensor up = measuring.alloc({4, 31}, DType::F32);
  EXPECT_FAILS_MENTIONING(measuring.swiglu(gate, up, gate), "cpu swiglu");
  const Tensor right_x = measuring.alloc({4, 48}, DType::F32);
  EXPECT_NO_THROW(measuring.matmul(right_x, w, nullptr, out));
}

// Misuse of the measuring backend fails in one line naming the target and the call.
TEST(MeasuringBackend, RefusesMisuseInOneLine) {
  auto cpu = make_cpu_backend();
  MeasuringBackend measuring(*cpu);
  EXPECT_FAILS_MENTIONING(measuring.measure_copy_bandwidth_gbps(), "measuring backend for cpu computes nothing");
  EXPECT_FAILS_MENTIONING(measuring.alloc({4, -1}, DType::F32), "cpu alloc: shape [4, -1] has a negative extent");
  EXPECT_FAILS_MENTIONING(Tensor::unbacked({-2}, DType::F32), "tensor shape [-2] has a negative extent");
  EXPECT_FAILS_MENTIONING(measuring.upload(Tensor()), "cpu upload: the host tensor is undefined");
  Tensor undefined;
  EXPECT_FAILS_MENTIONING(measuring.zero(undefined), "cpu zero: the tensor is undefined");
  EXPECT_FAILS_MENTIONING(measuring.make_layout({{0, 0, 0, 0}}, {}), "cpu make_layout: span 0", "at least one token");
  EXPECT_FAILS_MENTIONING(measuring.make_layout({{0, 1, 2, 0}}, {1, 2}), "span 0 starts at token 1",
                          "end at token 0");
  EXPECT_FAILS_MENTIONING(measuring.make_layout({{0, 0, 2, 0}}, {1}), "1 token ids for spans covering 2 tokens");
  GraphOps& graphs = measuring;  // its GraphOps, whether or not the target has them
  Tensor device = measuring.alloc({4}, DType::F32);
  EXPECT_FAILS_MENTIONING(graphs.upload_into(Tensor::zeros({3}, DType::F32), device), "cpu upload_into: host",
                          "does not match device");
  EXPECT_FAILS_MENTIONING(graphs.capture([&] { graphs.capture([] {}); }),
                          "capture() was called from inside captured work");
}

TEST(MeasuringBackend, HoldsWhatANonCachingAllocatorHoldsAndItsPeak) {
  CountingCpuBackend target;
  MeasuringBackend measuring(target);
  {
    const Tensor a = measuring.alloc({100}, DType::F32);
    const Tensor b = measuring.alloc({50}, DType::F32);
    EXPECT_EQ(measuring.measured().held, 600u);
    EXPECT_EQ(measuring.measured().in_use, 600u);
  }
  EXPECT_EQ(measuring.measured().held, 0u);
  EXPECT_EQ(measuring.measured().peak_held, 600u);
  measuring.restart_peak();
  EXPECT_EQ(measuring.measured().peak_held, 0u);
  EXPECT_EQ(target.live(), 0u) << "the measuring backend allocated through its target";
}

TEST(MeasuringBackend, KeepsBlocksAsACachingAllocatorDoes) {
  CountingCpuBackend target(/*as_caching_allocator=*/true);
  MeasuringBackend measuring(target);
  const auto held = [&] { return measuring.measured().held; };
  { const Tensor a = measuring.alloc({100}, DType::F32); }  // 400 bytes: a 512-byte block
  EXPECT_EQ(held(), 512u);
  EXPECT_EQ(measuring.measured().in_use, 0u);
  {
    const Tensor again = measuring.alloc({128}, DType::F32);  // the cached block of its size
    EXPECT_EQ(held(), 512u);
    const Tensor wider = measuring.alloc({200}, DType::F32);  // no cached block of 1,024 bytes
    EXPECT_EQ(held(), 1536u);
  }
  // Captured work takes a cached block and keeps it in its own pool: the next ordinary request of
  // that size needs a new block, and the next capture finds it in the pool.
  measuring.capture([&] { const Tensor scratch = measuring.alloc({100}, DType::F32); });
  EXPECT_EQ(held(), 1536u);
  { const Tensor a = measuring.alloc({100}, DType::F32); }
  EXPECT_EQ(held(), 2048u);
  measuring.capture([&] { const Tensor scratch = measuring.alloc({100}, DType::F32); });
  EXPECT_EQ(held(), 2048u);
  EXPECT_EQ(measuring.measured().peak_held, 2048u);
}

TEST(MeasuringBackend, ItsTensorsTakeNoMemory) {
  auto cpu = make_cpu_backend();
  MeasuringBackend measuring(*cpu);
  // Four tebibytes, measured: the tensor has its shape and no storage.
  const Tensor huge = measuring.alloc({int64_t{1} << 40}, DType::F32);
  EXPECT_EQ(huge.nbytes(), uint64_t{1} << 42);
  EXPECT_EQ(measuring.measured().held, uint64_t{1} << 42);
  EXPECT_EQ(measuring.download(huge).nbytes(), uint64_t{1} << 42);
  EXPECT_EQ(measuring.measured().held, uint64_t{1} << 42) << "a download is host memory, not the backend's";
}

// A checkpoint of `shape`'s tensors in BF16 whose data is one hole of a sparse file: its headers
// are real, and none of its bytes takes disk or memory. With `affine_bits`, every matrix the family
// marks as a Linear or embedding one is MLX affine in groups of 64 (U32 codes, BF16 scales and
// biases) and config.json says so. Returns the bytes of the tensors.
uint64_t write_sparse_checkpoint(const std::string& shape, const std::filesystem::path& dir,
                                 std::optional<int> affine_bits = std::nullopt) {
  const SynthShape& synth = find_synth_shape(shape);
  std::filesystem::create_directories(dir);
  nlohmann::json config = synth.config;
  if (affine_bits) config["quantization"] = {{"group_size", 64}, {"bits", *affine_bits}};
  std::ofstream(dir / "config.json") << config.dump();
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
  uint64_t offset = 0;
  auto add = [&](const std::string& name, const char* dtype, const Shape& tensor_shape, uint64_t element_bytes) {
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(tensor_shape)) * element_bytes;
    header[name] = {{"dtype", dtype}, {"shape", tensor_shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  };
  for (const SynthTensor& tensor : synth_tensor_layout(parse_model_config(synth.config, dir / "config.json"))) {
    if (!affine_bits || tensor.role == TensorRole::Other) {
      add(tensor.name, "BF16", tensor.shape, 2);
      continue;
    }
    const std::string module = tensor.name.substr(0, tensor.name.size() - std::string(".weight").size());
    add(tensor.name, "U32", {tensor.shape[0], tensor.shape[1] * *affine_bits / 32}, 4);
    add(module + ".scales", "BF16", {tensor.shape[0], tensor.shape[1] / 64}, 2);
    add(module + ".biases", "BF16", {tensor.shape[0], tensor.shape[1] / 64}, 2);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  {
    std::ofstream file(dir / "model.safetensors", std::ios::binary);
    char prefix[8];
    std::memcpy(prefix, &length, 8);  // little-endian, as x86-64 stores it
    file.write(prefix, 8);
    file << text;
  }
  std::filesystem::resize_file(dir / "model.safetensors", 8 + length + offset);
  return offset;
}

// The address space this process has mapped (VmSize), in bytes.
uint64_t mapped_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  uint64_t kib = 0;
  while (status >> key) {
    if (key == "VmSize:" && status >> kib) return kib * 1024;
    status.ignore(1 << 20, '\n');
  }
  ADD_FAILURE() << "/proc/self/status has no VmSize line";
  return 0;
}

TEST(MemoryPlan, An80GigabytePlanIsMadeInUnderASecondWithoutItsMemory) {
  TempDir temp;
  write_sparse_checkpoint("llama-3.1-8b", temp.path() / "model");
  // Planned for a device of 96 GiB, as for a GPU from a host with less memory than the plan.
  CountingCpuBackend backend(/*as_caching_allocator=*/false, DeviceMemory{uint64_t{96} << 30, uint64_t{96} << 30});
  const ModelPlan model = plan_model(temp.path() / "model", Device::CPU, true);
  // 32 sequences of 8,192 tokens: 64 GiB of cache beside 15 GiB of weights.
  const MemoryRequest request{32, 8192, 256};
  const uint64_t mapped_before = mapped_bytes();
  const MemoryPlan plan = plan_memory(model, backend, std::nullopt, request);
  EXPECT_LT(mapped_bytes() - mapped_before, uint64_t{256} << 20) << "the dry run mapped memory of the planned size";
  EXPECT_EQ(backend.live(), 0u);
  EXPECT_TRUE(plan.steps_planned);
  EXPECT_TRUE(plan.fits()) << describe_memory_plan(plan, "cpu");
  EXPECT_GT(plan.total(), uint64_t{80} << 30);
  // 32 layers x K and V x 32 x 8,192 x 8 heads x 128 x f32, the engine's scratch block (64 positions
  // of each layer's K and V) and the block table: 32 slots x 128 I32 entries of 64 positions.
  EXPECT_EQ(plan.cache, (uint64_t{64} << 30) + uint64_t{32} * 2 * 64 * 8 * 128 * 4 + 32 * 128 * 4);
  EXPECT_EQ(plan.step_tokens, 32 * 256);
  EXPECT_GT(plan.step_scratch, 0u);
}

TEST(MemoryPlan, FourBitWeightsCountTheirPackedBytes) {
  TempDir temp;
  const uint64_t bf16_bytes = write_sparse_checkpoint("llama-3.1-8b", temp.path() / "bf16");
  const uint64_t packed_bytes = write_sparse_checkpoint("llama-3.1-8b", temp.path() / "q4", 4);
  // 4 bits per weight plus a BF16 scale and bias per 64: 0.5625 of 2 bytes, norms aside.
  EXPECT_NEAR(static_cast<double>(packed_bytes) / static_cast<double>(bf16_bytes), 0.5625 / 2, 0.005);
  // A 12 GiB device: the 8B fits in 4 bits and not in BF16.
  CountingCpuBackend backend(/*as_caching_allocator=*/false, DeviceMemory{uint64_t{12} << 30, uint64_t{12} << 30});
  const MemoryRequest request{1, 4096, 256};
  const MemoryPlan bf16 = plan_memory(plan_model(temp.path() / "bf16", Device::CPU, true), backend, std::nullopt, request);
  const MemoryPlan q4 = plan_memory(plan_model(temp.path() / "q4", Device::CPU, true), backend, std::nullopt, request);
  // What construction holds beside the checkpoint's tensors (rotary tables) is the same for both.
  EXPECT_GE(bf16.weights, bf16_bytes);
  EXPECT_EQ(q4.weights - packed_bytes, bf16.weights - bf16_bytes);
  EXPECT_FALSE(bf16.fits()) << describe_memory_plan(bf16, "cpu");
  EXPECT_TRUE(q4.fits()) << describe_memory_plan(q4, "cpu");
}

TEST(MemoryPlan, TheVerdictAndTheLongestContextFollowFromTheParts) {
  auto backend = make_cpu_backend();
  const ModelPlan model = plan_model(fixtures_dir() / "qwen3-tiny/bf16", Device::CPU, true);
  const MemoryPlan small = plan_memory(model, *backend, std::nullopt, {2, 512, 256});
  EXPECT_TRUE(small.fits()) << describe_memory_plan(small, "cpu");
  EXPECT_NE(describe_memory_plan(small, "cpu").find("fits: 2 sequences of 512 tokens"), std::string::npos);

  // A context no machine holds: the cache alone is beyond the memory available.
  const MemoryRequest huge{4, int64_t{1} << 40, 256};
  const MemoryPlan too_big = plan_memory(model, *backend, std::nullopt, huge);
  EXPECT_FALSE(too_big.fits());
  EXPECT_GT(too_big.cache, too_big.memory.available);
  // Beyond the memory whatever its steps take: they are not dry-run, and the shortfall is a floor.
  EXPECT_FALSE(too_big.steps_planned);
  EXPECT_EQ(too_big.step_scratch, 0u);
  EXPECT_NE(describe_memory_plan(too_big, "cpu").find("not planned"), std::string::npos);
  EXPECT_NE(describe_memory_plan(too_big, "cpu").find("does not fit: at least"), std::string::npos);
  const int64_t longest = longest_fitting_context(model, *backend, std::nullopt, too_big);
  ASSERT_GT(longest, 0);
  // Judged against the memory too_big was judged by (what is available moves between readings).
  MemoryRequest at = huge;
  at.context = longest;
  EXPECT_LE(plan_memory(model, *backend, std::nullopt, at).total(), too_big.memory.available);
  at.context = longest + 1;
  EXPECT_GT(plan_memory(model, *backend, std::nullopt, at).total(), too_big.memory.available);
  // The cache grows linearly with the sequences (beside the engine's one scratch block): two more
  // cost the same wherever they are added.
  const MemoryPlan doubled = plan_memory(model, *backend, std::nullopt, {4, 512, 256});
  const MemoryPlan tripled = plan_memory(model, *backend, std::nullopt, {6, 512, 256});
  EXPECT_EQ(tripled.cache - doubled.cache, doubled.cache - small.cache);
}

// A pool smaller than every sequence's whole context (--kv-cache-tokens): the cache is the pool's
// blocks and the scratch block, whatever the sequences, and the verdict says they share it.
TEST(MemoryPlan, ASharedKvPoolIsPlannedAtItsOwnSize) {
  auto backend = make_cpu_backend();
  const ModelPlan model = plan_model(fixtures_dir() / "qwen3-tiny/bf16", Device::CPU, true);
  MemoryRequest pooled{8, 512, 256};
  pooled.kv_blocks = 16;  // two whole contexts
  MemoryRequest more = pooled;
  more.sequences = 16;
  const MemoryPlan plan = plan_memory(model, *backend, std::nullopt, pooled);
  const MemoryPlan plan_more = plan_memory(model, *backend, std::nullopt, more);
  const MemoryPlan whole = plan_memory(model, *backend, std::nullopt, {8, 512, 256});
  EXPECT_LT(plan.cache, whole.cache);
  // Only the block table grows with the sequences: 8 more slots of 8 I32 entries.
  EXPECT_EQ(plan_more.cache - plan.cache, 8u * 8 * 4);
  const std::string text = describe_memory_plan(plan, "cpu");
  EXPECT_NE(text.find("16 blocks of 64 tokens: 1024 tokens, 2 sequences of the whole 512-token context"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("fits: 8 sequences of up to 512 tokens, sharing 1024 KV positions"), std::string::npos) << text;
}

// --memory-share: the pool takes what the rest of the plan leaves of that share of the device, to
// the block (a block more would not fit), and a share that cannot hold one context is refused.
TEST(MemoryPlan, AMemoryShareGivesThePoolWhatTheRestLeaves) {
  TempDir temp;
  write_sparse_checkpoint("llama-3.1-8b", temp.path() / "model");
  CountingCpuBackend backend(/*as_caching_allocator=*/false, DeviceMemory{uint64_t{96} << 30, uint64_t{96} << 30});
  const ModelPlan model = plan_model(temp.path() / "model", Device::CPU, true);
  MemoryRequest request{8, 8192, 256};
  request.kv_blocks = kv_blocks_for_memory_share(model, backend, std::nullopt, request, 0.5);
  const MemoryPlan plan = plan_memory(model, backend, std::nullopt, request);
  EXPECT_LE(plan.total(), uint64_t{48} << 30) << describe_memory_plan(plan, "cpu");
  // 32 layers x K and V x 64 positions x 8 heads x 128 x f32: 8 MiB a block.
  const uint64_t block_bytes = uint64_t{32} * 2 * 64 * 8 * 128 * 4;
  EXPECT_GT(plan.total() + block_bytes, uint64_t{48} << 30) << describe_memory_plan(plan, "cpu");
  // 15 GiB of weights leave room for more blocks than the 8 sequences' whole contexts (1,024).
  EXPECT_GT(request.kv_blocks, 8 * 128);
  EXPECT_NE(describe_memory_plan(plan, "cpu")
                .find(fmt::format("fits: 8 sequences of 8192 tokens, with {} KV positions", request.kv_blocks * 64)),
            std::string::npos)
      << describe_memory_plan(plan, "cpu");
  EXPECT_FAILS_MENTIONING(kv_blocks_for_memory_share(model, backend, std::nullopt, request, 0.1),
                          "more than the memory share's");
  EXPECT_FAILS_MENTIONING(kv_blocks_for_memory_share(model, backend, std::nullopt, request, 1.5),
                          "the memory share must be above 0 and at most 1");
}

TEST(MemoryPlan, ABadRequestIsAnError) {
  auto backend = make_cpu_backend();
  const ModelPlan model = plan_model(fixtures_dir() / "qwen3-tiny/bf16", Device::CPU, true);
  EXPECT_FAILS_MENTIONING(plan_memory(model, *backend, std::nullopt, {0, 64, 64}), "at least one sequence");
  EXPECT_FAILS_MENTIONING(plan_memory(model, *backend, std::nullopt, {1, 0, 64}), "context");
  EXPECT_FAILS_MENTIONING(plan_memory(model, *backend, std::nullopt, {1, 64, 0}), "prefill chunk must be positive");
}

}  // namespace
