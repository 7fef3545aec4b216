#include "peer_links.h"

#include <cuda_runtime_api.h>

#include "check.h"

namespace hca::cuda {

std::optional<int> peer_performance_rank(int src, int dst) {
  int access = 0;
  check(cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, src, dst), "cudaDeviceGetP2PAttribute");
  if (!access) return std::nullopt;
  int rank = 0;
  check(cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, src, dst), "cudaDeviceGetP2PAttribute");
  return rank;
}

}  // namespace hca::cuda
