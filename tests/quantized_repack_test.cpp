// AWQ and GPTQ checkpoints, repacked at load into the MLX affine layout (model/load_plan.h,
// AffineRepack): checkpoints written in their real layouts from the same integer codes, zeros and
// scales as an MLX checkpoint decode to exactly scale · (q − zero) and give bitwise the MLX
// checkpoint's logits on the CPU; every malformed one is refused while planning, naming the tensor
// or field.
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/weight.h"
#include "engine/generation.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/loader.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

constexpr int kGroup = 32;
const std::string kQ = "model.layers.0.self_attn.q_proj";  // divides every input width of llama3-tiny (64 and 160)

// AutoAWQ's packing order (awq/modules/linear/gemm.py): slot i of a word holds output kAwqOrder[i].
constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// One matrix's integers: codes q[n][k], zeros z[n][g] and F16 scales s[n][g].
struct IntegerMatrix {
  int64_t outputs = 0, inputs = 0;
  int bits = 4;
  std::vector<uint32_t> codes, zeros;
  std::vector<uint16_t> scales;  // F16 bits
  int64_t groups() const { return inputs / kGroup; }
  uint32_t q(int64_t n, int64_t k) const { return codes[n * inputs + k]; }
  uint32_t z(int64_t n, int64_t g) const { return zeros[n * groups() + g]; }
  float s(int64_t n, int64_t g) const { return f16_to_f32(scales[n * groups() + g]); }
};

// Zeros in [lowest_zero, lowest_zero + 2^bits − 1]: GPTQ's v1 zeros (stored minus one) are 1…2^bits.
IntegerMatrix random_matrix(int64_t outputs, int64_t inputs, int bits, uint32_t lowest_zero, std::mt19937& random) {
  IntegerMatrix matrix{outputs, inputs, bits, {}, {}, {}};
  const uint32_t levels = 1u << bits;
  std::uniform_real_distribution<float> scale(0.5f / static_cast<float>(levels), 4.0f / static_cast<float>(levels));
  for (int64_t i = 0; i < outputs * inputs; ++i) matrix.codes.push_back(random() % levels);
  for (int64_t i = 0; i < outputs * matrix.groups(); ++i) {
    matrix.zeros.push_back(lowest_zero + random() % levels);
    matrix.scales.push_back(f32_to_f16(scale(random) / 16.0f));
  }
  return matrix;
}

template <typename T>
SafetensorsEntry entry(const std::string& name, DType dtype, Shape shape, const std::vector<T>& values) {
  SafetensorsEntry out{name, dtype, std::move(shape), {}, {}};
  out.bytes.resize(values.size() * sizeof(T));
  std::memcpy(out.bytes.data(), values.data(), out.bytes.size());
  EXPECT_EQ(out.bytes.size(), out.nbytes()) << name;
  return out;
}

// The matrix in each layout, as `<module>.<part>` entries.
std::vector<SafetensorsEntry> mlx_layout(const std::string& module, const IntegerMatrix& m) {
  const int64_t row_words = m.inputs * m.bits / 32;
  std::vector<uint32_t> words(m.outputs * row_words, 0);
  std::vector<float> scales, biases;
  for (int64_t n = 0; n < m.outputs; ++n) {
    for (int64_t k = 0; k < m.inputs; ++k)
      words[n * row_words + k * m.bits / 32] |= m.q(n, k) << (k * m.bits % 32);
    for (int64_t g = 0; g < m.groups(); ++g) {
      scales.push_back(m.s(n, g));
      biases.push_back(-m.s(n, g) * static_cast<float>(m.z(n, g)));
    }
  }
  return {entry(module + ".weight", DType::U32, {m.outputs, row_words}, words),
          entry(module + ".scales", DType::F32, {m.outputs, m.groups()}, scales),
          entry(module + ".biases", DType::F32, {m.outputs, m.groups()}, biases)};
}

// scales [K/G, N] F16, as both AWQ and GPTQ store them.
SafetensorsEntry transposed_scales(const std::string& module, const IntegerMatrix& m) {
  std::vector<uint16_t> scales;
  for (int64_t g = 0; g < m.groups(); ++g)
    for (int64_t n = 0; n < m.outputs; ++n) scales.push_back(m.scales[n * m.groups() + g]);
  return entry(module + ".scales", DType::F16, {m.groups(), m.outputs}, scales);
}

