// The tiling loop shared by the SIMD matmul kernels (internal; included only by *_avx2.cpp and
// *_avx512.cpp, whose instantiations stay local to their file).
//
// A thread's columns are walked in panels small enough to stay in L2 while every block of rows
// passes over them, so prefill reads each weight from memory once per panel, not once per row.
// Tiles change only which elements are computed together, never the order inside one element.
#pragma once

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

}  // namespace
}  // namespace kiln::cpu
