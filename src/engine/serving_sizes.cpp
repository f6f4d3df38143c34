#include "engine/serving_sizes.h"

#include <algorithm>

#include "core/error.h"

namespace kiln {

int64_t ServingSizes::context(const ModelConfig& config) const {
  int64_t context = config.max_position_embeddings;
  if (max_context > 0) context = context > 0 ? std::min(max_context, context) : max_context;
  if (context <= 0) fail("{}: max_position_embeddings is missing; give --max-context", config.source.string());
  return context;
}

void check_prefill_chunk(int64_t chunk) {
  if (chunk < kPrefillAlignment || chunk % kPrefillAlignment != 0)
    fail("prefill chunk must be a positive multiple of {}, got {}", kPrefillAlignment, chunk);
}

void check_serving_sizes(const ServingSizes& sizes, const ModelConfig& config) {
  if (sizes.max_batch < 1) fail("max batch must be at least 1, got {}", sizes.max_batch);
  check_prefill_chunk(sizes.prefill_chunk);
  if (sizes.max_context < 0) fail("max context must not be negative, got {}", sizes.max_context);
  sizes.context(config);
}

}  // namespace kiln
