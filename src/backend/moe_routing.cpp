#include "backend/moe_routing.h"

#include <algorithm>
#include <numeric>

namespace kiln {

TokenRoute route_token(const float* logits, int64_t experts, int64_t top_k, bool normalize) {
  const float largest = *std::max_element(logits, logits + experts);
  std::vector<float> probabilities(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) probabilities[e] = routing::shifted_exp(logits[e], largest);
  const float total = routing::sequential_sum(probabilities.data(), experts);
  for (float& p : probabilities) p = routing::divide(p, total);
  // The top k in rank order (the CUDA kernel finds the same ones by a warp's search: the order is total).
  std::vector<int32_t> ranked(static_cast<size_t>(experts));
  std::iota(ranked.begin(), ranked.end(), 0);
  std::partial_sort(ranked.begin(), ranked.begin() + top_k, ranked.end(), [&](int32_t a, int32_t b) {
    return routing::ranks_before(probabilities[a], a, probabilities[b], b);
  });
  ranked.resize(static_cast<size_t>(top_k));
  std::vector<float> ranked_probabilities;
  for (int32_t e : ranked) ranked_probabilities.push_back(probabilities[e]);
  TokenRoute route;
  route.experts.resize(static_cast<size_t>(top_k));
  route.weights.resize(static_cast<size_t>(top_k));
  routing::finish_route(ranked.data(), ranked_probabilities.data(), top_k, normalize, route.experts.data(),
                        route.weights.data());
  return route;
}

}  // namespace kiln
