// StreamCall over CUDA (built only with CUDA): torch's current stream of the
// device is the caller's; torch ops issued for the call run with the internal
// stream current; the Future is CUDA-aware (its users' streams wait for it).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../../transport/cuda/cuda_runtime.h"
#include "../stream_call.hpp"

namespace hca {
namespace {

c10::cuda::CUDAStream torch_stream(DeviceRuntime::Stream stream, int device) {
  return c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), static_cast<c10::DeviceIndex>(device));
}

cudaStream_t current_cuda_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

class CudaCall final : public StreamCall {
 public:
  CudaCall(int device, DeviceRuntime::Stream internal, DeviceRuntime::Stream caller)
      : StreamCall(cuda::runtime(), device, internal, caller) {}

  void on_stream(std::function<void()> fn) const override { from_host(std::move(fn)); }
  void from_host(std::function<void()> fn) const override {
    c10::cuda::CUDAStreamGuard guard(torch_stream(stream(), device_index()));  // the device too
    at::NoGradGuard no_grad;  // the backend's copies into leaves that require grad
    fn();
  }
  void keep_until_passed(std::shared_ptr<const CallTensors> kept) const override {
    // The host copies' pinned memory is safe already: a non-blocking copy records its use.
    const auto stream = torch_stream(this->stream(), device_index());
    kept->each([&](const at::Tensor& t) {
      if (t.defined() && t.is_cuda() && t.has_storage()) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
      }
    });
  }

  at::Tensor host_staging(const at::Tensor& like) const override {
    return at::empty(like.sizes(), like.options().device(at::kCPU).pinned_memory(true));
  }

  std::vector<c10::Device> devices() const override {
    return {c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index()))};
  }
  void complete(c10::ivalue::Future& future, const c10::IValue& value) const override {
    // The future records its events on the current streams: make that the internal one.
    c10::cuda::CUDAStreamGuard guard(torch_stream(stream(), device_index()));
    future.markCompleted(value);
  }

 protected:
  DeviceRuntime::Stream current_stream() const override { return current_cuda_stream(device_index()); }
};

}  // namespace

std::unique_ptr<CallStreams> make_cuda_call_streams() {
  return std::make_unique<CallStreams>(
      cuda::runtime(), [](const at::Device& device) { return static_cast<int>(device.index()); },
      [](int device) -> DeviceRuntime::Stream { return current_cuda_stream(device); },
      [](int device, DeviceRuntime::Stream internal, DeviceRuntime::Stream caller) {
        return std::make_shared<CudaCall>(device, internal, caller);
      });
}

}  // namespace hca
