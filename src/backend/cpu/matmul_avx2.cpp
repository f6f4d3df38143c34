// AVX2 matmul: 8-lane f32 accumulators; weights widened to f32 in registers, never in memory.
#include <immintrin.h>

#include <cstring>

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/matmul_tiles.h"
#include "backend/cpu/simd_avx2.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kBlockK = 16;  // two halves of 8 lanes
constexpr int kLanes = 8;
// 3 rows × 3 columns = 9 accumulators + 3 widened weights + 1 row of x + the bf16 mask: 14 of 16
// ymm registers.
constexpr int kTileRows = 3;
constexpr int kTileCols = 3;

// A final partial block is copied into a zeroed block first, so no byte past the row is read.
template <class Weights>
__m256 partial_half(const typename Weights::Element* w, int h, int64_t valid) {
  typename Weights::Element block[kBlockK] = {};
  std::memcpy(block, w, static_cast<size_t>(valid) * sizeof block[0]);
  return Weights::half(block, h);
}

struct F32Weights {
  using Element = float;
  static __m256 half(const float* w, int h) { return _mm256_loadu_ps(w + kLanes * h); }
};

struct F16Weights {
  using Element = uint16_t;
  static __m256 half(const uint16_t* w, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kLanes * h)));
  }
};

// A bf16 is the top half of an f32: of 16 bf16 read as 8 32-bit pairs, shifting left by 16 gives
// the even-k weights exactly and clearing the low half the odd-k ones (x is packed to match).
struct Bf16Weights {
  using Element = uint16_t;
  static __m256 half(const uint16_t* w, int h) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(pairs, 16)
                                      : _mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xffff0000u))));
  }
};

template <class Weights>
struct Tiles {
  using Element = typename Weights::Element;

  template <int Rows, int Cols>
  struct Tile {
    template <bool Partial>
    static void block(__m256 (&acc)[Rows][Cols], const float* x, int64_t x_stride, const Element* w,
                      int64_t k, int64_t k0, int64_t valid) {
      if (!Partial)
        for (int c = 0; c < Cols; ++c)
          for (int64_t line = 0; line < kBlockK * int64_t(sizeof(Element)); line += kCacheLine)
            _mm_prefetch(reinterpret_cast<const char*>(w + c * k + k0) + kPrefetchBytes + line, _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        __m256 weights[Cols];
        for (int c = 0; c < Cols; ++c)
          weights[c] = Partial ? partial_half<Weights>(w + c * k + k0, h, valid)
                               : Weights::half(w + c * k + k0, h);
        for (int r = 0; r < Rows; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * x_stride + k0 + kLanes * h);
          for (int c = 0; c < Cols; ++c) acc[r][c] = _mm256_fmadd_ps(xv, weights[c], acc[r][c]);
        }
      }
    }

    static void run(const float* x, int64_t x_stride, const Element* w, int64_t k, const float* bias,
                    float* out, int64_t out_stride) {
      __m256 acc[Rows][Cols];
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) acc[r][c] = _mm256_setzero_ps();
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

const MatmulKernels& matmul_kernels_avx2() {
  static const MatmulKernels kernels{kBlockK, kTileCols, true, &columns};
  return kernels;
}

}  // namespace kiln::cpu
