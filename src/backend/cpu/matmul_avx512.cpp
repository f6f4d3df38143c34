// AVX-512 matmul: 16-lane f32 accumulators; weights widened to f32 in registers, never in memory.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/matmul_tiles.h"
#include "backend/cpu/simd_avx512.h"

namespace kiln::cpu {
namespace {

struct Avx512Matmul : Avx512Lanes {
  static constexpr int64_t kBlockK = 32;  // two halves of 16 lanes
  // 4 rows × 6 columns = 24 accumulators + 6 widened weights + 1 row of x: 31 of 32 zmm registers.
  static constexpr int kTileRows = 4;
  static constexpr int kTileCols = 6;

  // A final partial block is read through a mask, so no byte past the row is touched (masked lanes
  // are 0).
  struct F32Weights {
    using Element = float;
    static __m512 half(const float* w, int h) { return _mm512_loadu_ps(w + kLanes * h); }
    static __m512 partial_half(const float* w, int h, int64_t valid) {
      return _mm512_maskz_loadu_ps(lane_mask(valid - kLanes * h), w + kLanes * h);
    }
  };

  struct F16Weights {
    using Element = uint16_t;
    static __m512 half(const uint16_t* w, int h) {
      return _mm512_maskz_cvtph_ps(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kLanes * h)));
    }
    static __m512 partial_half(const uint16_t* w, int h, int64_t valid) {
      return _mm512_maskz_cvtph_ps(kAllLanes,
                                   _mm256_maskz_loadu_epi16(lane_mask(valid - kLanes * h), w + kLanes * h));
    }
  };

  // A bf16 is the top half of an f32. Read 32 of them as 16 32-bit pairs: shifting each pair left
  // by 16 gives the even-k weights exactly, clearing its low half gives the odd-k ones — one integer
  // op per 16 weights (x is packed even/odd to match, see bf16_pairs_split).
  struct Bf16Weights {
    using Element = uint16_t;
    static __m512 widen(__m512i pairs, int h) {
      return _mm512_castsi512_ps(h == 0 ? _mm512_maskz_slli_epi32(kAllLanes, pairs, 16)
                                        : _mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xffff0000u))));
    }
    static __m512 half(const uint16_t* w, int h) { return widen(_mm512_loadu_si512(w), h); }
    static __m512 partial_half(const uint16_t* w, int h, int64_t valid) {
      return widen(_mm512_maskz_loadu_epi16(__mmask32((uint64_t{1} << valid) - 1), w), h);
    }
  };

  // A group's 16 4-bit weights w[q] = fma(scale, q, bias), one per lane: a half's weights are then
  // one permute of them by its codes (the permute reads the low 4 bits of each lane, so the codes
  // need no mask), exactly the values of the per-element fma.
  struct NibbleGroup {
    NibbleGroup(float scale, float bias)
        : weights(_mm512_fmadd_ps(_mm512_set1_ps(scale),
                                  _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                  _mm512_set1_ps(bias))) {}
    // The 16 codes from `bytes` (code i at bits [4i, 4i + 4) of the little-endian stream) in the
    // lane order 0, 8, 1, 9, …, 7, 15 (nibbles_interleaved): the 64-bit word broadcast puts codes
    // 0-7 in every even lane and 8-15 in every odd one, and lanes 2m and 2m + 1 shift by 4m.
    __m512 half(const uint8_t* bytes) const {
      int64_t word;
      std::memcpy(&word, bytes, sizeof word);
      const __m512i shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
      return _mm512_maskz_permutexvar_ps(kAllLanes, _mm512_maskz_srlv_epi32(kAllLanes, _mm512_set1_epi64(word), shifts),
                                         weights);
    }
    // The accumulator's lanes in natural order (lane 2m holds natural lane m, 2m + 1 lane 8 + m).
    static __m512 natural_lanes(__m512 acc) {
      return _mm512_maskz_permutexvar_ps(
          kAllLanes, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), acc);
    }
    __m512 weights;
  };

  // 8 bits: the 16 bytes widened and converted, then fma(scale, q, bias).
  struct ByteGroup {
    ByteGroup(float scale, float bias) : scale(_mm512_set1_ps(scale)), bias(_mm512_set1_ps(bias)) {}
    __m512 half(const uint8_t* bytes) const {
      const __m512i codes = _mm512_maskz_cvtepu8_epi32(kAllLanes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      return _mm512_fmadd_ps(scale, _mm512_maskz_cvtepi32_ps(kAllLanes, codes), bias);
    }
    static __m512 natural_lanes(__m512 acc) { return acc; }  // x is packed in natural order
    __m512 scale, bias;
  };

  template <int Bits>
  using AffineGroup = std::conditional_t<Bits == 4, NibbleGroup, ByteGroup>;

  // 16 e4m3 bytes as their f32 values, through fp8_e4m3_table.
  static __m512 fp8_of(__m128i bytes) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), kAllLanes, _mm512_maskz_cvtepu8_epi32(kAllLanes, bytes),
                                    fp8_e4m3_table(), 4);
  }
  static __m512 fp8(const uint8_t* bytes) { return fp8_of(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))); }
  static __m512 partial_fp8(const uint8_t* bytes, int64_t valid) {
    return fp8_of(_mm_maskz_loadu_epi8(lane_mask(valid), bytes));
  }
  static __m512 zero_from(__m512 v, int64_t valid) { return _mm512_maskz_mov_ps(lane_mask(valid), v); }
};

}  // namespace

const MatmulKernels& matmul_kernels_avx512() {
  static const MatmulKernels kernels{Avx512Matmul::kBlockK, Avx512Matmul::kTileCols, true, true,
                                     &simd_matmul_columns<Avx512Matmul>};
  return kernels;
}

}  // namespace kiln::cpu
