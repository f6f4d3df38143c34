// The op table's harness: runs every case on a target and on the CPU reference from the same
// inputs, compares by each case's rule (op_table.h) and, in timing mode, prints the times.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "op_table/op_table.h"
#include "tensor_test_support.h"

namespace kiln::testing {
namespace {

std::vector<Tensor> upload_inputs(Backend& backend, const std::vector<Input>& inputs, DType activations,
                                  DType weights) {
  std::vector<Tensor> uploaded;
  for (const Input& input : inputs) {
    switch (input.role) {
      case Role::Activation: {
        // The CPU backend (f32) gets the same values the bf16 backend holds.
        const Tensor stored = f32_as(input.values, activations);
        uploaded.push_back(backend.upload(backend.activation_dtype() == DType::F32 ? as_f32(stored) : stored));
        break;
      }
      case Role::Weight:
        uploaded.push_back(backend.upload(f32_as(input.values, weights)));
        break;
      case Role::Index:
      case Role::Float32:
      case Role::Stored: {
        // A copy: the CPU's upload shares the host tensor, and ops write into their inputs.
        Tensor copy = Tensor::empty(input.values.shape(), input.values.dtype());
        std::memcpy(copy.raw(), input.values.raw(), input.values.nbytes());
        uploaded.push_back(backend.upload(copy));
        break;
      }
    }
  }
  return uploaded;
}

std::vector<Tensor> downloaded(Backend& backend, const std::vector<Tensor>& outputs) {
  std::vector<Tensor> host;
  for (const Tensor& output : outputs) host.push_back(backend.download(output));
  return host;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

bool timing_mode() {
  const char* value = std::getenv("KILN_OP_TIMING");
  return value != nullptr && std::string(value) == "1";
}

// The median time of a case's run on `backend` over a few runs after a warm-up, in milliseconds;
// inputs are uploaded before each run's clock starts, and each run ends synchronised.
double median_milliseconds(Backend& backend, const OpCase& op, DType activations, DType weights) {
  constexpr int kRuns = 5;
  std::vector<double> times;
  for (int run = 0; run <= kRuns; ++run) {
    std::vector<Tensor> inputs = upload_inputs(backend, op.inputs, activations, weights);
    backend.synchronize();
    const auto start = std::chrono::steady_clock::now();
    op.run(backend, inputs);
    backend.synchronize();
    const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
    if (run > 0) times.push_back(elapsed.count());  // run 0 warms caches, kernels and the allocator
  }
  std::nth_element(times.begin(), times.begin() + kRuns / 2, times.end());
  return times[kRuns / 2];
}

struct TimingRow {
  std::string name;
  double target_ms, reference_ms;
};

void print_timings(const OpTarget& target, const std::vector<TimingRow>& rows) {
  std::string table = fmt::format(
      "op table timings on {} (median of 5 runs, ms; the reference is the CPU on its best instruction set):\n",
      target.name);
  table += fmt::format("  {:<90} {:>14} {:>14}\n", "case", target.name, "cpu reference");
  for (const TimingRow& row : rows)
    table += fmt::format("  {:<90} {:>14.3f} {:>14.3f}\n", row.name, row.target_ms, row.reference_ms);
  std::fputs(table.c_str(), stdout);
}

}  // namespace

std::vector<OpCase> op_cases() {
  std::mt19937 random(20261202);
  std::vector<OpCase> cases = dense_op_cases(random);
  for (OpCase& op : attention_and_hybrid_op_cases(random)) cases.push_back(std::move(op));
  for (OpCase& op : quantized_op_cases(random)) cases.push_back(std::move(op));
  return cases;
}

void run_op_table(const OpTarget& target) {
  std::unique_ptr<Backend> backend = target.make();
  std::unique_ptr<Backend> reference = make_cpu_backend();
  const DType activations = backend->activation_dtype();
  const bool timing = timing_mode();
  std::vector<TimingRow> timings;
  const std::vector<OpCase> cases = op_cases();
  size_t runs = 0;
  for (const OpCase& op : cases) {
    if (activations == DType::BF16 && !op.bf16) continue;
    const std::vector<DType> weight_dtypes =
        activations == DType::BF16 ? std::vector<DType>{DType::BF16} : op.f32_weight_dtypes;
    for (DType weights : weight_dtypes) {
      const std::string label = op.name + " (weights " + std::string(dtype_name(weights)) + ")";
      SCOPED_TRACE(label);
      std::vector<Tensor> reference_inputs = upload_inputs(*reference, op.inputs, activations, weights);
      std::vector<Tensor> target_inputs = upload_inputs(*backend, op.inputs, activations, weights);
      const std::vector<Tensor> expected = downloaded(*reference, op.run(*reference, reference_inputs));
      const std::vector<Tensor> actual = downloaded(*backend, op.run(*backend, target_inputs));
      ASSERT_EQ(actual.size(), expected.size());
      for (size_t i = 0; i < expected.size(); ++i) {
        if ((target.cpu && op.same_bits_on_every_cpu) || op.same_bits_on_every_backend) {
          EXPECT_TRUE(same_bytes(actual[i], expected[i])) << "output " << i << " differs from the reference's bits";
        } else {
          const double tolerance = activations == DType::BF16 ? kBf16Tolerance : op.f32_tolerance;
          EXPECT_LE(relative_error(actual[i], expected[i]), tolerance) << "output " << i;
        }
      }
      if (target.cpu && op.exact) op.exact(upload_inputs(*backend, op.inputs, activations, weights), actual);
      ++runs;
      if (timing)
        timings.push_back({label, median_milliseconds(*backend, op, activations, weights),
                           median_milliseconds(*reference, op, activations, weights)});
    }
  }
  std::printf("op table on %s: %zu runs of %zu cases\n", target.name.c_str(), runs, cases.size());
  if (timing) print_timings(target, timings);
}

}  // namespace kiln::testing
