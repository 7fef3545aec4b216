#include "passthrough_backend.hpp"

#include <c10/util/Exception.h>

#include "../../transport/nccl/passthrough.hpp"
#include "../calls/call_args.hpp"
#include "../calls/stream_call.hpp"

namespace hca {

PassthroughBackend::PassthroughBackend(int rank, int size, std::chrono::milliseconds timeout, PackingOptions packing,
                                       Engines engines)
    : EngineBackend(rank, size, std::move(engines)), timeout_(timeout), packing_(packing) {}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "allreduce");
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() != at::kStrided) {
    return calls_(*this, {"allreduce", tensors, tensors}, opts.asyncOp,  // sparse: the engine's own form
                  [&] { return engine(tensors[0], "allreduce").allreduce(tensors, opts); });
  }
  CallArgs args("allreduce", tensors);
  args.reduce_op(opts.reduceOp);  // the same ops as the other algorithms
  const auto timeout = opts.timeout == c10d::kUnsetTimeout ? timeout_.load() : opts.timeout;
  auto packed = std::make_shared<nccl::PackedAllreduce>(engine(tensors[0], "allreduce"), args.dense(),
                                                        make_packs(args.descs(), packing_), opts.reduceOp, timeout);
  std::function<void()> body = [packed, args] {
    packed->finish();
    args.write_back();
  };
  // CUDA: the engine's results are divided and copied back on this group's
  // stream, which the caller's stream then waits for (it would race otherwise).
  std::shared_ptr<StreamCall> call;
  if (args.device().is_cuda() && cuda_call_streams_) {
    call = cuda_call_streams_->call(args.device());
    body = issued_and_waited(call, call->keep(CallTensors{std::move(args), tensors}), std::move(body));
  }
  return calls_(*this, {"allreduce", tensors, tensors}, opts.asyncOp, [&] {
    auto work = c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::ALLREDUCE, tensors, std::move(body),
                                             std::move(call));
    queue_.submit(work, !opts.asyncOp);
    return work;
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "broadcast");
  return calls_(*this, {"broadcast", tensors, tensors}, opts.asyncOp,
                [&] { return engine(tensors[0], "broadcast").broadcast(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "reduce");
  return calls_(*this, {"reduce", tensors, tensors}, opts.asyncOp,
                [&] { return engine(tensors[0], "reduce").reduce(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  check_nonempty(inputs.size(), "the input list", "allgather");
  return calls_(*this, {"all_gather", inputs, flattened(outputs)}, opts.asyncOp,
                [&] { return engine(inputs[0], "allgather").allgather(outputs, inputs, opts); });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  return calls_(*this, {"_allgather_base", {input}, {output}}, opts.asyncOp,
                [&] { return engine(input, "allgather_into_tensor")._allgather_base(output, input, opts); });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  check_nonempty(inputs.size(), "the input list", "allgather_into_tensor");
  return calls_(*this, {"allgather_into_tensor_coalesced", inputs, outputs}, opts.asyncOp, [&] {
    return engine(inputs[0], "allgather_into_tensor").allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  check_nonempty(outputs.size(), "the output list", "reduce_scatter");
  return calls_(*this, {"reduce_scatter", flattened(inputs), outputs}, opts.asyncOp,
                [&] { return engine(outputs[0], "reduce_scatter").reduce_scatter(outputs, inputs, opts); });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  return calls_(*this, {"_reduce_scatter_base", {input}, {output}}, opts.asyncOp,
                [&] { return engine(output, "reduce_scatter_tensor")._reduce_scatter_base(output, input, opts); });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  check_nonempty(inputs.size(), "the input list", "reduce_scatter_tensor");
  return calls_(*this, {"reduce_scatter_tensor_coalesced", inputs, outputs}, opts.asyncOp, [&] {
    return engine(inputs[0], "reduce_scatter_tensor").reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::barrier(const c10d::BarrierOptions& opts) {
  return calls_(*this, {"barrier", {}, {}}, opts.asyncOp, [&] { return cpu_engine("barrier").barrier(opts); });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::endCoalescing() {
  auto work = c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::COALESCED, std::vector<at::Tensor>{}, [] {});
  queue_.submit(work, false);
  return work;
}

}  // namespace hca
