#include "model/load_plan.h"

#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln {
namespace {

// How many tensor names one error line lists before it only counts the rest.
constexpr size_t kNamesListed = 20;

float stored_value_as_f32(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::F32: return tensor.data<const float>()[index];
    case DType::F16: return f16_to_f32(tensor.data<const uint16_t>()[index]);
    case DType::BF16: return bf16_to_f32(tensor.data<const uint16_t>()[index]);
    default: break;
  }
  fail("subtract-one fix-up of a {} tensor", dtype_name(tensor.dtype()));
}

// A stored 1 + γ gain as the zero-centred γ in f32. Widening F16/BF16/F32 to f32 is exact, so the
// one f32 subtraction is the only rounding: the result is the correctly rounded stored − 1.
Tensor subtract_one(const Tensor& stored) {
  Tensor shifted = Tensor::empty(stored.shape(), DType::F32);
  float* out = shifted.data<float>();
  for (int64_t index = 0; index < stored.numel(); ++index) out[index] = stored_value_as_f32(stored, index) - 1.0f;
  return shifted;
}

std::string listed(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(names.size(), kNamesListed));
  std::string text = fmt::format("{}", fmt::join(shown, ", "));
  if (names.size() > shown.size()) text += fmt::format(" and {} more", names.size() - shown.size());
  return text;
}

// The source's row blocks (axis 0) concatenated in order: a copy in the stored dtype.
Tensor gather_rows(const Tensor& source, const std::vector<RowBlock>& blocks, const std::string& file,
                   const std::string& name) {
  if (source.ndim() < 1) fail("{}: tensor '{}': cannot gather rows of a scalar", file, name);
  const int64_t row_bytes = source.dim(0) ? static_cast<int64_t>(source.nbytes()) / source.dim(0) : 0;
  int64_t total_rows = 0;
  for (const RowBlock& block : blocks) {
    if (block.first_row < 0 || block.rows < 0 || block.first_row + block.rows > source.dim(0))
      fail("{}: tensor '{}': row block [{}, {}) is outside its {} rows", file, name, block.first_row,
           block.first_row + block.rows, source.dim(0));
    total_rows += block.rows;
  }
  Shape shape = source.shape();
  shape[0] = total_rows;
  Tensor gathered = Tensor::empty(shape, source.dtype());
  char* out = static_cast<char*>(gathered.raw());
  for (const RowBlock& block : blocks) {
    std::memcpy(out, static_cast<const char*>(source.raw()) + block.first_row * row_bytes, block.rows * row_bytes);
    out += block.rows * row_bytes;
  }
  return gathered;
}

// The tensors stacked along a new axis 0 (a copy); each must have the first one's shape and dtype.
Tensor stack_experts(const Checkpoint& checkpoint, const PlannedTensor& planned, const std::string& file) {
  if (planned.stacked_sources.empty()) fail("{}: tensor '{}': the stack fix-up names no tensors", file, planned.source);
  const Tensor first = checkpoint.view(planned.stacked_sources.front());
  Shape shape = first.shape();
  shape.insert(shape.begin(), static_cast<int64_t>(planned.stacked_sources.size()));
  Tensor stacked = Tensor::empty(shape, first.dtype());
  char* out = static_cast<char*>(stacked.raw());
  for (const std::string& name : planned.stacked_sources) {
    const Tensor part = checkpoint.view(name);
    if (part.shape() != first.shape() || part.dtype() != first.dtype())
      fail("{}: tensor '{}' is {} {}, but '{}' stacked with it is {} {}", checkpoint.info(name).file.string(), name,
           dtype_name(part.dtype()), shape_string(part.shape()), planned.stacked_sources.front(),
           dtype_name(first.dtype()), shape_string(first.shape()));
    std::memcpy(out, part.raw(), part.nbytes());
    out += part.nbytes();
  }
  return stacked;
}

