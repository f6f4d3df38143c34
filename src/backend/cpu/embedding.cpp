// Row gathers: embedding (rows of a table in its stored dtype, widened to f32) and gather_rows.
#include <cstring>

#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {

void embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  constexpr std::string_view op = "embedding";
  require_weight_dtype(table, op, "table");
  if (table.ndim() != 2) fail("embedding: table has shape {}, expected [vocab, hidden]", shape_string(table.shape()));
  const int64_t vocab = table.dim(0);
  const int64_t hidden = table.dim(1);
  require_dtype(ids, DType::I32, op, "ids");
  if (ids.ndim() != 1) fail("embedding: ids has shape {}, expected [T]", shape_string(ids.shape()));
  const int64_t tokens = ids.dim(0);
  require_dtype(out, DType::F32, op, "out");
  require_shape(out, {tokens, hidden}, op, "out");
  const int32_t* token_ids = ids.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    if (token_ids[t] < 0 || token_ids[t] >= vocab)
      fail("embedding: token id {} (at index {}) is outside the vocabulary of {} tokens", token_ids[t], t, vocab);
  float* rows = out.data<float>();
  ThreadPool::global().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      widen_to_f32(table.raw(), table.dtype(), token_ids[t] * hidden, hidden, rows + t * hidden);
  });
}

void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) {
  constexpr std::string_view op = "gather_rows";
  require_dtype(x, DType::F32, op, "x");
  if (x.ndim() < 1) fail("gather_rows: x is a scalar, expected rows along axis 0");
  const int64_t available = x.dim(0);
  const int64_t width = available ? x.numel() / available : 0;
  require_dtype(rows, DType::I32, op, "rows");
  if (rows.ndim() != 1) fail("gather_rows: rows has shape {}, expected [R]", shape_string(rows.shape()));
  require_dtype(out, DType::F32, op, "out");
  if (out.ndim() < 1 || out.dim(0) != rows.dim(0) || out.numel() != rows.dim(0) * width)
    fail("gather_rows: out has shape {}, expected {} rows of {} elements", shape_string(out.shape()), rows.dim(0),
         width);
  const int32_t* indices = rows.data<int32_t>();
  for (int64_t r = 0; r < rows.dim(0); ++r)
    if (indices[r] < 0 || indices[r] >= available)
      fail("gather_rows: row index {} (at {}) is outside x's {} rows", indices[r], r, available);
  for (int64_t r = 0; r < rows.dim(0); ++r)
    std::memcpy(out.data<float>() + r * width, x.data<float>() + indices[r] * width,
                static_cast<size_t>(width) * sizeof(float));
}

}  // namespace kiln::cpu
