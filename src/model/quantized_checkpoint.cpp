#include "model/quantized_checkpoint.h"

#include <map>
#include <set>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string where(const TensorInfo& info) { return fmt::format("{}: tensor '{}'", info.file.string(), info.name); }

// A module's tensor name without `suffix`, or "" when it does not end so.
std::string module_of(const std::string& name, std::string_view suffix) {
  return name.size() > suffix.size() && name.ends_with(suffix) ? name.substr(0, name.size() - suffix.size()) : "";
}

// A quantized matrix found in the checkpoint, by the source name of its values tensor.
struct SourceMatrix {
  QuantizedParts layout;  // scales/biases hold source names here
  Shape logical;          // [N, K]
};

bool is_scale_dtype(DType dtype, bool f16_allowed) {
  return dtype == DType::F32 || dtype == DType::BF16 || (f16_allowed && dtype == DType::F16);
}

std::map<std::string, SourceMatrix> find_mlx(const Checkpoint& checkpoint, const QuantizationConfig& quantization,
                                             const std::filesystem::path& config_source) {
  std::map<std::string, SourceMatrix> found;
  for (const auto& [name, info] : checkpoint.tensors()) {
    const std::string module = module_of(name, ".scales");
    if (module.empty()) continue;
    const std::string values_name = module + ".weight", biases_name = module + ".biases";
    if (!checkpoint.contains(values_name)) fail("{}: has no '{}' to scale", where(info), values_name);
    if (!checkpoint.contains(biases_name)) fail("{}: its biases '{}' are missing", where(info), biases_name);
    const TensorInfo& values = checkpoint.info(values_name);
    const TensorInfo& biases = checkpoint.info(biases_name);
    const std::optional<AffineScheme> scheme = quantization.scheme_for(module);
    if (!scheme)
      fail("{}: field 'quantization.{}' is false (not quantized) but the checkpoint holds '{}'",
           config_source.string(), module, name);
    // A matrix [out, in], or mlx-lm's stacked experts [experts, out, in] (switch_mlp).
    if (values.dtype != DType::U32 || (values.shape.size() != 2 && values.shape.size() != 3))
      fail("{}: is {} {}, expected packed U32 [out, in·bits/32] (or [experts, out, in·bits/32])", where(values),
           dtype_name(values.dtype), shape_string(values.shape));
    const int64_t words = values.shape.back();
    if ((words * 32) % scheme->bits != 0)
      fail("{}: {} packed words per row do not hold whole {}-bit codes", where(values), words, scheme->bits);
    const int64_t columns = words * 32 / scheme->bits;
    if (columns % scheme->group_size != 0)
      fail("{}: group size {} does not divide the input dimension {}", where(values), scheme->group_size, columns);
    Shape groups = values.shape;
    groups.back() = columns / scheme->group_size;
    Shape logical = values.shape;
    logical.back() = columns;
    for (const TensorInfo* part : {&info, &biases}) {
      if (part->shape != groups)
        fail("{}: wrong shape {}, expected {} ({} {}-bit codes per row in groups of {})", where(*part),
             shape_string(part->shape), shape_string(groups), columns, scheme->bits, scheme->group_size);
      if (!is_scale_dtype(part->dtype, true))
        fail("{}: dtype {}, expected F32, BF16 or F16", where(*part), dtype_name(part->dtype));
    }
    if (biases.dtype != info.dtype)
      fail("{}: dtype {} differs from its scales' {}", where(biases), dtype_name(biases.dtype), dtype_name(info.dtype));
    QuantizedParts layout;
    layout.format = WeightFormat::Affine;
    layout.bits = scheme->bits;
    layout.group_size = scheme->group_size;
    layout.scales = name;
    layout.biases = biases_name;
    found.emplace(values_name, SourceMatrix{layout, logical});
  }
  for (const auto& [module, scheme] : quantization.module_schemes)
    if (scheme && !found.count(module + ".weight"))
      fail("{}: field 'quantization.{}' names no quantized module of the checkpoint (no '{}.scales')",
           config_source.string(), module, module);
  return found;
}