// Of an [E, R, …] tensor, each expert's row blocks along axis 1, concatenated (a copy).
Tensor gather_expert_rows(const Tensor& source, const std::vector<RowBlock>& blocks, const std::string& file,
                          const std::string& name) {
  if (source.ndim() < 2) fail("{}: tensor '{}': {} is not a stack of matrices", file, name, shape_string(source.shape()));
  const int64_t experts = source.dim(0);
  std::vector<Tensor> gathered;
  for (int64_t expert = 0; expert < experts; ++expert) {
    const Tensor matrix = source.slice_rows(expert, 1);
    Shape inner(matrix.shape().begin() + 1, matrix.shape().end());
    gathered.push_back(gather_rows(matrix.reshape(inner), blocks, file, name));
  }
  Shape shape = gathered.front().shape();
  shape.insert(shape.begin(), experts);
  Tensor out = Tensor::empty(shape, source.dtype());
  char* cursor = static_cast<char*>(out.raw());
  for (const Tensor& part : gathered) {
    std::memcpy(cursor, part.raw(), part.nbytes());
    cursor += part.nbytes();
  }
  return out;
}

// Columns [first, first + count) of a matrix: a copy that reads only those bytes of each row.
Tensor copy_columns(const Tensor& source, int64_t first, int64_t count, const std::string& file,
                    const std::string& name) {
  if (source.ndim() != 2) fail("{}: tensor '{}': only a matrix can be split by columns, not {}", file, name, shape_string(source.shape()));
  if (first < 0 || count < 0 || first + count > source.dim(1))
    fail("{}: tensor '{}': column range [{}, {}) is outside its {} columns", file, name, first, first + count,
         source.dim(1));
  const size_t element = dtype_size(source.dtype());
  Tensor copied = Tensor::empty({source.dim(0), count}, source.dtype());
  const char* in = static_cast<const char*>(source.raw());
  char* out = static_cast<char*>(copied.raw());
  for (int64_t row = 0; row < source.dim(0); ++row)
    std::memcpy(out + row * count * element, in + (row * source.dim(1) + first) * element, count * element);
  return copied;
}

// A planned tensor read from the checkpoint and fixed up.
Tensor read_fixed_up(const Checkpoint& checkpoint, const PlannedTensor& planned, const TensorInfo& info) {
  const std::string file = info.file.string();
  Tensor tensor = checkpoint.view(planned.source);
  for (FixUp fixup : planned.fixups) {
    switch (fixup) {
      case FixUp::StackExperts:
        tensor = stack_experts(checkpoint, planned, file);
        break;
      case FixUp::GatherExpertRows:
        tensor = gather_expert_rows(tensor, planned.row_blocks, file, planned.source);
        break;
      case FixUp::ConvToChannelsKernel:
        if (tensor.ndim() != 3 || tensor.dim(1) != 1)
          fail("{}: tensor '{}': conv weight shape {} is not [channels, 1, kernel]", file, planned.source,
               shape_string(tensor.shape()));
        tensor = tensor.reshape({tensor.dim(0), tensor.dim(2)});
        break;
      case FixUp::ConvFromKernelLast:
        if (tensor.ndim() != 3 || tensor.dim(2) != 1)
          fail("{}: tensor '{}': conv weight shape {} is not [channels, kernel, 1]", file, planned.source,
               shape_string(tensor.shape()));
        tensor = tensor.reshape({tensor.dim(0), tensor.dim(1)});
        break;
      case FixUp::SubtractOne:
        tensor = subtract_one(tensor);
        break;
      case FixUp::GatherRows:
        tensor = gather_rows(tensor, planned.row_blocks, file, planned.source);
        break;
    }
  }
  if (tensor.shape() != planned.canonical_shape)
    fail("{}: tensor '{}': the load plan expects shape {} for '{}' but fixed up it is {}", file, planned.source,
         shape_string(planned.canonical_shape), planned.canonical, shape_string(tensor.shape()));
  return tensor;
}

// AutoAWQ's AWQ_REVERSE_ORDER (awq/utils/packing_utils.py): output m of a group of eight sits in
// slot kAwqSlot[m] of its word (the inverse of the packing order [0, 2, 4, 6, 1, 3, 5, 7]).
constexpr int kAwqSlot[8] = {0, 4, 1, 5, 2, 6, 3, 7};

// The `bits`-bit field `slot` of a stored I32 word.
uint32_t field(int32_t word, int slot, int bits) {
  return (static_cast<uint32_t>(word) >> (slot * bits)) & ((1u << bits) - 1u);
}

// The zero point of output n in group g (its real value: GPTQ stores it minus one; auto_gptq's
// dequantization masks the stored field, then adds one).
uint32_t zero_point(const AffineRepack& repack, const Tensor& qzeros, int64_t group, int64_t n) {
  const int per_word = 32 / repack.bits;
  const int32_t word = qzeros.data<const int32_t>()[group * qzeros.dim(1) + n / per_word];
  if (repack.packing == AffineRepack::Packing::Awq) return field(word, kAwqSlot[n % per_word], repack.bits);
  return field(word, static_cast<int>(n % per_word), repack.bits) + 1;
}

