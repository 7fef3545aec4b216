// StreamCall over CUDA (built only with CUDA): the call is issued on the group's
// internal stream of the device, which first waits for the caller's current
// stream; wait() makes the caller's current stream wait for its end without
// blocking the host; the Future is CUDA-aware.
#pragma once
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "../stream_call.hpp"

namespace hca {

class CudaCall final : public StreamCall {
 public:
  // On the caller's thread: marks "inputs ready" on its current stream.
  CudaCall(const at::Device& device, cudaStream_t internal);
  ~CudaCall() override;

  void* stream() const override { return comm_.stream(); }
  int device_index() const override { return device_.index(); }
  void begin() const override;
  void on_stream(std::function<void()> fn) const override;
  void end() override;
  void wait_for_end() const override;

  std::vector<c10::Device> devices() const override { return {device_}; }
  bool query() const override;
  void make_current_stream_wait() const override;
  void complete(c10::ivalue::Future& future, const c10::IValue& value) const override;

 private:
  at::Device device_;
  c10::cuda::CUDAStream comm_;
  cudaEvent_t ready_ = nullptr, end_ = nullptr;
};

}  // namespace hca
