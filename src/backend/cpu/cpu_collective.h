// The CPU implementation of the deterministic all-reduce (backend/collective.h) between the N rank
// threads of one process: each rank publishes its partial, every rank sums all N in rank order.
#pragma once

#include <memory>
#include <vector>

#include "backend/collective.h"

namespace kiln {

// One communicator per rank, all sharing one rendezvous; rank i is element i.
std::vector<std::unique_ptr<Collective>> make_cpu_collectives(int ranks);

}  // namespace kiln
