// The op table (tests/op_table/op_table.h) on the CPU: every instruction set, each against the
// reference (the best one this CPU runs) and, for the CPU's own cases, against exact arithmetic.
// The same table runs on CUDA in kiln_cuda_tests (tests/cuda/backend_cuda_test.cpp).
#include <string>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "op_table/op_table.h"

namespace kiln::testing {
namespace {

class BackendOps : public ::testing::TestWithParam<cpu::CpuIsa> {};

TEST_P(BackendOps, MatchTheCpuReference) {
  const cpu::CpuIsa isa = GetParam();
  if (!cpu::cpu_supports(isa)) GTEST_SKIP() << "this CPU does not run the " << cpu::isa_name(isa) << " instruction set";
  run_op_table({"cpu_" + std::string(cpu::isa_name(isa)), [isa] { return cpu::make_cpu_backend(isa); }, true});
}

INSTANTIATE_TEST_SUITE_P(Cpu, BackendOps,
                         ::testing::Values(cpu::CpuIsa::Scalar, cpu::CpuIsa::Avx2, cpu::CpuIsa::Avx512),
                         [](const auto& info) { return std::string(cpu::isa_name(info.param)); });

// Says where the table's CUDA targets run, so that a CPU-only run shows they were not run here.
TEST(BackendOps, CudaTargetsRunInTheGpuTests) {
  GTEST_SKIP() << "the op table's CUDA targets (F32 and BF16 activations) run in kiln_cuda_tests, built with "
                  "-DKILN_CUDA=ON (ctest label gpu; they skip there without a GPU)";
}

}  // namespace
}  // namespace kiln::testing
