#include "cuda_call.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "../process_group_hca.hpp"

namespace hca {

CudaCall::CudaCall(const at::Device& device)
    : device_(device), comm_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {
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

void CudaCall::end() const { C10_CUDA_CHECK(cudaEventRecord(end_, comm_.stream())); }

bool CudaCall::query() const { return cudaEventQuery(end_) == cudaSuccess; }

void CudaCall::make_current_stream_wait() const {
  C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), end_, 0));
}

void CudaCall::complete(c10::ivalue::Future& future, const c10::IValue& value) const {
  // The future records its events on the current streams: make that the internal one.
  c10::cuda::CUDAStreamGuard guard(comm_);
  future.markCompleted(value);
}

void CudaCall::check_released() const {
  const std::string cause = released_->cause();
  if (!cause.empty()) {
    C10_THROW_ERROR(DistBackendError, cause + " (this call was released unfinished: its outputs are undefined)");
  }
}

std::function<void()> issued_by(std::shared_ptr<CudaCall> call, std::function<void()> body) {
  return [call = std::move(call), body = std::move(body)] {
    call->begin();
    call->on_stream(body);
    call->end();
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::launch_cuda(c10d::OpType type, Executor& executor, CallArgs args,
                                                            std::vector<Collective> collectives,
                                                            std::vector<at::Tensor> outputs, bool async_op) {
  auto call = std::make_shared<CudaCall>(args.device());
  for (auto& c : collectives) {
    c.device = call->device_index();
    c.stream = call->stream();
    c.released = call->released();
  }
  std::vector<at::Tensor> stash = args.dense();
  stash.insert(stash.end(), outputs.begin(), outputs.end());
  auto body = issued_by(call, [&executor, collectives = std::move(collectives), args = std::move(args)] {
    for (const auto& c : collectives) {
      try {
        executor.run(c);
      } catch (const std::runtime_error& e) {
        C10_THROW_ERROR(DistBackendError, e.what());
      }
    }
    args.write_back();
  });
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(outputs), std::move(body), call, std::move(stash));
  queue_.submit(work, !async_op);
  return work;
}

}  // namespace hca
