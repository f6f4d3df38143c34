#include "backend/cpu/cpu_features.h"

#include <cpuid.h>

namespace kiln::cpu {

std::string_view isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Scalar: return "scalar";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Avx512: return "avx512";
  }
  return "?";
}

namespace {

CpuFeatures detect() {
  // libgcc's __builtin_cpu_supports reports a feature only when XGETBV shows the OS saves its
  // register state, so an AVX-512 CPU under an OS that disables it reads as unsupported.
  __builtin_cpu_init();
  CpuFeatures features;
  features.avx2 = __builtin_cpu_supports("avx2");
  features.fma = __builtin_cpu_supports("fma");
  // clang before 16 has no "f16c" for __builtin_cpu_supports (the fuzz build uses clang 14), so
  // it is read from CPUID leaf 1; F16C works on the AVX register state the avx2 flag checks.
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  features.f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  features.avx512f = __builtin_cpu_supports("avx512f");
  features.avx512bw = __builtin_cpu_supports("avx512bw");
  features.avx512vl = __builtin_cpu_supports("avx512vl");
  features.avx512dq = __builtin_cpu_supports("avx512dq");
  features.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  return features;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

bool cpu_supports(CpuIsa isa) {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  switch (isa) {
    case CpuIsa::Scalar: return true;
    case CpuIsa::Avx2: return avx2;
    // Every flag the *_avx512.cpp files are compiled with except BF16, which no kernel uses.
    case CpuIsa::Avx512: return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  }
  return false;
}

CpuIsa best_cpu_isa() {
  if (cpu_supports(CpuIsa::Avx512)) return CpuIsa::Avx512;
  if (cpu_supports(CpuIsa::Avx2)) return CpuIsa::Avx2;
  return CpuIsa::Scalar;
}

}  // namespace kiln::cpu
