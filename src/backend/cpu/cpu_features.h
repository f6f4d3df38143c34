// Which SIMD instruction set the CPU kernels may use, detected at run time.
//
// The binary is baseline x86-64; kernels compiled for AVX2 or AVX-512 (files *_avx2.cpp,
// *_avx512.cpp) run only after detection says the CPU and the OS support them. Results of the
// different instruction sets need not match each other, but one backend instance uses one
// instruction set for every call, so its results never change from call to call.
#pragma once

#include <string_view>

namespace kiln::cpu {

enum class CpuIsa {
  Scalar,  // portable C++, baseline x86-64
  Avx2,    // AVX2 + FMA + F16C
  Avx512,  // AVX-512 F/BW/VL/DQ (+ AVX2, FMA, F16C)
};

std::string_view isa_name(CpuIsa isa);

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512bf16 = false;  // reported for information; no kernel relies on it
};

// What this CPU (and the OS, which must save the wide registers) supports.
const CpuFeatures& cpu_features();

// Whether the kernels for `isa` may run here.
bool cpu_supports(CpuIsa isa);

// The widest instruction set cpu_supports().
CpuIsa best_cpu_isa();

}  // namespace kiln::cpu