std::map<std::string, SourceMatrix> find_fp8(const Checkpoint& checkpoint, const QuantizationConfig& quantization) {
  std::map<std::string, SourceMatrix> found;
  for (const auto& [name, info] : checkpoint.tensors()) {
    const std::string values_name = module_of(name, "_scale_inv");
    if (values_name.empty()) continue;
    if (!checkpoint.contains(values_name)) fail("{}: has no '{}' to scale", where(info), values_name);
    const TensorInfo& values = checkpoint.info(values_name);
    if (values.dtype != DType::F8E4M3 || values.shape.size() != 2)
      fail("{}: is {} {}, expected an F8_E4M3 matrix", where(values), dtype_name(values.dtype),
           shape_string(values.shape));
    const Shape blocks{ceil_div(values.shape[0], quantization.block_rows),
                       ceil_div(values.shape[1], quantization.block_columns)};
    if (info.shape != blocks)
      fail("{}: wrong shape {}, expected {} ({} in {}x{} blocks)", where(info), shape_string(info.shape),
           shape_string(blocks), shape_string(values.shape), quantization.block_rows, quantization.block_columns);
    if (!is_scale_dtype(info.dtype, false)) fail("{}: dtype {}, expected F32 or BF16", where(info), dtype_name(info.dtype));
    QuantizedParts layout;
    layout.format = WeightFormat::Fp8Block;
    layout.block_rows = quantization.block_rows;
    layout.block_columns = quantization.block_columns;
    layout.scales = name;
    found.emplace(values_name, SourceMatrix{layout, values.shape});
  }
  return found;
}

// An AWQ or GPTQ matrix: its stored tensors, checked, as the repack of its parts names them.
struct StoredMatrix {
  AffineRepack repack;     // part unset: the three parts differ only in it
  int64_t outputs = 0;     // N
  int64_t inputs = 0;      // K
  std::string group_index;  // GPTQ: g_idx's name
};

const TensorInfo& stored_part(const Checkpoint& checkpoint, const TensorInfo& qweight, const std::string& module,
                              const char* suffix, const char* what) {
  const std::string name = module + suffix;
  if (!checkpoint.contains(name)) fail("{}: its {} '{}' are missing", where(qweight), what, name);
  return checkpoint.info(name);
}

void require_int32(const TensorInfo& info, const Shape& shape, const std::string& layout) {
  if (info.dtype != DType::I32 || info.shape != shape)
    fail("{}: is {} {}, expected I32 {} ({})", where(info), dtype_name(info.dtype), shape_string(info.shape),
         shape_string(shape), layout);
}

// AWQ (GEMM) and GPTQ matrices, by the source name of their qweight: every stored tensor's shape
// and dtype checked, and GPTQ's g_idx read (K int32s: an index, not weight data) and required to
// be k / group_size, before any weight is read.
std::map<std::string, StoredMatrix> find_awq_gptq(const Checkpoint& checkpoint, const QuantizationConfig& quantization,
                                                  const std::filesystem::path& config_source) {
  const bool awq = quantization.method == QuantMethod::Awq;
  const int bits = quantization.affine.bits, group = quantization.affine.group_size;
  const int64_t per_word = 32 / bits;
  std::map<std::string, StoredMatrix> found;
  for (const auto& [name, qweight] : checkpoint.tensors()) {
    const std::string module = module_of(name, ".qweight");
    if (module.empty()) continue;
    if (qweight.dtype != DType::I32 || qweight.shape.size() != 2)
      fail("{}: is {} {}, expected I32 packed {}-bit codes", where(qweight), dtype_name(qweight.dtype),
           shape_string(qweight.shape), bits);
    StoredMatrix matrix;
    matrix.inputs = awq ? qweight.shape[0] : qweight.shape[0] * per_word;
    matrix.outputs = awq ? qweight.shape[1] * per_word : qweight.shape[1];
    if (matrix.inputs % group != 0)
      fail("{}: group size {} does not divide the input dimension {}", where(qweight), group, matrix.inputs);
    if (matrix.outputs % per_word != 0)
      fail("{}: {} outputs do not fill whole words of {}-bit zeros", where(qweight), matrix.outputs, bits);
    const int64_t groups = matrix.inputs / group;
    const TensorInfo& qzeros = stored_part(checkpoint, qweight, module, ".qzeros", "zeros");
    const TensorInfo& scales = stored_part(checkpoint, qweight, module, ".scales", "scales");
    require_int32(qzeros, {groups, matrix.outputs / per_word},
                  fmt::format("{}-bit zeros of {} outputs in {} groups of {}", bits, matrix.outputs, groups, group));
    if (scales.shape != Shape{groups, matrix.outputs})
      fail("{}: wrong shape {}, expected {} ({} outputs in {} groups of {})", where(scales), shape_string(scales.shape),
           shape_string(Shape{groups, matrix.outputs}), matrix.outputs, groups, group);
    // −scale · zero is exact in f32 only for a significand of at most 11 bits (AffineRepack).
    if (scales.dtype != DType::F16 && scales.dtype != DType::BF16)
      fail("{}: dtype {}, expected F16 or BF16", where(scales), dtype_name(scales.dtype));
    if (!awq) {
      const TensorInfo& group_index = stored_part(checkpoint, qweight, module, ".g_idx", "group indices");
      require_int32(group_index, {matrix.inputs}, "the group of each input");
      if (quantization.gptq_desc_act)
        fail("{}: field 'quantization_config.desc_act' is true: the inputs of '{}' are grouped in the order of '{}', "
             "and kiln does not permute activations to follow it",
             config_source.string(), name, group_index.name);
      const Tensor indices = checkpoint.view(group_index.name);
      for (int64_t k = 0; k < matrix.inputs; ++k)
        if (indices.data<const int32_t>()[k] != k / group)
          fail("{}: g_idx[{}] is {}, not k / group_size = {} (desc_act is false)", where(group_index), k,
               indices.data<const int32_t>()[k], k / group);
      matrix.group_index = group_index.name;
    }
    matrix.repack = {awq ? AffineRepack::Packing::Awq : AffineRepack::Packing::Gptq, AffineRepack::Part::Codes, bits,
                     group, name, qzeros.name, scales.name};
    found.emplace(name, matrix);
  }
  return found;
}

