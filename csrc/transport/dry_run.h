// A call's waits counted without running it: the round runner issues the
// call's operations to a medium that moves nothing and counts the waits on
// peers' words that a stream would issue (CoveredWaits), for explain.
#pragma once
#include <cstdint>
#include <vector>

#include "../plan/plan.h"
#include "stream/staging_place.h"

namespace hca {

// Per rank, the waits on peers' words its stream issues for one call of
// `plan` once the group has used every slot of its ring (`ring`) before.
std::vector<uint64_t> peer_waits_of_call(const std::vector<PackPlan>& plan, int world, RingLayout ring);

}  // namespace hca
