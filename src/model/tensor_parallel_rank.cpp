#include "model/tensor_parallel_rank.h"

#include "core/error.h"

namespace kiln {

void check_divisible(const char* field, int64_t value, int ranks) {
  if (ranks < 1) fail("tensor parallelism needs at least 1 rank, got {}", ranks);
  if (value % ranks != 0)
    fail("tensor parallelism over {} ranks: {} = {} is not divisible by {}", ranks, field, value, ranks);
}

void check_no_experts(const ModelConfig& config, int ranks) {
  if (ranks > 1 && config.moe.experts > 0)
    fail("tensor parallelism over {} ranks: the model's MLPs are a mixture of {} experts, which kiln does not split "
         "over ranks (only dense layers are split)",
         ranks, config.moe.experts);
}

void check_attention_split(const ModelConfig& config, int ranks) {
  check_divisible("num_attention_heads", config.num_attention_heads, ranks);
  const int64_t kv_heads = config.num_key_value_heads;
  if (kv_heads < 1 || (kv_heads % ranks != 0 && ranks % kv_heads != 0))
    fail("tensor parallelism over {} ranks: num_key_value_heads = {} is neither divisible by {} nor a divisor of it",
         ranks, kv_heads, ranks);
}

AttentionShard attention_shard(const ModelConfig& config, const TensorParallelRank& rank) {
  AttentionShard shard;
  shard.heads = config.num_attention_heads / rank.ranks;
  shard.first_head = rank.rank * shard.heads;
  if (config.num_key_value_heads % rank.ranks == 0) {
    shard.kv_heads = config.num_key_value_heads / rank.ranks;
    shard.first_kv_head = rank.rank * shard.kv_heads;
  } else {
    shard.kv_heads = 1;
    shard.first_kv_head = rank.rank / (rank.ranks / config.num_key_value_heads);
  }
  return shard;
}

}  // namespace kiln
