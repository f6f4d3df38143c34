// The tiling loop and the tiles shared by the SIMD matmul kernels (internal; included only by
// *_avx2.cpp and *_avx512.cpp, whose instantiations stay local to their file).
//
// A thread's columns are walked in panels small enough to stay in L2 while every block of rows
// passes over them, so prefill reads each weight from memory once per panel, not once per row.
// Tiles change only which elements are computed together, never the order inside one element.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "backend/cpu/matmul_kernels.h"
#include "core/dtype.h"

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

// Every tile<Rows, Cols> for Rows in [1, MaxRows], Cols in [1, MaxCols], so the edges of the
// matrix run the same per-element code as its interior.
template <class TileFn, int MaxRows, int MaxCols, template <int, int> class Tile>
struct TileTable {
  TileFn tiles[MaxRows][MaxCols];
  constexpr TileTable() : tiles{} { fill(std::make_integer_sequence<int, MaxRows * MaxCols>{}); }
  template <int... Index>
  constexpr void fill(std::integer_sequence<int, Index...>) {
    ((tiles[Index / MaxCols][Index % MaxCols] = &Tile<Index / MaxCols + 1, Index % MaxCols + 1>::run), ...);
  }
};

// Tile<Rows, Cols> computes Rows × Cols outputs, one accumulator each, block by block of K. Matmul
// names an instruction set's lanes (simd_avx2.h, simd_avx512.h) plus its kBlockK (two halves of
// kLanes) and its largest tile (kTileRows × kTileCols). Weights says where a column's weights are
// and how half h of a block loads as kLanes f32 weights:
//   Source (built from the operands), row_bytes(op) (bytes a column's row reads),
//   segment(source): the span of K (a multiple of kBlockK) one cursor covers, e.g. a quantization
//   group, so what a group shares (its scale) is read once per group, not once per block,
//   Cursor at(source, column, s0) (the segment starting at s0 of a column),
//   prefetch(cursor, offset), half(cursor, offset, h) for the block at `offset` in the segment,
//   and partial_half(cursor, offset, h, valid) for a final block of `valid` (< kBlockK) elements
//   that reads no byte past the row and yields 0 past `valid`; kMayEndInPartialBlock says whether
//   K can leave such a block; natural_lanes(acc) puts an accumulator's lanes back in natural order
//   where x was packed in another (MatmulKernels::nibbles_interleaved).
// Segments change only where weights are read from, never the order of the blocks.
template <class Matmul, class Weights>
struct SimdTiles {
  using Source = typename Weights::Source;
  using Floats = typename Matmul::Floats;
  using TileFn = void (*)(const float* x, int64_t x_stride, const Source& w, int64_t column, int64_t k,
                          const float* bias, float* out, int64_t out_stride);
  template <int Cols>
  using Cursors = std::array<typename Weights::Cursor, Cols>;

  template <int... Column>
  static Cursors<sizeof...(Column)> cursors_at(const Source& w, int64_t column, int64_t s0,
                                               std::integer_sequence<int, Column...>) {
    return {Weights::at(w, column + Column, s0)...};
  }

  template <int Rows, int Cols>
  struct Tile {
    template <bool Partial>
    static void block(Floats (&acc)[Rows][Cols], const float* x, int64_t x_stride, const Cursors<Cols>& cursors,
                      int64_t k0, int64_t offset, int64_t valid) {
      if (!Partial)
        for (int c = 0; c < Cols; ++c) Weights::prefetch(cursors[c], offset);
      for (int h = 0; h < 2; ++h) {
        Floats weights[Cols];
        for (int c = 0; c < Cols; ++c) {
          if constexpr (Partial)
            weights[c] = Weights::partial_half(cursors[c], offset, h, valid);
          else
            weights[c] = Weights::half(cursors[c], offset, h);
        }
        for (int r = 0; r < Rows; ++r) {
          const Floats xv = Matmul::load(x + r * x_stride + k0 + Matmul::kLanes * h);
          for (int c = 0; c < Cols; ++c) acc[r][c] = Matmul::fmadd(xv, weights[c], acc[r][c]);
        }
      }
    }

