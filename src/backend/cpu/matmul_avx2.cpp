// AVX2 matmul: 8-lane f32 accumulators; weights widened to f32 in registers, never in memory.
#include <immintrin.h>

#include <cstring>

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/matmul_tiles.h"
#include "backend/cpu/simd_avx2.h"

namespace kiln::cpu {
namespace {

struct Avx2Matmul : Avx2Lanes {
  static constexpr int64_t kBlockK = 16;  // two halves of 8 lanes
  // 3 rows × 3 columns = 9 accumulators + 3 widened weights + 1 row of x + the bf16 mask: 14 of 16
  // ymm registers.
  static constexpr int kTileRows = 3;
  static constexpr int kTileCols = 3;

  // A final partial block is copied into a zeroed block first, so no byte past the row is read.
  template <class Weights>
  struct CopiedPartialBlock {
    template <class Element>
    static __m256 partial_half(const Element* w, int h, int64_t valid) {
      Element block[kBlockK] = {};
      std::memcpy(block, w, static_cast<size_t>(valid) * sizeof block[0]);
      return Weights::half(block, h);
    }
  };

  struct F32Weights : CopiedPartialBlock<F32Weights> {
    using Element = float;
    static __m256 half(const float* w, int h) { return _mm256_loadu_ps(w + kLanes * h); }
  };

  struct F16Weights : CopiedPartialBlock<F16Weights> {
    using Element = uint16_t;
    static __m256 half(const uint16_t* w, int h) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kLanes * h)));
    }
  };

  // A bf16 is the top half of an f32: of 16 bf16 read as 8 32-bit pairs, shifting left by 16 gives
  // the even-k weights exactly and clearing the low half the odd-k ones (x is packed to match).
  struct Bf16Weights : CopiedPartialBlock<Bf16Weights> {
    using Element = uint16_t;
    static __m256 half(const uint16_t* w, int h) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      return _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(pairs, 16)
                                        : _mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xffff0000u))));
    }
  };

  // A group's scale and bias; half(p) decodes the 8 codes from byte p (code i at bits
  // [i·Bits, (i+1)·Bits) of the little-endian stream) to fma(scale, q, bias), exactly. 4 bits: the
  // word in every lane, lane i shifted right by 4·i.
  template <int Bits>
  struct AffineGroup {
    AffineGroup(float scale, float bias) : scale(_mm256_set1_ps(scale)), bias(_mm256_set1_ps(bias)) {}
    __m256 half(const uint8_t* bytes) const {
      __m256i codes;
      if constexpr (Bits == 8) {
        codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
      } else {
        uint32_t word;
        std::memcpy(&word, bytes, sizeof word);
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(word)), shifts),
                                 _mm256_set1_epi32(0xf));
      }
      return _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(codes), bias);
    }
    static __m256 natural_lanes(__m256 acc) { return acc; }  // x is packed in natural order
    __m256 scale, bias;
  };

  // 8 e4m3 bytes as their f32 values, through fp8_e4m3_table.
  static __m256 fp8(const uint8_t* bytes) {
    return _mm256_i32gather_ps(fp8_e4m3_table(), _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))), 4);
  }
  static __m256 partial_fp8(const uint8_t* bytes, int64_t valid) {
    uint8_t half[kLanes] = {};
    std::memcpy(half, bytes, static_cast<size_t>(valid));
    return fp8(half);
  }
  static __m256 zero_from(__m256 v, int64_t valid) { return _mm256_and_ps(v, _mm256_castsi256_ps(lane_mask(valid))); }
};

}  // namespace

const MatmulKernels& matmul_kernels_avx2() {
  static const MatmulKernels kernels{Avx2Matmul::kBlockK, Avx2Matmul::kTileCols, true, false,
                                     &simd_matmul_columns<Avx2Matmul>};
  return kernels;
}

}  // namespace kiln::cpu