// The three Affine parts of a stored AWQ or GPTQ matrix planned as `planned` (its qweight).
std::vector<PlannedTensor> repacked_parts(const PlannedTensor& planned, const StoredMatrix& matrix) {
  const std::string module = module_of(planned.canonical, ".qweight");
  if (module.empty())
    fail("quantized tensor '{}' is planned as '{}', which keeps no module name for its parts", planned.source,
         planned.canonical);
  if (!planned.fixups.empty())
    fail("tensor '{}': the load plan applies the fix-up {} to this quantized matrix, which kiln cannot apply to its "
         "parts",
         planned.source, fixup_name(planned.fixups.front()));
  const Shape groups{matrix.outputs, matrix.inputs / matrix.repack.group_size};
  auto part = [&](AffineRepack::Part which, const std::string& suffix, const std::string& source, Shape shape) {
    AffineRepack repack = matrix.repack;
    repack.part = which;
    return PlannedTensor{module + suffix, source, {}, std::move(shape), {}, std::nullopt, repack};
  };
  PlannedTensor codes = part(AffineRepack::Part::Codes, ".weight", matrix.repack.qweight,
                             {matrix.outputs, matrix.inputs * matrix.repack.bits / 32});
  codes.quantized = QuantizedParts{WeightFormat::Affine, matrix.repack.bits, matrix.repack.group_size, 0, 0,
                                   module + ".scales", module + ".biases"};
  return {part(AffineRepack::Part::Scales, ".scales", matrix.repack.scales, groups),
          part(AffineRepack::Part::Biases, ".biases", matrix.repack.qzeros, groups), std::move(codes)};
}

