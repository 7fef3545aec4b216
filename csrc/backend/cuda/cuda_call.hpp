// ProcessGroupNCCL's stream semantics for one hca call on CUDA tensors (built
// only with CUDA): the call is issued on an internal stream that first waits
// for the caller's current stream; wait() makes the caller's current stream
// wait for its end without blocking the host; the Future is CUDA-aware.
#pragma once
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "../../transport/executor.h"
#include "../work_hca.hpp"

namespace hca {

class CudaCall final : public DeviceCompletion {
 public:
  // On the caller's thread: marks "inputs ready" on its current stream.
  explicit CudaCall(const at::Device& device);
  ~CudaCall() override;

  int device_index() const { return device_.index(); }
  void* stream() const { return comm_.stream(); }
  // Before issuing (on any thread): the internal stream waits for the caller's.
  void begin() const;
  // After issuing: the end of everything issued so far.
  void end() const;
  // Runs fn with the internal stream current (e.g. writing back non-contiguous outputs).
  template <class Fn>
  void on_stream(Fn fn) const {
    c10::cuda::CUDAStreamGuard guard(comm_);
    fn();
  }

  std::vector<c10::Device> devices() const override { return {device_}; }
  bool query() const override;
  void make_current_stream_wait() const override;
  void complete(c10::ivalue::Future& future, const c10::IValue& value) const override;
  void check_released() const override;
  // What the executor marks when it releases this call's streams after a failure.
  const std::shared_ptr<Released>& released() const { return released_; }

 private:
  at::Device device_;
  c10::cuda::CUDAStream comm_;
  cudaEvent_t ready_ = nullptr, end_ = nullptr;
  std::shared_ptr<Released> released_ = std::make_shared<Released>();
};

// `body` as a Work body for `call`: issued on the call's internal stream (current
// while it runs) after the caller's stream, the end marked after it.
std::function<void()> issued_by(std::shared_ptr<CudaCall> call, std::function<void()> body);

}  // namespace hca