    static void run(const float* x, int64_t x_stride, const Source& w, int64_t column, int64_t k,
                    const float* bias, float* out, int64_t out_stride) {
      constexpr auto kColumns = std::make_integer_sequence<int, Cols>{};
      Floats acc[Rows][Cols];
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) acc[r][c] = Matmul::zero();
      const int64_t full_end = k / Matmul::kBlockK * Matmul::kBlockK;
      const int64_t segment = Weights::segment(w);
      for (int64_t s0 = 0; s0 < full_end; s0 += segment) {
        const Cursors<Cols> cursors = cursors_at(w, column, s0, kColumns);
        const int64_t s_end = s0 + segment < full_end ? s0 + segment : full_end;
        for (int64_t k0 = s0; k0 < s_end; k0 += Matmul::kBlockK)
          block<false>(acc, x, x_stride, cursors, k0, k0 - s0, Matmul::kBlockK);
      }
      if constexpr (Weights::kMayEndInPartialBlock)
        if (full_end < k) {
          const int64_t s0 = full_end / segment * segment;
          block<true>(acc, x, x_stride, cursors_at(w, column, s0, kColumns), full_end, full_end - s0, k - full_end);
        }
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) {
          const float sum = Matmul::sum(Weights::natural_lanes(acc[r][c]));
          out[r * out_stride + c] = bias ? sum + bias[c] : sum;
        }
    }
  };

  static constexpr TileTable<TileFn, Matmul::kTileRows, Matmul::kTileCols, Tile> table{};

  // A thread's columns in panels (see the top of this file), each swept by every block of rows.
  static void columns(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
    constexpr int64_t kMaxRows = Matmul::kTileRows, kMaxCols = Matmul::kTileCols;
    const Source source(op);
    const int64_t row_bytes = Weights::row_bytes(op);
    int64_t panel = kPanelWeightBytes / (row_bytes > 0 ? row_bytes : 1) / kMaxCols * kMaxCols;
    if (panel < kMaxCols) panel = kMaxCols;
    for (int64_t panel_begin = n_begin; panel_begin < n_end; panel_begin += panel) {
      const int64_t panel_end = panel_begin + panel < n_end ? panel_begin + panel : n_end;
      for (int64_t row = 0; row < op.rows; row += kMaxRows) {
        const int64_t rows = op.rows - row < kMaxRows ? op.rows - row : kMaxRows;
        for (int64_t column = panel_begin; column < panel_end; column += kMaxCols) {
          const int64_t columns = panel_end - column < kMaxCols ? panel_end - column : kMaxCols;
          table.tiles[rows - 1][columns - 1](op.x_packed + row * op.k_padded, op.k_padded, source, column, op.k,
                                             op.bias ? op.bias + column : nullptr, op.out + row * op.n + column,
                                             op.n);
        }
      }
    }
  }
};

// A dense weight: Loads (one of Matmul's F32Weights, F16Weights, Bf16Weights) loads half h of a
// block of its Element from the block's first element (Loads::half, Loads::partial_half).
template <class Matmul, class Loads>
struct DenseWeights {
  using Element = typename Loads::Element;
  static constexpr bool kMayEndInPartialBlock = true;
  struct Source {
    explicit Source(const MatmulOperands& op) : w(static_cast<const Element*>(op.w)), k(op.k) {}
    const Element* w;
    int64_t k;
  };
  using Cursor = const Element*;  // a column's row
  static int64_t row_bytes(const MatmulOperands& op) { return op.k * int64_t(sizeof(Element)); }
  static int64_t segment(const Source& source) { return (source.k + Matmul::kBlockK - 1) / Matmul::kBlockK * Matmul::kBlockK; }
  static Cursor at(const Source& source, int64_t column, int64_t s0) { return source.w + column * source.k + s0; }
  static void prefetch(Cursor w, int64_t offset) {
    for (int64_t line = 0; line < Matmul::kBlockK * int64_t(sizeof(Element)); line += kCacheLine)
      _mm_prefetch(reinterpret_cast<const char*>(w + offset) + kPrefetchBytes + line, _MM_HINT_T0);
  }
  static auto half(Cursor w, int64_t offset, int h) { return Loads::half(w + offset, h); }
  static auto partial_half(Cursor w, int64_t offset, int h, int64_t valid) { return Loads::partial_half(w + offset, h, valid); }
  static auto natural_lanes(typename Matmul::Floats acc) { return acc; }
};

