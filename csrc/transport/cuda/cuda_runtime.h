// CUDA's runtime as a DeviceRuntime (stream/device_runtime.h): thin wrappers
// over cudart whose errors become hca::Failure (no torch here).
#pragma once
#include <string>

#include "../stream/device_runtime.h"

namespace hca::cuda {

// The process's CUDA runtime.
DeviceRuntime& runtime();

// A GPU's UUID as nvidia-smi writes it ("GPU-" and 32 hex digits), from its 16 bytes.
std::string uuid_text(const char* uuid);
// The UUID of this process's device `device`: the same in every process that
// sees that GPU, whatever its index there (CUDA_VISIBLE_DEVICES).
std::string device_uuid(int device);

}  // namespace hca::cuda