std::vector<SafetensorsEntry> awq_layout(const std::string& module, const IntegerMatrix& m) {
  const int64_t words_per_row = m.outputs / 8;
  std::vector<int32_t> qweight(m.inputs * words_per_row, 0), qzeros(m.groups() * words_per_row, 0);
  for (int64_t word = 0; word < words_per_row; ++word) {
    for (int slot = 0; slot < 8; ++slot) {
      const int64_t n = word * 8 + kAwqOrder[slot];
      for (int64_t k = 0; k < m.inputs; ++k)
        qweight[k * words_per_row + word] |= static_cast<int32_t>(m.q(n, k) << (4 * slot));
      for (int64_t g = 0; g < m.groups(); ++g)
        qzeros[g * words_per_row + word] |= static_cast<int32_t>(m.z(n, g) << (4 * slot));
    }
  }
  return {entry(module + ".qweight", DType::I32, {m.inputs, words_per_row}, qweight),
          entry(module + ".qzeros", DType::I32, {m.groups(), words_per_row}, qzeros), transposed_scales(module, m)};
}

std::vector<SafetensorsEntry> gptq_layout(const std::string& module, const IntegerMatrix& m) {
  const int per_word = 32 / m.bits;
  const uint32_t mask = (1u << m.bits) - 1u;
  std::vector<int32_t> qweight(m.inputs / per_word * m.outputs, 0), qzeros(m.groups() * m.outputs / per_word, 0),
      group_index;
  for (int64_t k = 0; k < m.inputs; ++k) {
    group_index.push_back(static_cast<int32_t>(k / kGroup));
    for (int64_t n = 0; n < m.outputs; ++n)
      qweight[(k / per_word) * m.outputs + n] |= static_cast<int32_t>(m.q(n, k) << (k % per_word * m.bits));
  }
  for (int64_t g = 0; g < m.groups(); ++g)
    for (int64_t n = 0; n < m.outputs; ++n)
      qzeros[g * (m.outputs / per_word) + n / per_word] |=
          static_cast<int32_t>(((m.z(n, g) - 1) & mask) << (n % per_word * m.bits));
  return {entry(module + ".qweight", DType::I32, {m.inputs / per_word, m.outputs}, qweight),
          entry(module + ".qzeros", DType::I32, {m.groups(), m.outputs / per_word}, qzeros),
          transposed_scales(module, m), entry(module + ".g_idx", DType::I32, {m.inputs}, group_index)};
}

using Layout = std::function<std::vector<SafetensorsEntry>(const std::string&, const IntegerMatrix&)>;

// llama3-tiny's f32 checkpoint with each decoder projection replaced by `matrices` in `layout`.
void write_model(const std::filesystem::path& dir, const Layout& layout,
                 const std::map<std::string, IntegerMatrix>& matrices, const nlohmann::json& quantization) {
  const std::filesystem::path source = fixtures_dir() / "llama3-tiny/f32";
  std::filesystem::create_directories(dir);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(source / "config.json"));
  config[quantization.contains("quant_method") ? "quantization_config" : "quantization"] = quantization;
  std::ofstream(dir / "config.json") << config.dump(2);
  const Checkpoint checkpoint = Checkpoint::open(source);
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, info] : checkpoint.tensors()) {
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    const auto matrix = matrices.find(module);
    if (matrix != matrices.end()) {
      for (SafetensorsEntry& part : layout(module, matrix->second)) entries.push_back(std::move(part));
      continue;
    }
    const Tensor tensor = checkpoint.view(name);
    SafetensorsEntry copy{name, tensor.dtype(), tensor.shape(), {}, {}};
    copy.bytes.assign(static_cast<const uint8_t*>(tensor.raw()), static_cast<const uint8_t*>(tensor.raw()) + tensor.nbytes());
    entries.push_back(std::move(copy));
  }
  write_safetensors(dir / "model.safetensors", entries);
}

