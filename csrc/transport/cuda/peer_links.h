// How two GPUs of this process are linked, as the CUDA runtime ranks it: for
// grouping ranks by GPU link where NVML is not installed.
#pragma once
#include <optional>

namespace hca::cuda {

// CUDA's performance rank of the link from device `src` to `dst` (0 the
// fastest kind: NVLink where there is any); nullopt without peer access.
std::optional<int> peer_performance_rank(int src, int dst);

}  // namespace hca::cuda
