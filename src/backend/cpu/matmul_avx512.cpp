// AVX-512 matmul: 16-lane f32 accumulators; weights widened to f32 in registers, never in memory.
#include <immintrin.h>

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/matmul_tiles.h"
#include "backend/cpu/simd_avx512.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kBlockK = 32;  // two halves of 16 lanes
constexpr int kLanes = 16;
// 4 rows × 6 columns = 24 accumulators + 6 widened weights + 1 row of x: 31 of 32 zmm registers.
constexpr int kTileRows = 4;
constexpr int kTileCols = 6;

// Each weight type loads half h of a block as 16 f32 lanes; `valid` (< kBlockK) marks a final
// partial block, read through a mask so no byte past the row is touched (masked lanes are 0).
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
    return _mm512_maskz_cvtph_ps(kAllLanes, _mm256_maskz_loadu_epi16(lane_mask(valid - kLanes * h), w + kLanes * h));
  }
};

// A bf16 is the top half of an f32. Read 32 of them as 16 32-bit pairs: shifting each pair left by
// 16 gives the even-k weights exactly, clearing its low half gives the odd-k ones — one integer op
// per 16 weights (x is packed even/odd to match, see bf16_pairs_split).
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

template <class Weights>
struct Tiles {
  using Element = typename Weights::Element;

  template <int Rows, int Cols>
  struct Tile {
    template <bool Partial>
    static void block(__m512 (&acc)[Rows][Cols], const float* x, int64_t x_stride, const Element* w,
                      int64_t k, int64_t k0, int64_t valid) {
      if (!Partial)
        for (int c = 0; c < Cols; ++c)
          for (int64_t line = 0; line < kBlockK * int64_t(sizeof(Element)); line += kCacheLine)
            _mm_prefetch(reinterpret_cast<const char*>(w + c * k + k0) + kPrefetchBytes + line, _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        __m512 weights[Cols];
        for (int c = 0; c < Cols; ++c)
          weights[c] = Partial ? Weights::partial_half(w + c * k + k0, h, valid)
                               : Weights::half(w + c * k + k0, h);
        for (int r = 0; r < Rows; ++r) {
          const __m512 xv = _mm512_loadu_ps(x + r * x_stride + k0 + kLanes * h);
          for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_fmadd_ps(xv, weights[c], acc[r][c]);
        }
      }
    }

    static void run(const float* x, int64_t x_stride, const Element* w, int64_t k, const float* bias,
                    float* out, int64_t out_stride) {
      __m512 acc[Rows][Cols];
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
      const int64_t full_end = k / kBlockK * kBlockK;
      for (int64_t k0 = 0; k0 < full_end; k0 += kBlockK) block<false>(acc, x, x_stride, w, k, k0, kBlockK);
      if (full_end < k) block<true>(acc, x, x_stride, w, k, full_end, k - full_end);
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) {
          const float sum = sum_lanes(acc[r][c]);
          out[r * out_stride + c] = bias ? sum + bias[c] : sum;
        }
    }
  };

  static constexpr TileTable<Element, kTileRows, kTileCols, Tile> table{};

  static void columns(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
    run_tiled_columns<Element, kTileRows, kTileCols>(table, op, n_begin, n_end);
  }
};

void columns(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
  switch (op.w_dtype) {
    case DType::F32: return Tiles<F32Weights>::columns(op, n_begin, n_end);
    case DType::F16: return Tiles<F16Weights>::columns(op, n_begin, n_end);
    case DType::BF16: return Tiles<Bf16Weights>::columns(op, n_begin, n_end);
    case DType::I32: return;  // rejected by matmul() before any kernel runs
  }
}

}  // namespace

const MatmulKernels& matmul_kernels_avx512() {
  static const MatmulKernels kernels{kBlockK, kTileCols, true, &columns};
  return kernels;
}

}  // namespace kiln::cpu