// Random integers for every decoder projection of llama3-tiny.
std::map<std::string, IntegerMatrix> projections(int bits, uint32_t lowest_zero) {
  const Checkpoint checkpoint = Checkpoint::open(fixtures_dir() / "llama3-tiny/f32");
  std::mt19937 random(bits * 7 + lowest_zero);
  std::map<std::string, IntegerMatrix> matrices;
  for (const auto& [name, info] : checkpoint.tensors())
    if (name.starts_with("model.layers.") && name.ends_with("_proj.weight"))
      matrices.emplace(name.substr(0, name.size() - std::string(".weight").size()),
                       random_matrix(info.shape[0], info.shape[1], bits, lowest_zero, random));
  return matrices;
}

nlohmann::json mlx_quantization(int bits) { return {{"group_size", kGroup}, {"bits", bits}}; }
nlohmann::json awq_quantization() {
  return {{"quant_method", "awq"}, {"bits", 4}, {"group_size", kGroup}, {"version", "gemm"}, {"zero_point", true}};
}
nlohmann::json gptq_quantization(int bits) {
  return {{"quant_method", "gptq"}, {"bits", bits}, {"group_size", kGroup}, {"desc_act", false}, {"sym", false}};
}

struct RepackCase {
  std::string name;
  int bits;
  uint32_t lowest_zero;
  Layout layout;
  nlohmann::json quantization;
};

void PrintTo(const RepackCase& param, std::ostream* out) { *out << param.name; }

class Repacked : public ::testing::TestWithParam<RepackCase> {};

TEST_P(Repacked, DecodesToScaleTimesCodeMinusZeroExactly) {
  const RepackCase& param = GetParam();
  const auto matrices = projections(param.bits, param.lowest_zero);
  TempDir temp;
  write_model(temp.path(), param.layout, matrices, param.quantization);
  const ModelPlan plan = plan_model(temp.path(), Device::CPU, true);
  WeightMap weights(plan.checkpoint, plan.load_plan);
  for (const auto& [module, m] : matrices) {
    const Weight weight = weights.take_weight(module + ".weight", {m.outputs, m.inputs});
    ASSERT_EQ(weight.format(), WeightFormat::Affine) << module;
    EXPECT_EQ(weight.bits(), param.bits);
    EXPECT_EQ(weight.scales().dtype(), DType::F32);
    std::vector<float> decoded(m.outputs * m.inputs);
    decode_rows(weight, 0, m.outputs, decoded.data());
    for (int64_t n = 0; n < m.outputs; ++n)
      for (int64_t k = 0; k < m.inputs; ++k) {
        const double expected = static_cast<double>(m.s(n, k / kGroup)) *
                                (static_cast<double>(m.q(n, k)) - static_cast<double>(m.z(n, k / kGroup)));
        ASSERT_EQ(static_cast<double>(decoded[n * m.inputs + k]), expected) << module << " [" << n << ", " << k << "]";
      }
  }
}

TEST_P(Repacked, LogitsEqualTheMlxCheckpointOfTheSameIntegersBitwise) {
  const RepackCase& param = GetParam();
  const auto matrices = projections(param.bits, param.lowest_zero);
  TempDir temp;
  write_model(temp.path() / "repacked", param.layout, matrices, param.quantization);
  write_model(temp.path() / "mlx", mlx_layout, matrices, mlx_quantization(param.bits));
  TestModel repacked = open_cpu_model(temp.path() / "repacked");
  TestModel mlx = open_cpu_model(temp.path() / "mlx");
  const std::vector<int32_t> prompt{1, 17, 300, 42, 511, 7, 99, 250};
  const Tensor ours = prompt_logits(*repacked.model, prompt, 0);
  const Tensor reference = prompt_logits(*mlx.model, prompt, 0);
  ASSERT_EQ(ours.shape(), reference.shape());
  EXPECT_EQ(std::memcmp(ours.raw(), reference.raw(), ours.nbytes()), 0);
}