// A scale or bias of dtype Scale at `index`, widened to f32 as decode_rows does.
template <DType Scale>
float widen_scale(const void* scales, int64_t index) {
  if constexpr (Scale == DType::F32) return static_cast<const float*>(scales)[index];
  if constexpr (Scale == DType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(scales)[index]);
  if constexpr (Scale == DType::F16) return f16_to_f32(static_cast<const uint16_t*>(scales)[index]);
}

// Prefetches a column's packed stream ahead when block k0 starts one of its cache lines (a block's
// codes are 8 to 32 bytes, so a line is not asked for once per block).
inline void prefetch_packed(const uint8_t* block_start, int64_t byte_offset) {
  if (byte_offset % kCacheLine == 0) _mm_prefetch(reinterpret_cast<const char*>(block_start) + kPrefetchBytes, _MM_HINT_T0);
}

// An affine weight of Bits (4 or 8) with scales and biases of dtype Scale; a segment is one group.
// The instruction set decodes: Matmul::AffineGroup<Bits> is made once per group from its scale and
// bias, and its half(p) yields the kLanes weights whose codes start at byte p, each
// fma(scale, q, bias) exactly. K is a multiple of the group size (≥ 32, a multiple of every
// kBlockK), so a block never ends partial.
template <int Bits, DType Scale, class Matmul>
struct AffineWeights {
  static constexpr bool kMayEndInPartialBlock = false;
  using Floats = typename Matmul::Floats;
  using Group = typename Matmul::template AffineGroup<Bits>;
  struct Source {
    explicit Source(const MatmulOperands& op)
        : codes(static_cast<const uint8_t*>(op.quantized->values().raw())),
          scales(op.quantized->scales().raw()),
          biases(op.quantized->biases().raw()),
          row_code_bytes(op.k * Bits / 8),
          groups(op.quantized->scales().dim(1)),
          group_size(op.quantized->group_size()) {}
    const uint8_t* codes;
    const void* scales;
    const void* biases;
    int64_t row_code_bytes, groups, group_size;
  };
  struct Cursor {
    const uint8_t* codes;  // the group's first code
    int64_t byte_offset;   // of that code in its row
    Group group;
  };
  static int64_t row_bytes(const MatmulOperands& op) { return static_cast<int64_t>(op.quantized->row_nbytes()); }
  static int64_t segment(const Source& s) { return s.group_size; }
  static Cursor at(const Source& s, int64_t column, int64_t s0) {
    const int64_t group = column * s.groups + s0 / s.group_size;
    const int64_t offset = s0 * Bits / 8;
    return {s.codes + column * s.row_code_bytes + offset, offset,
            Group(widen_scale<Scale>(s.scales, group), widen_scale<Scale>(s.biases, group))};
  }
  static void prefetch(const Cursor& cursor, int64_t offset) {
    prefetch_packed(cursor.codes + offset * Bits / 8, cursor.byte_offset + offset * Bits / 8);
  }
  static Floats half(const Cursor& cursor, int64_t offset, int h) {
    return cursor.group.half(cursor.codes + (offset + Matmul::kLanes * h) * Bits / 8);
  }
  static Floats natural_lanes(Floats acc) { return Group::natural_lanes(acc); }
};

