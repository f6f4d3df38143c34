// The op test table (llama.cpp's test-backend-ops is the model): one list of cases (op, shapes,
// dtypes, options such as NormStyle, GQA ratios, rotary dims and batch layouts) that one harness
// runs on every backend target against the CPU reference, from the same inputs.
//
// The reference is the CPU backend on the best instruction set of this machine. Each target runs a
// case from the same host values (rounded to the target's activation dtype, and the reference then
// runs on those rounded values) and is held to the case's rule:
//   - a CPU instruction set: the reference's bits, except where the case says the ops differ
//     between instruction sets (matmul: other block sizes and FMA), then its f32 tolerance; and
//     the case's exact check, where it has one (a double-precision reference with the error bound
//     of the CPU's f32 arithmetic);
//   - CUDA with F32 activations: ‖cuda − cpu‖₂ / ‖cpu‖₂ ≤ the case's f32 tolerance (both sides
//     are f32 arithmetic in different orders), or the reference's bits where the case says its
//     every rounding is the same on every backend (a mixture's routing and combine);
//   - CUDA with BF16 activations, for cases its tensor-core path takes: ≤ kBf16Tolerance against
//     the CPU on the same bf16-rounded inputs (the CUDA side rounds to bf16 where transformers
//     does, ≈ 2⁻⁹ relative per rounding).
//
// Timing mode: with KILN_OP_TIMING=1 in the environment the harness also times every case on the
// target and on the reference (the median of a few runs after a warm-up, each run synchronised)
// and prints one table per target. It never asserts on a time.
//
// The table is compiled into both test binaries: kiln_tests runs it on the CPU instruction sets
// (tests/backend_ops_test.cpp), kiln_cuda_tests on CUDA (tests/cuda/backend_cuda_test.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"

namespace kiln::testing {

constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;

enum class Role {
  Activation,  // in the backend's activation dtype (bf16-rounded values for a bf16 backend)
  Weight,      // in the weight dtype the case runs with
  Index,       // I32 as given
  Float32,     // F32 as given (inv_freq, recurrent state, the f32 residual stream)
  Stored,      // a quantized weight's part (packed codes, fp8 values, scales) as given, in its own dtype
};

struct Input {
  Tensor values;  // F32 host values (I32 for Role::Index, any dtype for Role::Stored)
  Role role;
};

// Runs an op on `backend` from the uploaded inputs (in case order) and returns its outputs.
using OpRun = std::function<std::vector<Tensor>(Backend& backend, std::vector<Tensor>& inputs)>;

// Checks a CPU run against exact arithmetic: the host inputs as the op received them (weights in
// their dtype) and the host outputs. Fails through gtest assertions.
using ExactCheck = std::function<void(const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs)>;

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  OpRun run;
  std::vector<DType> f32_weight_dtypes{DType::F32};  // weight dtypes tried with F32 activations
  bool bf16 = true;                                  // whether the CUDA BF16 tensor-core path takes this case
  double f32_tolerance = kF32Tolerance;
  bool same_bits_on_every_cpu = true;  // false: the CPU instruction sets are held to f32_tolerance
  bool same_bits_on_every_backend = false;  // true: CUDA is held to the reference's bits too (f32 ops
                                            // whose every rounding the contract fixes)
  ExactCheck exact;                    // or empty
};

// Every case, in a fixed order, with inputs from fixed seeds.
std::vector<OpCase> op_cases();
// The groups op_cases() joins, drawing from one generator in turn (dense_cases.cpp,
// attention_hybrid_cases.cpp, quantized_cases.cpp).
std::vector<OpCase> dense_op_cases(std::mt19937& random);
std::vector<OpCase> attention_and_hybrid_op_cases(std::mt19937& random);
std::vector<OpCase> quantized_op_cases(std::mt19937& random);  // quantized_cases.cpp

// Spans of (slot, first position, tokens), laid out one after another in the batch.
inline std::vector<SequenceSpan> spans_of(const std::vector<std::array<int32_t, 3>>& slot_position_tokens) {
  std::vector<SequenceSpan> spans;
  int32_t first_token = 0;
  for (const auto& [slot, position, tokens] : slot_position_tokens) {
    spans.push_back({slot, first_token, tokens, position});
    first_token += tokens;
  }
  return spans;
}

inline int64_t span_tokens(const std::vector<SequenceSpan>& spans) {
  int64_t total = 0;
  for (const auto& span : spans) total += span.tokens;
  return total;
}

// A backend the table runs on.
struct OpTarget {
  std::string name;  // a gtest parameter name: cpu_avx2, cuda_bf16, ...
  std::function<std::unique_ptr<Backend>()> make;
  bool cpu = false;  // held to the CPU rules above
};

// Runs every case on `target` against the CPU reference, reporting failures through gtest (and, in
// timing mode, printing the timing table).
void run_op_table(const OpTarget& target);

}  // namespace kiln::testing