TEST_P(Repacked, ShapesOnlyAndInspectSeeTheRepackedParts) {
  const RepackCase& param = GetParam();
  const auto matrices = projections(param.bits, param.lowest_zero);
  TempDir temp;
  write_model(temp.path(), param.layout, matrices, param.quantization);
  const ModelPlan plan = plan_model(temp.path(), Device::CPU, true);
  WeightMap real(plan.checkpoint, plan.load_plan);
  WeightMap shapes = WeightMap::shapes_only(plan.checkpoint, plan.load_plan, DType::BF16);
  uint64_t packed_bytes = 0;
  for (const auto& [module, m] : matrices) {
    const Weight loaded = real.take_weight(module + ".weight", {m.outputs, m.inputs});
    const Weight planned = shapes.take_weight(module + ".weight", {m.outputs, m.inputs});
    EXPECT_EQ(planned.describe(), loaded.describe()) << module;
    EXPECT_EQ(planned.nbytes(), loaded.nbytes()) << module;
    EXPECT_EQ(planned.scales().dtype(), DType::F32) << "--dtype leaves a quantized matrix's parts as they are";
    packed_bytes += loaded.nbytes();
  }
  const nlohmann::json report = plan.to_json();
  const nlohmann::json& quantization = report["quantization"];
  EXPECT_EQ(quantization["method"], param.quantization["quant_method"]);
  EXPECT_EQ(quantization["bits"], param.bits);
  EXPECT_EQ(quantization["group_size"], kGroup);
  EXPECT_EQ(quantization["quantized_matrices"], matrices.size());
  EXPECT_EQ(quantization["packed_bytes"], packed_bytes);
  EXPECT_EQ(quantization["matrices_by_layout"],
            (nlohmann::json{{fmt::format("affine {}-bit group {}", param.bits, kGroup), matrices.size()}}));
  bool shown = false;
  for (const nlohmann::json& tensor : report["load_plan"]["tensors"])
    if (tensor["canonical"] == kQ + ".biases") {
      shown = true;
      EXPECT_EQ(tensor["repack"], param.quantization["quant_method"].get<std::string>() + " zeros as biases");
      EXPECT_EQ(tensor["sources"], (nlohmann::json{kQ + ".qzeros", kQ + ".scales"}));
    }
  EXPECT_TRUE(shown) << report["load_plan"].dump();
}

INSTANTIATE_TEST_SUITE_P(Formats, Repacked,
                         ::testing::Values(RepackCase{"awq4", 4, 0, awq_layout, awq_quantization()},
                                           RepackCase{"gptq4", 4, 1, gptq_layout, gptq_quantization(4)},
                                           RepackCase{"gptq8", 8, 1, gptq_layout, gptq_quantization(8)}),
                         [](const auto& info) { return info.param.name; });

// One AWQ or GPTQ checkpoint altered by `alter` (entries by name, and the quantization config),
// expected to be refused while planning with every fragment in its one-line message.
struct MalformedCase {
  std::string name;
  bool gptq;
  std::function<void(std::map<std::string, SafetensorsEntry>&, nlohmann::json&)> alter;
  std::vector<std::string> fragments;
};

void PrintTo(const MalformedCase& param, std::ostream* out) { *out << param.name; }

class MalformedRepack : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(MalformedRepack, IsRefusedWhilePlanningNamingTheTensorOrField) {
  const MalformedCase& param = GetParam();
  const auto matrices = projections(4, param.gptq ? 1 : 0);
  TempDir temp;
  write_model(temp.path(), param.gptq ? Layout(gptq_layout) : Layout(awq_layout), matrices,
              param.gptq ? gptq_quantization(4) : awq_quantization());
  const Checkpoint written = Checkpoint::open(temp.path());
  std::map<std::string, SafetensorsEntry> entries;
  for (const auto& [name, info] : written.tensors()) {
    const Tensor tensor = written.view(name);
    SafetensorsEntry copy{name, tensor.dtype(), tensor.shape(), {}, {}};
    copy.bytes.assign(static_cast<const uint8_t*>(tensor.raw()), static_cast<const uint8_t*>(tensor.raw()) + tensor.nbytes());
    entries.emplace(name, std::move(copy));
  }
  nlohmann::json config = nlohmann::json::parse(std::ifstream(temp.path() / "config.json"));
  param.alter(entries, config["quantization_config"]);
  const std::filesystem::path dir = temp.path() / "malformed";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump(2);
  std::vector<SafetensorsEntry> list;
  for (auto& [name, part] : entries) list.push_back(std::move(part));
  write_safetensors(dir / "model.safetensors", list);
  expect_error_mentions([&] { plan_model(dir, Device::CPU, true); }, param.fragments);
}

