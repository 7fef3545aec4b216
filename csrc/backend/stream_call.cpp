#include "stream_call.hpp"

#include <c10/util/Exception.h>

#include "process_group_hca.hpp"

namespace hca {

std::shared_ptr<const CallTensors> StreamCall::keep(CallTensors tensors) const {
  return std::make_shared<const CallTensors>(std::move(tensors));
}

void StreamCall::check_released() const {
  const std::string cause = issued_->cause();
  if (!cause.empty()) {
    C10_THROW_ERROR(DistBackendError, cause + " (this call was released unfinished: its outputs are undefined)");
  }
}

#ifndef HCA_WITH_CUDA
std::unique_ptr<CallStreams> make_cuda_call_streams() { return nullptr; }
#endif

std::function<void()> issued_and_waited(std::shared_ptr<StreamCall> call, std::shared_ptr<const CallTensors> kept,
                                        std::function<void()> body) {
  return [call = std::move(call), kept = std::move(kept), body = std::move(body)] {
    call->begin();
    try {
      call->on_stream(body);
    } catch (...) {
      call->end();
      call->wait_for_end();  // what was issued before the error still reads `kept`
      throw;
    }
    call->end();
    call->wait_for_end();
    call->issued()->settle();
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::launch_on_stream(c10d::OpType type, Executor& executor,
                                                                 CallArgs args, std::vector<Collective> collectives,
                                                                 std::vector<at::Tensor> outputs, bool async_op) {
  std::shared_ptr<StreamCall> call = call_streams(args.device())->call(args.device());
  auto kept = call->keep(CallTensors{std::move(args), outputs});
  for (auto& c : collectives) {
    c.device = call->device_index();
    c.stream = call->stream();
    c.issued = call->issued();
    c.keep = kept;
  }
  auto body = [&executor, call, kept, collectives = std::move(collectives)] {
    call->begin();
    for (const auto& c : collectives) {
      try {
        executor.run(c);
      } catch (const std::runtime_error& e) {
        C10_THROW_ERROR(DistBackendError, e.what());
      }
    }
    // Not kept alive by this closure (on CUDA it runs now, issuing copies): the
    // executor keeps the tensors until the stream has passed the call's end.
    call->on_stream([tensors = kept.get()] { tensors->args.write_back(); });
    call->end();
    executor.end_call(call->stream(), call->issued(), kept);
  };
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(outputs), std::move(body), std::move(call));
  queue_.submit(work, !async_op);
  return work;
}

}  // namespace hca
