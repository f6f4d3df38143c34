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
    if (values.dtype != DType::U32 || values.shape.size() != 2)
      fail("{}: is {} {}, expected packed U32 [out, in·bits/32]", where(values), dtype_name(values.dtype),
           shape_string(values.shape));
    const int64_t rows = values.shape[0];
    if ((values.shape[1] * 32) % scheme->bits != 0)
      fail("{}: {} packed words per row do not hold whole {}-bit codes", where(values), values.shape[1], scheme->bits);
    const int64_t columns = values.shape[1] * 32 / scheme->bits;
    if (columns % scheme->group_size != 0)
      fail("{}: group size {} does not divide the input dimension {}", where(values), scheme->group_size, columns);
    const Shape groups{rows, columns / scheme->group_size};
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
    found.emplace(values_name, SourceMatrix{layout, {rows, columns}});
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
    case QuantMethod::Gptq:
      fail("{}: field 'quantization_config.quant_method' is '{}': not implemented yet", config.source.string(),
           quant_method_name(quantization.method));
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
      plan.tensors.push_back(std::move(planned));
      continue;
    }
    const TensorInfo& values = checkpoint.info(planned.source);
    for (FixUp fixup : planned.fixups)
      if (fixup != FixUp::GatherRows || matrix->second.layout.format == WeightFormat::Fp8Block)
        fail("{}: the load plan applies the fix-up {} to this quantized matrix, which kiln cannot apply to its parts",
             where(values), fixup_name(fixup));
    QuantizedParts layout = matrix->second.layout;
    for (std::string* part : {&layout.scales, &layout.biases}) {
      if (part->empty()) continue;
      const TensorInfo& info = checkpoint.info(*part);
      PlannedTensor planned_part = planned;
      planned_part.canonical = canonical_part(planned.canonical, planned.source, *part);
      planned_part.source = *part;
      // Row gathers (Affine only) pick the parts' rows as they pick the values'.
      planned_part.canonical_shape = planned.fixups.empty() ? info.shape
                                                            : Shape{planned.canonical_shape.at(0), info.shape.at(1)};
      *part = planned_part.canonical;
      plan.tensors.push_back(std::move(planned_part));
    }
    planned.canonical_shape = {planned.canonical_shape.at(0), values.shape.at(1)};
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