const std::string kDown = "model.layers.0.mlp.down_proj";  // the first matrix in name order

void erase(std::map<std::string, SafetensorsEntry>& entries, const std::string& name) {
  ASSERT_EQ(entries.erase(name), 1u) << name;
}

// Reinterprets a tensor's bytes with another shape and dtype of the same size.
void reshape(std::map<std::string, SafetensorsEntry>& entries, const std::string& name, DType dtype, Shape shape) {
  SafetensorsEntry& part = entries.at(name);
  part.dtype = dtype;
  part.shape = std::move(shape);
  part.bytes.resize(part.nbytes());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MalformedRepack,
    ::testing::Values(
        MalformedCase{"awq_missing_qzeros", false, [](auto& e, auto&) { erase(e, kQ + ".qzeros"); },
                      {"'" + kQ + ".qweight'", "its zeros '" + kQ + ".qzeros' are missing"}},
        MalformedCase{"awq_missing_scales", false, [](auto& e, auto&) { erase(e, kQ + ".scales"); },
                      {"'" + kQ + ".qweight'", "its scales '" + kQ + ".scales' are missing"}},
        MalformedCase{"awq_qweight_dtype", false,
                      [](auto& e, auto&) { reshape(e, kQ + ".qweight", DType::F32, {64, 8}); },
                      {"'" + kQ + ".qweight'", "is F32 [64, 8], expected I32 packed 4-bit codes"}},
        MalformedCase{"awq_scales_shape", false,
                      [](auto& e, auto&) { reshape(e, kQ + ".scales", DType::F16, {64, 2}); },
                      {"'" + kQ + ".scales'", "wrong shape [64, 2], expected [2, 64]"}},
        MalformedCase{"awq_scales_dtype", false,
                      [](auto& e, auto&) { reshape(e, kQ + ".scales", DType::F32, {2, 64}); },
                      {"'" + kQ + ".scales'", "dtype F32, expected F16 or BF16"}},
        MalformedCase{"awq_qzeros_shape", false,
                      [](auto& e, auto&) { reshape(e, kQ + ".qzeros", DType::I32, {1, 16}); },
                      {"'" + kQ + ".qzeros'", "is I32 [1, 16], expected I32 [2, 8]"}},
        MalformedCase{"awq_group_size", false, [](auto&, auto& q) { q["group_size"] = 128; },
                      {"'" + kDown + ".qweight'", "group size 128 does not divide the input dimension 160"}},
        MalformedCase{"gptq_missing_g_idx", true, [](auto& e, auto&) { erase(e, kQ + ".g_idx"); },
                      {"'" + kQ + ".qweight'", "its group indices '" + kQ + ".g_idx' are missing"}},
        MalformedCase{"gptq_g_idx_shape", true,
                      [](auto& e, auto&) { reshape(e, kQ + ".g_idx", DType::I32, {32}); },
                      {"'" + kQ + ".g_idx'", "expected I32 [64]"}},
        MalformedCase{"gptq_g_idx_not_k_over_group", true,
                      [](auto& e, auto&) {
                        // Swap the groups of inputs 0 and 32, as an act-order checkpoint would.
                        auto* indices = reinterpret_cast<int32_t*>(e.at(kQ + ".g_idx").bytes.data());
                        std::swap(indices[0], indices[32]);
                      },
                      {"'" + kQ + ".g_idx'", "g_idx[0] is 1, not k / group_size = 0"}},
        MalformedCase{"gptq_desc_act", true, [](auto&, auto& q) { q["desc_act"] = true; },
                      {"field 'quantization_config.desc_act' is true", "'" + kDown + ".qweight'", "'" + kDown + ".g_idx'"}},
        MalformedCase{"gptq_missing_qweight", true,
                      [](auto& e, auto&) {
                        erase(e, kQ + ".qweight");
                      },
                      {"'" + kQ + ".g_idx'", "is not a floating-point weight"}}),
    [](const auto& info) { return info.param.name; });

}  // namespace