// The sanitized plan with each AWQ or GPTQ matrix's stored tensors replaced by its Affine parts.
LoadPlan plan_repacked(LoadPlan sanitized, const Checkpoint& checkpoint, const QuantizationConfig& quantization,
                       const std::filesystem::path& config_source) {
  const std::map<std::string, StoredMatrix> matrices = find_awq_gptq(checkpoint, quantization, config_source);
  std::set<std::string> stored;  // every stored tensor of a matrix
  for (const auto& [qweight, matrix] : matrices) {
    stored.insert({qweight, matrix.repack.qzeros, matrix.repack.scales});
    if (!matrix.group_index.empty()) stored.insert(matrix.group_index);
  }
  for (const auto& [name, info] : checkpoint.tensors())
    if (!is_float_dtype(info.dtype) && !stored.count(name))
      fail("{}: dtype {} is not a floating-point weight, and config.json's quantization ({}) makes it no quantized "
           "matrix's part",
           where(info), dtype_name(info.dtype), quant_method_name(quantization.method));
  LoadPlan plan;
  plan.dropped = std::move(sanitized.dropped);
  plan.notes = std::move(sanitized.notes);
  for (PlannedTensor& planned : sanitized.tensors) {
    const auto matrix = matrices.find(planned.source);
    if (matrix != matrices.end()) {
      for (PlannedTensor& part : repacked_parts(planned, matrix->second)) plan.tensors.push_back(std::move(part));
      if (!matrix->second.group_index.empty())
        plan.dropped.push_back({matrix->second.group_index, "GPTQ g_idx: checked to be k / group_size"});
    } else if (!stored.count(planned.source)) {
      plan.tensors.push_back(std::move(planned));
    }
  }
  if (!matrices.empty())
    plan.notes.push_back(fmt::format("{} quantized matrices ({}, {}-bit, group {}): repacked at load into MLX affine "
                                     "codes with F32 scales and biases (-scale * zero)",
                                     matrices.size(), quant_method_name(quantization.method), quantization.affine.bits,
                                     quantization.affine.group_size));
  return plan;
}

// The canonical name of a part: the values' canonical module with the part's own suffix.
std::string canonical_part(const std::string& values_canonical, const std::string& values_source,
                           const std::string& part_source) {
  const std::string source_module = module_of(values_source, ".weight");
  const std::string canonical_module = module_of(values_canonical, ".weight");
  if (source_module.empty() || canonical_module.empty() || !part_source.starts_with(source_module))
    fail("quantized tensor '{}' is planned as '{}', which keeps no module name for its parts", values_source,
         values_canonical);
  return canonical_module + part_source.substr(source_module.size());
}

// Every quantized matrix of the checkpoint, by its values tensor's name; fails on any integer or
// FP8 tensor that is no matrix's part.
std::map<std::string, SourceMatrix> find_matrices(const Checkpoint& checkpoint, const ModelConfig& config) {
  const QuantizationConfig& quantization = config.quantization;
  std::map<std::string, SourceMatrix> matrices;
  switch (quantization.method) {
    case QuantMethod::None: break;
    case QuantMethod::MlxAffine: matrices = find_mlx(checkpoint, quantization, config.source); break;
    case QuantMethod::Fp8: matrices = find_fp8(checkpoint, quantization); break;
    case QuantMethod::Awq:
    case QuantMethod::Gptq: break;  // repacked instead (plan_repacked)
  }
  for (const auto& [name, info] : checkpoint.tensors())
    if (!is_float_dtype(info.dtype) && !matrices.count(name))
      fail("{}: dtype {} is not a floating-point weight, and config.json's quantization ({}) makes it no quantized "
           "matrix's part",
           where(info), dtype_name(info.dtype), quant_method_name(quantization.method));
  return matrices;
}

std::set<std::string> part_sources(const std::map<std::string, SourceMatrix>& matrices) {
  std::set<std::string> parts;
  for (const auto& [values, matrix] : matrices) {
    parts.insert(matrix.layout.scales);
    if (!matrix.layout.biases.empty()) parts.insert(matrix.layout.biases);
  }
  return parts;
}

// The checkpoint as a dense one: each matrix's values as a float matrix of its logical shape (in
// its scales' dtype), its other parts absent.
Checkpoint dense_view(const Checkpoint& checkpoint, const std::map<std::string, SourceMatrix>& matrices,
                      const std::set<std::string>& parts) {
  std::map<std::string, TensorInfo> table;
  for (const auto& [name, info] : checkpoint.tensors()) {
    if (parts.count(name)) continue;
    TensorInfo seen = info;
    const auto matrix = matrices.find(name);
    if (matrix != matrices.end()) {
      seen.shape = matrix->second.logical;
      seen.dtype = checkpoint.info(matrix->second.layout.scales).dtype;
      seen.nbytes = static_cast<uint64_t>(shape_numel(seen.shape)) * dtype_size(seen.dtype);
    }
    table.emplace(name, std::move(seen));
  }
  return checkpoint.with_table(std::move(table));
}

}  // namespace

