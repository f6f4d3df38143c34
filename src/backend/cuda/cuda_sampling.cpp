// CudaBackend's sampling on the device (sampling.cu): one launch samples every row of a step, and
// feed_tokens writes the sampled ids into the next step's input, so decode needs no host round trip.
#include "backend/cuda/cuda_backend_impl.h"

#include <limits>

#include "backend/op_contract.h"
#include "core/error.h"

namespace kiln {

uint64_t CudaBackend::sampling_scratch_bytes(int64_t rows, int64_t vocab) const {
  const auto words = [](size_t bytes) { return (bytes + 3) / 4 * 4; };  // the I32 tensors sample_tokens takes
  return allocation_bytes(words(cuda::sampling_sort_scratch_bytes(rows, vocab))) +
         allocation_bytes(words(cuda::sampling_chunk_scratch_bytes(rows, vocab)));
}

void CudaBackend::sample_tokens(const Tensor& logits, const Tensor& settings, bool sorting, Tensor& tokens,
                                Tensor& logprobs) {
  const SamplingDims dims = check_sample_tokens(contract(), logits, settings, tokens, logprobs);
  const int64_t rows = dims.rows, vocab = dims.vocab;
  if (rows * vocab > std::numeric_limits<int>::max())
    fail("CUDA sample_tokens: {} rows of {} logits exceed the sort's {} items", rows, vocab,
         std::numeric_limits<int>::max());
  cuda::SamplingArgs args;
  args.logits = logits.data<float>();
  args.settings = settings.data<int32_t>();
  args.rows = rows;
  args.vocab = vocab;
  args.tokens = tokens.data<int32_t>();
  args.logprobs = logprobs.data<float>();
  args.errors = errors_;
  Tensor sort_scratch;
  if (sorting) {
    const auto bytes = static_cast<int64_t>(cuda::sampling_sort_scratch_bytes(rows, vocab));
    sort_scratch = alloc({(bytes + 3) / 4}, DType::I32);
    args.sort_scratch = sort_scratch.raw();
  }
  const auto chunk_bytes = static_cast<int64_t>(cuda::sampling_chunk_scratch_bytes(rows, vocab));
  const Tensor chunk_scratch = alloc({(chunk_bytes + 3) / 4}, DType::I32);
  args.chunk_scratch = chunk_scratch.raw();
  activate();
  launched(cuda::launch_sample_tokens(args, stream_), "sample_tokens");
}

void CudaBackend::feed_tokens(const Tensor& previous, const Tensor& feed, Tensor& token_ids) {
  constexpr const char* op = "feed_tokens";
  check_feed_tokens(contract(), previous, feed, token_ids);
  activate();
  launched(cuda::launch_feed_tokens(previous.data<int32_t>(), previous.numel(), feed.data<int32_t>(), feed.numel(),
                                    token_ids.data<int32_t>(), errors_, stream_),
           op);
}

}  // namespace kiln