// An AWQ or GPTQ matrix's part in the Affine layout (AffineRepack in load_plan.h). The plan
// (model/quantized_checkpoint.cpp) has checked every stored shape and dtype.
Tensor repack_affine(const Checkpoint& checkpoint, const PlannedTensor& planned) {
  const AffineRepack& repack = *planned.repack;
  const bool awq = repack.packing == AffineRepack::Packing::Awq;
  const int per_word = 32 / repack.bits;
  const Tensor scales = checkpoint.view(repack.scales);
  const int64_t groups = scales.dim(0), outputs = scales.dim(1);
  const int64_t inputs = groups * repack.group_size;
  auto scale_at = [&](int64_t group, int64_t n) {
    const uint16_t stored = scales.data<const uint16_t>()[group * outputs + n];
    return scales.dtype() == DType::F16 ? f16_to_f32(stored) : bf16_to_f32(stored);
  };
  Tensor out;
  switch (repack.part) {
    case AffineRepack::Part::Codes: {
      const Tensor qweight = checkpoint.view(repack.qweight);
      const int32_t* words = qweight.data<const int32_t>();
      const int64_t row_words = inputs / per_word;
      out = Tensor::zeros({outputs, row_words}, DType::U32);
      uint32_t* codes = out.data<uint32_t>();
      ThreadPool::global().parallel_for(outputs, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          uint32_t* row = codes + n * row_words;
          for (int64_t k = 0; k < inputs; ++k) {
            const uint32_t code =
                awq ? field(words[k * qweight.dim(1) + n / per_word], kAwqSlot[n % per_word], repack.bits)
                    : field(words[(k / per_word) * outputs + n], static_cast<int>(k % per_word), repack.bits);
            row[k / per_word] |= code << ((k % per_word) * repack.bits);
          }
        }
      });
      break;
    }
    case AffineRepack::Part::Scales:
    case AffineRepack::Part::Biases: {
      const bool biases = repack.part == AffineRepack::Part::Biases;
      const Tensor qzeros = biases ? checkpoint.view(repack.qzeros) : Tensor();
      out = Tensor::empty({outputs, groups}, DType::F32);
      float* values = out.data<float>();
      for (int64_t n = 0; n < outputs; ++n)
        for (int64_t group = 0; group < groups; ++group) {
          const float scale = scale_at(group, n);
          values[n * groups + group] = biases ? -scale * static_cast<float>(zero_point(repack, qzeros, group, n)) : scale;
        }
      break;
    }
  }
  if (out.shape() != planned.canonical_shape)
    fail("tensor '{}': the load plan expects shape {} for '{}' but repacked it is {}", planned.source,
         shape_string(planned.canonical_shape), planned.canonical, shape_string(out.shape()));
  return out;
}

}  // namespace

std::string repack_name(const AffineRepack& repack) {
  const char* packing = repack.packing == AffineRepack::Packing::Awq ? "awq" : "gptq";
  switch (repack.part) {
    case AffineRepack::Part::Codes: return fmt::format("{} codes", packing);
    case AffineRepack::Part::Scales: return fmt::format("{} scales", packing);
    case AffineRepack::Part::Biases: return fmt::format("{} zeros as biases", packing);
  }
  return "?";
}

std::vector<std::string> PlannedTensor::sources() const {
  if (!stacked_sources.empty()) return stacked_sources;
  if (!repack) return {source};
  switch (repack->part) {
    case AffineRepack::Part::Codes: return {repack->qweight};
    case AffineRepack::Part::Scales: return {repack->scales};
    case AffineRepack::Part::Biases: return {repack->qzeros, repack->scales};
  }
  return {source};
}

DType PlannedTensor::materialised_dtype(DType stored) const {
  if (repack) return repack->part == AffineRepack::Part::Codes ? DType::U32 : DType::F32;
  for (FixUp fixup : fixups)
    if (fixup == FixUp::SubtractOne) return DType::F32;
  return stored;
}

