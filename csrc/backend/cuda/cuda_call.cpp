#include "cuda_call.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>

namespace hca {

CudaCall::CudaCall(const at::Device& device, cudaStream_t internal)
    : device_(device), comm_(c10::cuda::getStreamFromExternal(internal, device.index())) {
  c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // Refused here, on the caller's thread, so that the group stays usable.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(caller, &capturing));
  TORCH_CHECK(capturing == cudaStreamCaptureStatusNone, "hca: collectives cannot be captured in a CUDA graph yet "
              "(the current stream of ", device, " is capturing)");
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&end_, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(ready_, caller));
}

CudaCall::~CudaCall() {
  cudaEventDestroy(ready_);
  cudaEventDestroy(end_);
}

void CudaCall::begin() const { C10_CUDA_CHECK(cudaStreamWaitEvent(comm_.stream(), ready_, 0)); }

void CudaCall::on_stream(std::function<void()> fn) const {
  c10::cuda::CUDAStreamGuard guard(comm_);
  fn();
}

void CudaCall::end() { C10_CUDA_CHECK(cudaEventRecord(end_, comm_.stream())); }

void CudaCall::wait_for_end() const { C10_CUDA_CHECK(cudaEventSynchronize(end_)); }

bool CudaCall::query() const { return cudaEventQuery(end_) != cudaErrorNotReady; }

void CudaCall::make_current_stream_wait() const {
  C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), end_, 0));
}

void CudaCall::complete(c10::ivalue::Future& future, const c10::IValue& value) const {
  // The future records its events on the current streams: make that the internal one.
  c10::cuda::CUDAStreamGuard guard(comm_);
  future.markCompleted(value);
}

namespace {

class CudaCallStreams final : public CallStreams {
 public:
  ~CudaCallStreams() override {
    // Work still queued on a stream completes before its resources go.
    for (const auto& [device, stream] : streams_) cudaStreamDestroy(stream);
  }

  std::shared_ptr<StreamCall> call(const at::Device& device) override {
    return std::make_shared<CudaCall>(device, stream(device.index()));
  }

 private:
  cudaStream_t stream(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& stream = streams_[device];
    if (!stream) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      int least = 0, greatest = 0;
      C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      C10_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
    }
    return stream;
  }

  std::mutex mutex_;
  std::map<int, cudaStream_t> streams_;
};

}  // namespace

std::unique_ptr<CallStreams> make_cuda_call_streams() { return std::make_unique<CudaCallStreams>(); }

}  // namespace hca