LoadPlan plan_checkpoint(const Checkpoint& checkpoint, const ModelConfig& config,
                         const std::function<LoadPlan(const Checkpoint&)>& sanitize) {
  if (config.quantization.method == QuantMethod::Awq || config.quantization.method == QuantMethod::Gptq)
    return plan_repacked(sanitize(checkpoint), checkpoint, config.quantization, config.source);
  const std::map<std::string, SourceMatrix> matrices = find_matrices(checkpoint, config);
  if (matrices.empty()) return sanitize(checkpoint);
  const std::set<std::string> parts = part_sources(matrices);
  LoadPlan sanitized = sanitize(dense_view(checkpoint, matrices, parts));

  LoadPlan plan;
  plan.dropped = std::move(sanitized.dropped);
  plan.notes = std::move(sanitized.notes);
  for (PlannedTensor& planned : sanitized.tensors) {
    const auto matrix = matrices.find(planned.source);
    if (matrix == matrices.end()) {
      for (const std::string& source : planned.stacked_sources)
        if (matrices.count(source))
          fail("{}: is quantized but stacked with '{}', which is not", where(checkpoint.info(source)), planned.source);
      plan.tensors.push_back(std::move(planned));
      continue;
    }
    const TensorInfo& values = checkpoint.info(planned.source);
    const bool stacked = !planned.stacked_sources.empty();
    for (FixUp fixup : planned.fixups)
      if (!(fixup == FixUp::StackExperts ||
            (fixup == FixUp::GatherRows && matrix->second.layout.format != WeightFormat::Fp8Block)))
        fail("{}: the load plan applies the fix-up {} to this quantized matrix, which kiln cannot apply to its parts",
             where(values), fixup_name(fixup));
    QuantizedParts layout = matrix->second.layout;
    // Stacked experts are each a quantized matrix of one layout; their parts stack alike.
    std::vector<const SourceMatrix*> experts;
    for (const std::string& source : planned.stacked_sources) {
      const auto expert = matrices.find(source);
      const QuantizedParts* other = expert == matrices.end() ? nullptr : &expert->second.layout;
      if (!other || other->format != layout.format || other->bits != layout.bits ||
          other->group_size != layout.group_size || other->block_rows != layout.block_rows ||
          other->block_columns != layout.block_columns)
        fail("{}: is stacked with '{}', which is not quantized the same way", where(checkpoint.info(source)),
             planned.source);
      experts.push_back(&expert->second);
    }
    for (std::string* part : {&layout.scales, &layout.biases}) {
      if (part->empty()) continue;
      const bool is_scales = part == &layout.scales;
      const TensorInfo& info = checkpoint.info(*part);
      PlannedTensor planned_part = planned;
      planned_part.canonical = canonical_part(planned.canonical, planned.source, *part);
      planned_part.source = *part;
      planned_part.stacked_sources.clear();
      for (const SourceMatrix* expert : experts)
        planned_part.stacked_sources.push_back(is_scales ? expert->layout.scales : expert->layout.biases);
      if (stacked) {
        planned_part.canonical_shape = info.shape;
        planned_part.canonical_shape.insert(planned_part.canonical_shape.begin(),
                                            static_cast<int64_t>(experts.size()));
      } else if (planned.fixups.empty()) {
        planned_part.canonical_shape = info.shape;
      } else {
        // Row gathers (Affine only) pick the parts' rows as they pick the values'.
        planned_part.canonical_shape.back() = info.shape.back();
      }
      *part = planned_part.canonical;
      plan.tensors.push_back(std::move(planned_part));
    }
    planned.canonical_shape.back() = values.shape.back();
    planned.quantized = layout;
    plan.tensors.push_back(std::move(planned));
  }
  // A dropped matrix (a vision tower's) drops its parts too.
  const std::set<std::string> planned_sources = [&] {
    std::set<std::string> sources;
    for (const PlannedTensor& planned : plan.tensors) sources.insert(planned.source);
    return sources;
  }();
  for (const auto& [values, matrix] : matrices) {
    if (planned_sources.count(values)) continue;
    for (const std::string& part : {matrix.layout.scales, matrix.layout.biases})
      if (!part.empty()) plan.dropped.push_back({part, "part of the dropped quantized matrix '" + values + "'"});
  }
  plan.notes.push_back(fmt::format("{} quantized matrices ({}): their {} planned beside their values", matrices.size(),
                                   quant_method_name(config.quantization.method),
                                   config.quantization.method == QuantMethod::MlxAffine ? "scales and biases"
                                                                                         : "scales"));
  return plan;
}

}  // namespace kiln