// An fp8 block weight with scale_inv of dtype Scale; a segment is one scale block's columns, a
// multiple of 32 (has_quantized_kernel), so every block has one scale. Matmul::fp8(p) and
// Matmul::partial_fp8(p, valid) widen kLanes e4m3 bytes to their exact f32 values;
// Matmul::zero_from(v, valid) zeroes lanes from `valid` on (so a scale of inf or NaN cannot turn
// the padding into NaN).
template <DType Scale, class Matmul>
struct Fp8BlockWeights {
  static constexpr bool kMayEndInPartialBlock = true;
  using Floats = typename Matmul::Floats;
  struct Source {
    explicit Source(const MatmulOperands& op)
        : values(static_cast<const uint8_t*>(op.quantized->values().raw())),
          scales(op.quantized->scales().raw()),
          k(op.k),
          scale_columns(op.quantized->scales().dim(1)),
          block_rows(op.quantized->block_rows()),
          block_columns(op.quantized->block_columns()) {}
    const uint8_t* values;
    const void* scales;
    int64_t k, scale_columns, block_rows, block_columns;
  };
  struct Cursor {
    const uint8_t* values;  // the scale block's first value in the row
    int64_t byte_offset;    // of that value in its row
    Floats scale;
  };
  static int64_t row_bytes(const MatmulOperands& op) { return static_cast<int64_t>(op.quantized->row_nbytes()); }
  static int64_t segment(const Source& s) { return s.block_columns; }
  static Cursor at(const Source& s, int64_t column, int64_t s0) {
    const float scale = widen_scale<Scale>(s.scales, column / s.block_rows * s.scale_columns + s0 / s.block_columns);
    return {s.values + column * s.k + s0, s0, Matmul::broadcast(scale)};
  }
  static void prefetch(const Cursor& cursor, int64_t offset) {
    prefetch_packed(cursor.values + offset, cursor.byte_offset + offset);
  }
  static Floats half(const Cursor& cursor, int64_t offset, int h) {
    return Matmul::mul(Matmul::fp8(cursor.values + offset + Matmul::kLanes * h), cursor.scale);
  }
  static Floats partial_half(const Cursor& cursor, int64_t offset, int h, int64_t valid) {
    const int64_t past_half = valid - Matmul::kLanes * h;
    if (past_half <= 0) return Matmul::zero();
    const int64_t in_half = past_half < Matmul::kLanes ? past_half : Matmul::kLanes;
    return Matmul::zero_from(
        Matmul::mul(Matmul::partial_fp8(cursor.values + offset + Matmul::kLanes * h, in_half), cursor.scale), in_half);
  }
  static Floats natural_lanes(Floats acc) { return acc; }
};

template <class Matmul, DType Scale>
void quantized_columns_of(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
  const Weight& w = *op.quantized;
  if (w.format() == WeightFormat::Fp8Block) {
    if constexpr (Scale != DType::F16)  // weight_scale_inv is F32 or BF16 (Weight::fp8_block)
      SimdTiles<Matmul, Fp8BlockWeights<Scale, Matmul>>::columns(op, n_begin, n_end);
    return;
  }
  if (w.bits() == 4) return SimdTiles<Matmul, AffineWeights<4, Scale, Matmul>>::columns(op, n_begin, n_end);
  SimdTiles<Matmul, AffineWeights<8, Scale, Matmul>>::columns(op, n_begin, n_end);
}

// MatmulKernels::columns for the instruction set Matmul describes (see SimdTiles).
template <class Matmul>
void simd_matmul_columns(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
  if (op.quantized) {
    switch (op.quantized->scales().dtype()) {
      case DType::F32: return quantized_columns_of<Matmul, DType::F32>(op, n_begin, n_end);
      case DType::BF16: return quantized_columns_of<Matmul, DType::BF16>(op, n_begin, n_end);
      case DType::F16: return quantized_columns_of<Matmul, DType::F16>(op, n_begin, n_end);
      default: return;  // Weight's constructors admit no other scale dtype
    }
  }
  switch (op.w_dtype) {
    case DType::F32: return SimdTiles<Matmul, DenseWeights<Matmul, typename Matmul::F32Weights>>::columns(op, n_begin, n_end);
    case DType::F16: return SimdTiles<Matmul, DenseWeights<Matmul, typename Matmul::F16Weights>>::columns(op, n_begin, n_end);
    case DType::BF16: return SimdTiles<Matmul, DenseWeights<Matmul, typename Matmul::Bf16Weights>>::columns(op, n_begin, n_end);
    default: return;  // rejected by matmul() before any kernel runs
  }
}

}  // namespace
}  // namespace kiln::cpu
