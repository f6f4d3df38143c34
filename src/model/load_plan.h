// A checkpoint load plan: how the tensors of an artifact map onto a graph's canonical names.
//
// A family's sanitizer computes the plan from tensor names and shapes alone (no byte is read),
// so `kiln inspect` can show it and resolution can validate it before loading. Materialising a
// plan gives a WeightMap: zero-copy views where no fix-up applies, fixed-up copies otherwise.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "core/weight.h"
#include "io/safetensors.h"

namespace kiln {

enum class FixUp {
  ConvToChannelsKernel,  // conv1d weight [C, 1, K] → [C, K] (drops the unit axis; a view)
  ConvFromKernelLast,    // conv1d weight [C, K, 1] → [C, K] (a view)
  SubtractOne,           // a stored 1 + γ gain → the canonical zero-centred γ (computed in f32)
  GatherRows,            // the source's `row_blocks` (axis 0) concatenated in order (a copy)
  StackExperts,          // the `stacked_sources` (one per expert, equal shapes and dtypes) stacked
                         // along a new axis 0 (a copy); first when present
  GatherExpertRows,      // of an [E, R, …] tensor, each expert's `row_blocks` along axis 1 (a copy)
};

// Rows [first_row, first_row + rows) along a source tensor's axis 0.
struct RowBlock {
  int64_t first_row = 0;
  int64_t rows = 0;
};

// A planned tensor that holds a quantized matrix's values (core/weight.h): how they decode and
// the canonical names of the matrix's other parts, planned beside it.
struct QuantizedParts {
  WeightFormat format = WeightFormat::Affine;
  int bits = 0, group_size = 0;           // Affine
  int block_rows = 0, block_columns = 0;  // Fp8Block
  std::string scales;                     // canonical name of the scales (FP8: weight_scale_inv)
  std::string biases;                     // Affine: canonical name of the biases
};

// A part of an AWQ or GPTQ matrix computed at materialisation from the matrix's stored tensors
// (several of them), in the Affine layout of core/weight.h, so every backend runs it through the
// MLX kernels. The stored tensors (K inputs, N outputs, G the group size):
//   AWQ (GEMM)  qweight I32 [K, N·bits/32]  codes packed along N, each word's codes in the order
//                                           [0, 2, 4, 6, 1, 3, 5, 7] (AutoAWQ's AWQ_ORDER)
//               qzeros  I32 [K/G, N·bits/32] zeros, packed as qweight
//   GPTQ        qweight I32 [K·bits/32, N]  codes packed along K, in order
//               qzeros  I32 [K/G, N·bits/32] zeros − 1 (the v1 convention), packed along N in order
//   both        scales  F16/BF16 [K/G, N]
// and w[n, k] = scale · (q − zero). The parts (each [N, …], row n the output n):
//   Codes   U32 [N, K·bits/32]  each row's codes as one bit stream
//   Scales  F32 [N, K/G]        the stored scales, widened (exact)
//   Biases  F32 [N, K/G]        −scale · zero, exact: an 11-bit significand times a zero below 2^9
//                               fits f32's 24 bits, so fma(scale, q, bias) is exactly scale·(q − zero)
// (F32 rather than the stored F16: −scale · zero does not fit F16 in general.)
struct AffineRepack {
  enum class Packing { Awq, Gptq };
  enum class Part { Codes, Scales, Biases };
  Packing packing = Packing::Awq;
  Part part = Part::Codes;
  int bits = 0, group_size = 0;
  std::string qweight, qzeros, scales;  // the checkpoint names of the matrix's stored tensors
};

// "awq codes", "gptq biases", … (LoadPlan::to_json, errors).
std::string repack_name(const AffineRepack& repack);

struct PlannedTensor {
  std::string canonical;  // the name the graph asks for
  std::string source;     // the name in the checkpoint (a repacked part: the stored tensor it mainly reads)
  std::vector<FixUp> fixups;
  std::vector<int64_t> canonical_shape;
  std::vector<RowBlock> row_blocks = {};  // for FixUp::GatherRows and GatherExpertRows (defaulted: older initialisers stay valid)
  std::optional<QuantizedParts> quantized = std::nullopt;  // set by plan_checkpoint (model/quantized_checkpoint.h)
  // Set for an AWQ or GPTQ matrix's part: computed from its stored tensors, not read from `source`.
  std::optional<AffineRepack> repack = std::nullopt;
  // For FixUp::StackExperts: the tensors stacked, in order (`source` is the first).
  std::vector<std::string> stacked_sources = {};

  // Every checkpoint tensor this planned tensor reads.
  std::vector<std::string> sources() const;
  // Its dtype once materialised, before any conversion: a repacked part's own, F32 after a
  // SubtractOne fix-up, else the stored one.
  DType materialised_dtype(DType stored) const;
};

struct DroppedTensor {
  std::string source;
  std::string reason;  // e.g. "vision tower (text graph)", "multi-token-prediction head"
};

// The fix-up's name in LoadPlan::to_json, e.g. "subtract_one".
const char* fixup_name(FixUp fixup);

struct LoadPlan {
  std::vector<PlannedTensor> tensors;
  std::vector<DroppedTensor> dropped;
  std::vector<std::string> notes;  // whole-map decisions, e.g. "norm gains stored as 1+γ: shifted"

