// Stream memory operations (the driver's cuStreamWaitValue32 / cuStreamWriteValue32),
// reached through the runtime's driver entry points so that only cudart is linked.
// They order ranks without any kernel: the GPU's front end waits on a word.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace hca::cuda {

// Whether `device` has an active primary context (asks the driver; creates none).
bool has_primary_context(int device);

class StreamOps {
 public:
  // Loads the entry points and probes that `device` can wait on registered host
  // memory; throws Failure(Setup) saying what is missing.
  explicit StreamOps(int device);
  // Until (int32_t)(*word - value) >= 0, on `stream`.
  void wait_geq(cudaStream_t stream, uint64_t device_address, uint32_t value) const;
  // *word = value on `stream`, after everything issued before it (with a memory fence).
  void write(cudaStream_t stream, uint64_t device_address, uint32_t value) const;

 private:
  using Fn = int (*)(void* stream, uint64_t address, uint32_t value, unsigned flags);
  Fn wait_ = nullptr;
  Fn write_ = nullptr;
};

}  // namespace hca::cuda
