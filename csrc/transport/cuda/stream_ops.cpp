#include "stream_ops.h"

#include <cuda.h>

#include <string>

#include "check.h"

namespace hca::cuda {
namespace {

template <class Fn>
Fn entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPointByVersion(name, &fn, 11070, cudaEnableDefault, &found), name);
  if (found != cudaDriverEntryPointSuccess || !fn) {
    throw Failure(FailureKind::Setup, "CUDA", -1, std::string("the driver has no ") + name);
  }
  return reinterpret_cast<Fn>(fn);
}

void check_driver(int result, const char* what) {
  if (result != CUDA_SUCCESS) {
    throw Failure(FailureKind::Setup, "CUDA", -1,
                  std::string(what) + " failed with driver error " + std::to_string(result));
  }
}

}  // namespace

bool has_primary_context(int device) {
  using GetState = int (*)(int device, unsigned* flags, int* active);
  static const GetState get_state = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 11070, cudaEnableDefault, &found) !=
            cudaSuccess || found != cudaDriverEntryPointSuccess) {
      return static_cast<GetState>(nullptr);
    }
    return reinterpret_cast<GetState>(fn);
  }();
  unsigned flags = 0;
  int active = 0;
  // CUdevice is the device's ordinal among the visible ones, as the runtime numbers them.
  return get_state && get_state(device, &flags, &active) == CUDA_SUCCESS && active;
}

StreamOps::StreamOps(int device) {
  wait_ = entry_point<Fn>("cuStreamWaitValue32");
  write_ = entry_point<Fn>("cuStreamWriteValue32");
  int mapped = 0;
  check(cudaDeviceGetAttribute(&mapped, cudaDevAttrCanMapHostMemory, device), "cudaDeviceGetAttribute");
  if (!mapped) {
    throw Failure(FailureKind::Setup, "CUDA", -1,
                  "device " + std::to_string(device) + " cannot map host memory, which hca's stream waits need");
  }
}

void StreamOps::wait_geq(cudaStream_t stream, uint64_t device_address, uint32_t value) const {
  check_driver(wait_(stream, device_address, value, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32");
}

void StreamOps::write(cudaStream_t stream, uint64_t device_address, uint32_t value) const {
  check_driver(write_(stream, device_address, value, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32");
}

}  // namespace hca::cuda