  nlohmann::json to_json() const;
};

// The part of a tensor one tensor-parallel rank holds (model/tensor_parallel.h decides which).
struct TensorShard {
  enum class Axis { Whole, Rows, Columns };
  Axis axis = Axis::Whole;
  std::vector<RowBlock> row_blocks = {};  // Axis::Rows: blocks along axis 0, concatenated in order
  int64_t first_column = 0;               // Axis::Columns: columns [first_column, first_column +
  int64_t columns = 0;                    //   columns) of a matrix [rows, cols]
};
using ShardRule = std::function<TensorShard(const std::string& canonical, const Shape& shape)>;

// How far a load has come. A tensor counts as done once the model's construction has taken it (a
// GPU backend uploads each tensor right after taking it); bytes are the tensors' as held once
// loaded (after --dtype conversion and a rank's shard).
struct LoadProgress {
  int64_t tensors_done = 0;
  int64_t tensors_total = 0;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
};
// Called on the loading thread; it must not throw.
using LoadProgressCallback = std::function<void(const LoadProgress& progress)>;

// The canonical weights of one model, with use tracking: the graph takes each tensor it needs
// (shape-checked), and construction fails when the checkpoint holds tensors nobody took.
class WeightMap {
 public:
  WeightMap(const Checkpoint& checkpoint, const LoadPlan& plan);
  // The map `plan` describes, with no byte read: every tensor in its canonical shape and in the
  // dtype construction sees (F32 after a SubtractOne fix-up; `dtype` for every tensor when given,
  // as convert_to makes it) but with no storage (Tensor::unbacked), for a dry run of the model's
  // construction on the measuring backend (engine/memory_plan.h).
  static WeightMap shapes_only(const Checkpoint& checkpoint, const LoadPlan& plan, std::optional<DType> dtype);
  // Converts every tensor to the floating-point `dtype` (F32, F16 or BF16) before the graph takes
  // any (`--dtype`): widening is exact, narrowing rounds to nearest even. Tensors already in it
  // stay views of the checkpoint.
  void convert_to(DType dtype);
  // Keeps of every tensor only the part `shard_of` assigns to this rank (call it before
  // convert_to, so that only the shard is converted): a single row block stays a zero-copy view of
  // the mapped file; several row blocks or a column range are copied, reading only their bytes.
  void shard(const ShardRule& shard_of);
  // Reports every tensor the graph takes from now on to `on_progress` (call it after convert_to
  // and shard, whose tensors it counts).
  void report_progress(LoadProgressCallback on_progress);
  // The bytes of every planned tensor as held now (a shapes_only map: as they will be held).
  uint64_t bytes() const;

  bool contains(const std::string& canonical) const { return tensors_.count(canonical) != 0; }
  // The tensor, checked against `shape`; marks it used. Errors name the checkpoint tensor.
  Tensor take(const std::string& canonical, const Shape& shape);
  // A matmul or embedding matrix: dense as take gives it, or, when the plan marks it quantized,
  // the Weight its planned parts make, checked against the logical `shape`; marks every part used.
  Weight take_weight(const std::string& canonical, const Shape& shape);
  // A stack of `shape[0]` matrices [E, N, K] (a mixture's experts), dense or quantized as
  // take_weight gives them, as one Weight of [E · N, K] whose rows e·N … e·N + N − 1 are expert
  // e's (Weight::rows). An FP8 stack needs N to fill whole blocks of rows.
  Weight take_stacked_weight(const std::string& canonical, const Shape& shape);
  // The source name of a canonical tensor (for error messages).
  const std::string& source_name(const std::string& canonical) const;
  // Fails naming every planned tensor that no graph code took, and every checkpoint tensor the
  // plan neither maps nor drops.
  void require_all_used() const;

 private:
  // Checks the plan against the checkpoint and keeps what `materialise` makes of each planned tensor.
  using Materialise = std::function<Tensor(const PlannedTensor& planned, const TensorInfo& info)>;
  WeightMap(const Checkpoint& checkpoint, const LoadPlan& plan, const Materialise& materialise);
  // Marks a tensor used, reporting it the first time.
  void mark_used(const std::string& canonical);

  std::map<std::string, Tensor> tensors_;
  std::map<std::string, QuantizedParts> quantized_;  // canonical values tensor → its layout
  std::set<std::string> quantized_parts_;            // every canonical name of a quantized matrix's parts
  std::map<std::string, std::string> sources_;
  std::map<std::string, std::filesystem::path> source_files_;  // canonical → the file holding it
  std::vector<std::string> unplanned_;  // "'name' in <file>" for tensors the plan ignores
  std::set<std::string> used_;
  std::string checkpoint_name_;
  LoadProgressCallback on_progress_;
  LoadProgress progress_;
};

// The identity plan (every tensor under its own name), for checkpoints already in canonical form.
LoadPlan identity_plan(const Checkpoint& checkpoint);

}  // namespace kiln
