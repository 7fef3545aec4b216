// CUDA runtime errors as hca::Failure(Setup) naming the call (no torch here).
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "../control/failure.h"

namespace hca::cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Failure(FailureKind::Setup, "CUDA", -1, std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

}  // namespace hca::cuda