const char* fixup_name(FixUp fixup) {
  switch (fixup) {
    case FixUp::ConvToChannelsKernel: return "conv_to_channels_kernel";
    case FixUp::ConvFromKernelLast: return "conv_from_kernel_last";
    case FixUp::SubtractOne: return "subtract_one";
    case FixUp::GatherRows: return "gather_rows";
    case FixUp::StackExperts: return "stack_experts";
    case FixUp::GatherExpertRows: return "gather_expert_rows";
  }
  return "?";
}

nlohmann::json LoadPlan::to_json() const {
  nlohmann::json planned = nlohmann::json::array();
  for (const PlannedTensor& tensor : tensors) {
    nlohmann::json fixup_names = nlohmann::json::array();
    for (FixUp fixup : tensor.fixups) fixup_names.push_back(fixup_name(fixup));
    planned.push_back({{"canonical", tensor.canonical},
                       {"source", tensor.source},
                       {"fixups", fixup_names},
                       {"canonical_shape", tensor.canonical_shape}});
    if (!tensor.row_blocks.empty()) {
      nlohmann::json blocks = nlohmann::json::array();
      for (const RowBlock& block : tensor.row_blocks) blocks.push_back({block.first_row, block.rows});
      planned.back()["row_blocks"] = blocks;
    }
    if (tensor.repack) planned.back()["repack"] = repack_name(*tensor.repack);
    if (tensor.repack || !tensor.stacked_sources.empty()) planned.back()["sources"] = tensor.sources();
  }
  nlohmann::json dropped_json = nlohmann::json::array();
  for (const DroppedTensor& tensor : dropped)
    dropped_json.push_back({{"source", tensor.source}, {"reason", tensor.reason}});
  return {{"tensors", planned}, {"dropped", dropped_json}, {"notes", notes}};
}

WeightMap::WeightMap(const Checkpoint& checkpoint, const LoadPlan& plan)
    : WeightMap(checkpoint, plan, [&checkpoint](const PlannedTensor& planned, const TensorInfo& info) {
        return planned.repack ? repack_affine(checkpoint, planned) : read_fixed_up(checkpoint, planned, info);
      }) {}

WeightMap WeightMap::shapes_only(const Checkpoint& checkpoint, const LoadPlan& plan, std::optional<DType> dtype) {
  const std::string name = checkpoint.location().string();
  if (dtype == DType::I32) fail("{}: weights cannot be converted to {}", name, dtype_name(*dtype));
  std::set<std::string> quantized_parts;
  for (const PlannedTensor& planned : plan.tensors)
    if (planned.quantized)
      quantized_parts.insert({planned.canonical, planned.quantized->scales, planned.quantized->biases});
  return WeightMap(checkpoint, plan, [&](const PlannedTensor& planned, const TensorInfo& info) {
    const DType fixed_up = planned.materialised_dtype(info.dtype);
    // A quantized matrix's parts keep their dtypes (convert_to leaves them as stored).
    if (quantized_parts.count(planned.canonical)) return Tensor::unbacked(planned.canonical_shape, fixed_up);
    if (dtype && !is_float_dtype(fixed_up))
      fail("{}: tensor '{}' is {}, not a floating-point weight to convert to {}", name, planned.source,
           dtype_name(fixed_up), dtype_name(*dtype));
    return Tensor::unbacked(planned.canonical_shape, dtype ? *dtype : fixed_up);
  });
}

WeightMap::WeightMap(const Checkpoint& checkpoint, const LoadPlan& plan, const Materialise& materialise)
    : checkpoint_name_(checkpoint.location().string()) {
  std::set<std::string> covered;
  for (const DroppedTensor& dropped : plan.dropped) {
    if (!checkpoint.contains(dropped.source))
      fail("{}: the load plan drops tensor '{}' ({}), which the checkpoint does not hold", checkpoint_name_,
           dropped.source, dropped.reason);
    covered.insert(dropped.source);
  }
  for (const PlannedTensor& planned : plan.tensors) {
    if (tensors_.count(planned.canonical))
      fail("{}: the load plan maps tensor '{}' twice", checkpoint_name_, planned.canonical);
    for (const std::string& source : planned.sources()) {
      if (!checkpoint.contains(source))
        fail("{}: tensor '{}' (for '{}') is missing from the checkpoint", checkpoint_name_, source, planned.canonical);
      covered.insert(source);
    }
    const TensorInfo& info = checkpoint.info(planned.source);
    tensors_.emplace(planned.canonical, materialise(planned, info));
    if (planned.quantized) {
      quantized_.emplace(planned.canonical, *planned.quantized);
      quantized_parts_.insert({planned.canonical, planned.quantized->scales});
      if (!planned.quantized->biases.empty()) quantized_parts_.insert(planned.quantized->biases);
    }
    sources_.emplace(planned.canonical, planned.source);
    source_files_.emplace(planned.canonical, info.file);
  }
  for (const auto& [name, info] : checkpoint.tensors())
    if (!covered.count(name)) unplanned_.push_back(fmt::format("'{}' in {}", name, info.file.string()));
}

