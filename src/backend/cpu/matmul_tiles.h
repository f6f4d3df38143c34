// The tiling loop and the tiles shared by the SIMD matmul kernels (internal; included only by
// *_avx2.cpp and *_avx512.cpp, whose instantiations stay local to their file).
//
// A thread's columns are walked in panels small enough to stay in L2 while every block of rows
// passes over them, so prefill reads each weight from memory once per panel, not once per row.
// Tiles change only which elements are computed together, never the order inside one element.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "backend/cpu/matmul_kernels.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kCacheLine = 64;
// How far ahead of its reads each column's weight stream is prefetched into L1. Decode reads every
// weight once, in as many streams as a tile has columns, and the hardware prefetchers alone left
// bf16 GEMV near 65 % of copy bandwidth on a 2-core Sapphire Rapids VM; of 512, 1024 and 2048 bytes
// ahead, 1024 (16 lines in flight per stream) measured best there.
constexpr int64_t kPrefetchBytes = 1024;

// Weight bytes of one column panel: a share of a 1-2 MiB L2 that leaves room for rows of x.
constexpr int64_t kPanelWeightBytes = int64_t{768} << 10;

template <class Element>
using TileFn = void (*)(const float* x, int64_t x_stride, const Element* w, int64_t k,
                        const float* bias, float* out, int64_t out_stride);

// Every tile<Rows, Cols> for Rows in [1, MaxRows], Cols in [1, MaxCols], so the edges of the
// matrix run the same per-element code as its interior.
template <class Element, int MaxRows, int MaxCols, template <int, int> class Tile>
struct TileTable {
  TileFn<Element> tiles[MaxRows][MaxCols];
  constexpr TileTable() : tiles{} { fill(std::make_integer_sequence<int, MaxRows * MaxCols>{}); }
  template <int... Index>
  constexpr void fill(std::integer_sequence<int, Index...>) {
    ((tiles[Index / MaxCols][Index % MaxCols] = &Tile<Index / MaxCols + 1, Index % MaxCols + 1>::run), ...);
  }
};

template <class Element, int MaxRows, int MaxCols, class Table>
void run_tiled_columns(const Table& table, const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
  const auto* w = static_cast<const Element*>(op.w);
  const int64_t row_bytes = op.k * static_cast<int64_t>(sizeof(Element));
  int64_t panel = kPanelWeightBytes / (row_bytes > 0 ? row_bytes : 1) / MaxCols * MaxCols;
  if (panel < MaxCols) panel = MaxCols;
  for (int64_t panel_begin = n_begin; panel_begin < n_end; panel_begin += panel) {
    const int64_t panel_end = panel_begin + panel < n_end ? panel_begin + panel : n_end;
    for (int64_t row = 0; row < op.rows; row += MaxRows) {
      const int64_t rows = op.rows - row < MaxRows ? op.rows - row : MaxRows;
      for (int64_t column = panel_begin; column < panel_end; column += MaxCols) {
        const int64_t columns = panel_end - column < MaxCols ? panel_end - column : MaxCols;
        table.tiles[rows - 1][columns - 1](op.x_packed + row * op.k_padded, op.k_padded,
                                           w + column * op.k, op.k, op.bias ? op.bias + column : nullptr,
                                           op.out + row * op.n + column, op.n);
      }
    }
  }
}

// Tile<Rows, Cols> computes Rows × Cols outputs, one accumulator each, block by block of K. Matmul
// names an instruction set's lanes (simd_avx2.h, simd_avx512.h) plus its kBlockK (two halves of
// kLanes), its largest tile (kTileRows × kTileCols) and how each weight dtype loads half h of a
// block as kLanes floats: Weights::half, and Weights::partial_half for a final block of `valid`
// (< kBlockK) elements that reads no byte past the row.
template <class Matmul, class Weights>
struct SimdTiles {
  using Element = typename Weights::Element;
  using Floats = typename Matmul::Floats;

  template <int Rows, int Cols>
  struct Tile {
    template <bool Partial>
    static void block(Floats (&acc)[Rows][Cols], const float* x, int64_t x_stride, const Element* w,
                      int64_t k, int64_t k0, int64_t valid) {
      if (!Partial)
        for (int c = 0; c < Cols; ++c)
          for (int64_t line = 0; line < Matmul::kBlockK * int64_t(sizeof(Element)); line += kCacheLine)
            _mm_prefetch(reinterpret_cast<const char*>(w + c * k + k0) + kPrefetchBytes + line, _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        Floats weights[Cols];
        for (int c = 0; c < Cols; ++c)
          weights[c] = Partial ? Weights::partial_half(w + c * k + k0, h, valid)
                               : Weights::half(w + c * k + k0, h);
        for (int r = 0; r < Rows; ++r) {
          const Floats xv = Matmul::load(x + r * x_stride + k0 + Matmul::kLanes * h);
          for (int c = 0; c < Cols; ++c) acc[r][c] = Matmul::fmadd(xv, weights[c], acc[r][c]);
        }
      }
    }

    static void run(const float* x, int64_t x_stride, const Element* w, int64_t k, const float* bias,
                    float* out, int64_t out_stride) {
      Floats acc[Rows][Cols];
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) acc[r][c] = Matmul::zero();
      const int64_t full_end = k / Matmul::kBlockK * Matmul::kBlockK;
      for (int64_t k0 = 0; k0 < full_end; k0 += Matmul::kBlockK)
        block<false>(acc, x, x_stride, w, k, k0, Matmul::kBlockK);
      if (full_end < k) block<true>(acc, x, x_stride, w, k, full_end, k - full_end);
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) {
          const float sum = Matmul::sum(acc[r][c]);
          out[r * out_stride + c] = bias ? sum + bias[c] : sum;
        }
    }
  };

  static constexpr TileTable<Element, Matmul::kTileRows, Matmul::kTileCols, Tile> table{};

  static void columns(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
    run_tiled_columns<Element, Matmul::kTileRows, Matmul::kTileCols>(table, op, n_begin, n_end);
  }
};

// MatmulKernels::columns for the instruction set Matmul describes (see SimdTiles).
template <class Matmul>
void simd_matmul_columns(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
  switch (op.w_dtype) {
    case DType::F32: return SimdTiles<Matmul, typename Matmul::F32Weights>::columns(op, n_begin, n_end);
    case DType::F16: return SimdTiles<Matmul, typename Matmul::F16Weights>::columns(op, n_begin, n_end);
    case DType::BF16: return SimdTiles<Matmul, typename Matmul::Bf16Weights>::columns(op, n_begin, n_end);
    case DType::I32: return;  // rejected by matmul() before any kernel runs
  }
}

}  // namespace
}  // namespace kiln::cpu
