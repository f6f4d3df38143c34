#include "engine/serving_sizes.h"

#include <algorithm>
#include <limits>

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
  const int64_t context = sizes.context(config);
  if (sizes.kv_cache_tokens < 0 || sizes.kv_cache_tokens % kKvBlockTokens != 0)
    fail("the KV cache's tokens must be a multiple of its {}-token blocks, got {}", kKvBlockTokens,
         sizes.kv_cache_tokens);
  if (sizes.kv_cache_tokens > 0 && sizes.kv_cache_tokens < kv_table_width(context) * kKvBlockTokens)
    fail("a KV cache of {} tokens cannot hold one sequence of the context's {} tokens", sizes.kv_cache_tokens, context);
  if (sizes.memory_share != 0.0 && !(sizes.memory_share > 0.0 && sizes.memory_share <= 1.0))
    fail("the memory share must be above 0 and at most 1, got {}", sizes.memory_share);
  if (sizes.memory_share > 0.0 && sizes.kv_cache_tokens > 0)
    fail("give the KV cache's tokens or the memory share, not both: the share sizes the KV cache");
  if (sizes.prefix_snapshots < -1 || sizes.snapshots() > std::numeric_limits<int32_t>::max())
    fail("the prefix cache keeps 0 to {} snapshots, not {}", std::numeric_limits<int32_t>::max(),
         sizes.prefix_snapshots);
}

int64_t ServingSizes::kv_blocks(int64_t context) const {
  return kv_cache_tokens > 0 ? kv_cache_tokens / kKvBlockTokens : max_batch * kv_table_width(context);
}

}  // namespace kiln