Tensor WeightMap::take(const std::string& canonical, const Shape& shape) {
  auto found = tensors_.find(canonical);
  if (found == tensors_.end())
    fail("{}: tensor '{}' is missing from the checkpoint (the model graph needs it)", checkpoint_name_, canonical);
  if (found->second.shape() != shape)
    fail("{}: tensor '{}': wrong shape: config implies {} but the checkpoint has {}",
         source_files_.at(canonical).string(), sources_.at(canonical), shape_string(shape),
         shape_string(found->second.shape()));
  mark_used(canonical);
  return found->second;
}

Weight WeightMap::take_weight(const std::string& canonical, const Shape& shape) {
  const auto quantized = quantized_.find(canonical);
  if (quantized == quantized_.end()) return Weight(take(canonical, shape));
  const QuantizedParts& parts = quantized->second;
  const std::string where = fmt::format("{}: tensor '{}'", source_files_.at(canonical).string(), sources_.at(canonical));
  auto part = [&](const std::string& name) {
    const auto found = tensors_.find(name);
    if (found == tensors_.end()) fail("{}: its quantization part '{}' is not planned", where, name);
    mark_used(name);
    return found->second;
  };
  Weight weight;
  try {
    weight = parts.format == WeightFormat::Affine
                 ? Weight::affine(part(canonical), part(parts.scales), part(parts.biases), parts.bits, parts.group_size)
                 : Weight::fp8_block(part(canonical), part(parts.scales), parts.block_rows, parts.block_columns);
  } catch (const Error& error) {
    fail("{}: {}", where, error.what());
  }
  if (weight.shape() != shape)
    fail("{}: wrong shape: config implies {} but the checkpoint's {} matrix is {}", where, shape_string(shape),
         weight.describe(), shape_string(weight.shape()));
  return weight;
}

Weight WeightMap::take_stacked_weight(const std::string& canonical, const Shape& shape) {
  if (shape.size() != 3) fail("{}: tensor '{}': a stack of matrices is [E, N, K], not {}", checkpoint_name_, canonical,
                              shape_string(shape));
  const int64_t experts = shape[0], rows = shape[1];
  const auto quantized = quantized_.find(canonical);
  if (quantized == quantized_.end()) return Weight(take(canonical, shape).reshape({experts * rows, shape[2]}));
  const QuantizedParts& parts = quantized->second;
  const std::string where = fmt::format("{}: tensor '{}'", source_files_.at(canonical).string(), sources_.at(canonical));
  auto part = [&](const std::string& name) {
    const auto found = tensors_.find(name);
    if (found == tensors_.end()) fail("{}: its quantization part '{}' is not planned", where, name);
    if (found->second.ndim() != 3 || found->second.dim(0) != experts)
      fail("{}: its part '{}' is {}, not a stack of {} experts", where, name, shape_string(found->second.shape()),
           experts);
    mark_used(name);
    return found->second.reshape({experts * found->second.dim(1), found->second.dim(2)});
  };
  if (parts.format == WeightFormat::Fp8Block && rows % parts.block_rows != 0)
    fail("{}: each expert's {} rows do not fill whole FP8 blocks of {} rows", where, rows, parts.block_rows);
  Weight weight;
  try {
    weight = parts.format == WeightFormat::Affine
                 ? Weight::affine(part(canonical), part(parts.scales), part(parts.biases), parts.bits, parts.group_size)
                 : Weight::fp8_block(part(canonical), part(parts.scales), parts.block_rows, parts.block_columns);
  } catch (const Error& error) {
    fail("{}: {}", where, error.what());
  }
  const Shape flat{experts * rows, shape[2]};
  if (weight.shape() != flat)
    fail("{}: wrong shape: config implies {} but the checkpoint's {} experts are [{}, {}, {}]", where,
         shape_string(shape), weight.describe(), experts, weight.dim(0) / experts, weight.dim(1));
  return weight;
}

