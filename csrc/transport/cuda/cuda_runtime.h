// CUDA's runtime as a DeviceRuntime (stream/device_runtime.h): thin wrappers
// over cudart whose errors become hca::Failure (no torch here).
#pragma once
#include "../stream/device_runtime.h"

namespace hca::cuda {

// The process's CUDA runtime.
DeviceRuntime& runtime();

}  // namespace hca::cuda
