// make_layout: validates a step's sequence spans and fills the host tensors kernels read.
#include <algorithm>
#include <limits>
#include <numeric>
#include <set>

#include "backend/cpu/ops.h"
#include "core/error.h"

namespace kiln::cpu {

BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) {
  const auto total_tokens = static_cast<int64_t>(token_ids.size());
  if (total_tokens > std::numeric_limits<int32_t>::max())
    fail("make_layout: {} tokens do not fit a 32-bit index", total_tokens);
  std::set<int32_t> slots_seen;
  for (size_t i = 0; i < spans.size(); ++i) {
    const SequenceSpan& span = spans[i];
    if (span.slot < 0 || span.first_token < 0 || span.first_position < 0 || span.tokens <= 0)
      fail("make_layout: span {} (slot {}, first_token {}, tokens {}, first_position {}) needs a slot, first "
           "token and first position >= 0 and at least one token",
           i, span.slot, span.first_token, span.tokens, span.first_position);
    if (int64_t{span.first_position} + span.tokens - 1 > std::numeric_limits<int32_t>::max())
      fail("make_layout: span {} reaches position {}, past the 32-bit position range", i,
           int64_t{span.first_position} + span.tokens - 1);
    if (!slots_seen.insert(span.slot).second)
      fail("make_layout: slot {} appears in more than one span of the batch", span.slot);
  }
  // Spans may come in any order, but together they must tile [0, total_tokens) exactly.
  std::vector<size_t> order(spans.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return spans[a].first_token < spans[b].first_token; });
  int64_t covered = 0;
  for (size_t index : order) {
    if (spans[index].first_token != covered)
      fail("make_layout: span {} starts at token {}, but the spans before it end at token {} (spans must "
           "cover the batch without gaps or overlaps)",
           index, spans[index].first_token, covered);
    covered += spans[index].tokens;
  }
  if (covered != total_tokens)
    fail("make_layout: the spans cover {} tokens, but the batch has {}", covered, total_tokens);

  BatchLayout layout;
  layout.spans = spans;
  layout.total_tokens = total_tokens;
  layout.token_ids = Tensor::empty({total_tokens}, DType::I32);
  layout.positions = Tensor::empty({total_tokens}, DType::I32);
  layout.slots = Tensor::empty({total_tokens}, DType::I32);
  layout.spans_device = Tensor::empty({static_cast<int64_t>(spans.size()), 4}, DType::I32);
  std::copy(token_ids.begin(), token_ids.end(), layout.token_ids.data<int32_t>());
  int32_t* positions = layout.positions.data<int32_t>();
  int32_t* slots = layout.slots.data<int32_t>();
  int32_t* span_rows = layout.spans_device.data<int32_t>();
  for (size_t i = 0; i < spans.size(); ++i) {
    const SequenceSpan& span = spans[i];
    for (int32_t offset = 0; offset < span.tokens; ++offset) {
      positions[span.first_token + offset] = span.first_position + offset;
      slots[span.first_token + offset] = span.slot;
    }
    const int32_t row[4] = {span.slot, span.first_token, span.tokens, span.first_position};
    std::copy(row, row + 4, span_rows + 4 * i);
  }
  return layout;
}

}  // namespace kiln::cpu