void WeightMap::report_progress(LoadProgressCallback on_progress) {
  on_progress_ = std::move(on_progress);
  progress_ = {0, static_cast<int64_t>(tensors_.size()), 0, bytes()};
}

uint64_t WeightMap::bytes() const {
  uint64_t total = 0;
  for (const auto& [canonical, tensor] : tensors_) total += tensor.nbytes();
  return total;
}

void WeightMap::mark_used(const std::string& canonical) {
  if (!used_.insert(canonical).second || !on_progress_) return;
  ++progress_.tensors_done;
  progress_.bytes_done += tensors_.at(canonical).nbytes();
  on_progress_(progress_);
}

const std::string& WeightMap::source_name(const std::string& canonical) const {
  auto found = sources_.find(canonical);
  if (found == sources_.end()) fail("{}: no planned tensor '{}'", checkpoint_name_, canonical);
  return found->second;
}

void WeightMap::require_all_used() const {
  std::vector<std::string> unused;
  for (const auto& [canonical, source] : sources_)
    if (!used_.count(canonical))
      unused.push_back(fmt::format("'{}' in {}", source, source_files_.at(canonical).string()));
  if (!unused.empty())
    fail("{}: {} checkpoint tensor(s) that the model graph never used: {}", checkpoint_name_, unused.size(),
         listed(unused));
  if (!unplanned_.empty())
    fail("{}: {} checkpoint tensor(s) that the load plan neither maps nor drops: {}", checkpoint_name_,
         unplanned_.size(), listed(unplanned_));
}

void WeightMap::shard(const ShardRule& shard_of) {
  for (auto& [canonical, tensor] : tensors_) {
    const TensorShard shard = shard_of(canonical, tensor.shape());
    const std::string file = source_files_.at(canonical).string();
    const std::string& source = sources_.at(canonical);
    switch (shard.axis) {
      case TensorShard::Axis::Whole:
        break;
      case TensorShard::Axis::Rows:
        if (shard.row_blocks.size() == 1) {
          const RowBlock& block = shard.row_blocks.front();
          if (tensor.ndim() < 1 || block.first_row < 0 || block.rows < 0 || block.first_row + block.rows > tensor.dim(0))
            fail("{}: tensor '{}': row block [{}, {}) is outside its shape {}", file, source, block.first_row,
                 block.first_row + block.rows, shape_string(tensor.shape()));
          tensor = tensor.slice_rows(block.first_row, block.rows);
        } else {
          tensor = gather_rows(tensor, shard.row_blocks, file, source);
        }
        break;
      case TensorShard::Axis::Columns:
        tensor = copy_columns(tensor, shard.first_column, shard.columns, file, source);
        break;
    }
  }
}

void WeightMap::convert_to(DType dtype) {
  if (dtype == DType::I32) fail("{}: weights cannot be converted to {}", checkpoint_name_, dtype_name(dtype));
  for (auto& [canonical, tensor] : tensors_) {
    // A quantized matrix keeps its parts as stored: its values are codes, and its scales are part
    // of what the codes mean.
    if (tensor.dtype() == dtype || quantized_parts_.count(canonical)) continue;
    if (!is_float_dtype(tensor.dtype()))
      fail("{}: tensor '{}' is {}, not a floating-point weight to convert to {}", checkpoint_name_,
           sources_.at(canonical), dtype_name(tensor.dtype()), dtype_name(dtype));
    const Tensor stored = tensor;
    Tensor converted = Tensor::empty(stored.shape(), dtype);
    // Widening F16/BF16 to f32 is exact, so each element is rounded once, from its stored value.
    ThreadPool::global().parallel_for(stored.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        const float value = stored_value_as_f32(stored, index);
        if (dtype == DType::F32) converted.data<float>()[index] = value;
        else if (dtype == DType::F16) converted.data<uint16_t>()[index] = f32_to_f16(value);
        else converted.data<uint16_t>()[index] = f32_to_bf16(value);
      }
    });
    tensor = std::move(converted);
  }
}

LoadPlan identity_plan(const Checkpoint& checkpoint) {
  LoadPlan plan;
  for (const auto& [name, info] : checkpoint.tensors()) plan.tensors.push_back({name, name, {}, info.shape});
  return plan;
}

}  // namespace kiln
