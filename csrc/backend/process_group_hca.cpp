#include "process_group_hca.hpp"

#include <c10/util/Exception.h>

#include <functional>

#include "tensor_args.hpp"

namespace hca {
namespace {

std::vector<TensorDesc> describe(const std::vector<at::Tensor>& tensors, const char* name) {
  std::vector<TensorDesc> descs;
  for (const auto& t : tensors) descs.push_back({checked_dtype(t, name), static_cast<size_t>(t.numel())});
  return descs;
}

// Each tensor is read and written in place.
std::vector<shm::TensorSpan> in_place(const std::vector<at::Tensor>& tensors) {
  std::vector<shm::TensorSpan> spans;
  for (const auto& t : tensors) spans.push_back({t.data_ptr(), t.data_ptr()});
  return spans;
}

ReduceOp common_reduce_op(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, const char* name) {
  ReduceOp result = ReduceOp::Sum;
  for (const auto& t : tensors) result = checked_reduce_op(op, checked_dtype(t, name), name);
  return result;
}

char* byte_offset(const at::Tensor& t, int64_t elements) {
  return static_cast<char*>(t.data_ptr()) + elements * static_cast<int64_t>(t.element_size());
}

}  // namespace

ProcessGroupHCA::ProcessGroupHCA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout, PlanOptions options, size_t chunk_bytes,
                                 c10::intrusive_ptr<c10d::Backend> cpu_engine,
                                 c10::intrusive_ptr<c10d::Backend> cuda_engine)
    : c10d::Backend(rank, size),
      options_(std::move(options)),
      timeout_(timeout),
      cpu_engine_(std::move(cpu_engine)),
      cuda_engine_(std::move(cuda_engine)) {
  try {
    validate(options_, size);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  if (passes_through()) {
    TORCH_CHECK_VALUE(cpu_engine_, "hca: the nccl algorithm needs an engine for CPU tensors");
    return;
  }
  StoreRendezvous rendezvous(store);
  shm_ = std::make_unique<shm::Transport>(rendezvous, rank, size, chunk_bytes, timeout);
}

c10d::Backend& ProcessGroupHCA::engine_for(const at::Tensor& tensor, const char* name) const {
  if (tensor.device().is_cuda()) {
    TORCH_CHECK_NOT_IMPLEMENTED(cuda_engine_, "hca ", name, ": the nccl algorithm has no engine for CUDA tensors "
                                "(torch without NCCL, or no GPU when the group was created)");
    return *cuda_engine_;
  }
  return *cpu_engine_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::packed_allreduce(std::vector<at::Tensor>& tensors,
                                                                 const c10d::ReduceOp& op,
                                                                 std::chrono::milliseconds timeout, bool async_op) {
  std::vector<TensorDesc> descs;
  for (const auto& t : tensors) {
    const DType dtype = plan_dtype(t, "allreduce");
    checked_reduce_op(op, dtype, "allreduce");
    TORCH_CHECK_VALUE(t.device() == tensors[0].device(), "hca allreduce: tensors on ", t.device(), " and ",
                      tensors[0].device(), " in one call");
    descs.push_back({dtype, static_cast<size_t>(t.numel())});
  }
  DenseTensors dense(tensors);
  auto packed = std::make_shared<nccl::PackedAllreduce>(engine_for(tensors[0], "allreduce"), dense.dense(),
                                                        make_packs(descs, options_.packing), op, timeout);
  return submit(c10d::OpType::ALLREDUCE, tensors, async_op, [packed, dense = std::move(dense)] {
    packed->finish();
    dense.write_back();
  });
}

std::string ProcessGroupHCA::signature(const char* name, const std::string& details) const {
  std::string text = std::string(name) + "(" + details + ", " + algorithm_name(options_.algorithm) +
                     ", num_packs=" + std::to_string(options_.packing.num_packs) + ")";
  // Long descriptions are cut to fit the control block; a hash keeps them exact.
  if (text.size() > 200) text = text.substr(0, 180) + "... #" + std::to_string(std::hash<std::string>{}(text));
  return text;
}

std::chrono::milliseconds ProcessGroupHCA::timeout_or_default(std::chrono::milliseconds timeout) const {
  return timeout == c10d::kUnsetTimeout ? timeout_ : timeout;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::launch(c10d::OpType type, std::vector<Step> steps, DenseTensors dense,
                                                       std::vector<at::Tensor> outputs,
                                                       std::chrono::milliseconds timeout, bool async_op) {
  return submit(type, std::move(outputs), async_op, [this, steps = std::move(steps), dense = std::move(dense), timeout] {
    for (const auto& step : steps) {
      try {
        shm_->run({&step.plan, step.spans, step.op, step.signature, timeout});
      } catch (const std::runtime_error& e) {
        C10_THROW_ERROR(DistBackendError, e.what());
      }
    }
    dense.write_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::submit(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                       bool async_op, std::function<void()> body) {
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(outputs), std::move(body));
  executor_.submit(work, !async_op);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::launch_in_place(c10d::OpType type, std::vector<at::Tensor>& tensors,
                                                                std::vector<PackPlan> plan, ReduceOp op,
                                                                std::string signature,
                                                                std::chrono::milliseconds timeout, bool async_op) {
  DenseTensors dense(tensors);
  std::vector<Step> steps(1);
  steps[0] = {std::move(plan), in_place(dense.dense()), op, std::move(signature)};
  return launch(type, std::move(steps), std::move(dense), tensors, timeout_or_default(timeout), async_op);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "allreduce");
  if (passes_through()) return packed_allreduce(tensors, opts.reduceOp, timeout_or_default(opts.timeout), opts.asyncOp);
  const ReduceOp op = common_reduce_op(tensors, opts.reduceOp, "allreduce");
  return launch_in_place(c10d::OpType::ALLREDUCE, tensors,
                         plan_allreduce(describe(tensors, "allreduce"), getSize(), options_), op,
                         signature("allreduce", describe_tensors(tensors) + ", " + op_name(op)), opts.timeout,
                         opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "broadcast");
  if (passes_through()) return engine_for(tensors[0], "broadcast").broadcast(tensors, opts);
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "hca broadcast: src ", opts.rootRank,
                    " is outside the group of ", getSize(), " ranks");
  return launch_in_place(c10d::OpType::BROADCAST, tensors,
                         plan_broadcast(describe(tensors, "broadcast"), getSize(), static_cast<int>(opts.rootRank)),
                         ReduceOp::Sum,
                         signature("broadcast", describe_tensors(tensors) + ", src=" + std::to_string(opts.rootRank)),
                         opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "reduce");
  if (passes_through()) return engine_for(tensors[0], "reduce").reduce(tensors, opts);
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "hca reduce: dst ", opts.rootRank,
                    " is outside the group of ", getSize(), " ranks");
  const ReduceOp op = common_reduce_op(tensors, opts.reduceOp, "reduce");
  return launch_in_place(
      c10d::OpType::REDUCE, tensors,
      plan_reduce(describe(tensors, "reduce"), getSize(), static_cast<int>(opts.rootRank), options_), op,
      signature("reduce", describe_tensors(tensors) + ", " + op_name(op) + ", dst=" + std::to_string(opts.rootRank)),
      opts.timeout, opts.asyncOp);
}

ProcessGroupHCA::Step ProcessGroupHCA::allgather_step(const at::Tensor& output, const at::Tensor& input,
                                                      const char* name) const {
  const DType dtype = checked_dtype(input, name);
  checked_dtype(output, name);
  check_same_layout(output, input, input.numel() * getSize(), "the output", name);
  Step step{plan_allgather({dtype, static_cast<size_t>(input.numel())}, getSize()), {}, ReduceOp::Sum,
            signature(name, describe_tensors({input}))};
  for (int j = 0; j < getSize(); ++j) step.spans.push_back({input.data_ptr(), byte_offset(output, j * input.numel())});
  return step;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(inputs.size() == 1 && outputs.size() == 1, "hca allgather: expects one input tensor and one "
                    "output list, got ", inputs.size(), " and ", outputs.size());
  if (passes_through()) return engine_for(inputs[0], "allgather").allgather(outputs, inputs, opts);
  const at::Tensor& input = inputs[0];
  auto& list = outputs[0];
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == getSize(), "hca allgather: the output list has ", list.size(),
                    " tensors, expected one per rank (", getSize(), ")");
  const DType dtype = checked_dtype(input, "allgather");
  for (const auto& out : list) {
    checked_dtype(out, "allgather");
    check_same_layout(out, input, input.numel(), "an output tensor", "allgather");
  }
  std::vector<at::Tensor> all = list;
  all.push_back(input);
  DenseTensors dense(all);
  Step step{plan_allgather({dtype, static_cast<size_t>(input.numel())}, getSize()), {}, ReduceOp::Sum,
            signature("allgather", describe_tensors({input}))};
  for (int j = 0; j < getSize(); ++j) step.spans.push_back({dense.dense().back().data_ptr(), dense.dense()[j].data_ptr()});
  std::vector<Step> steps;
  steps.push_back(std::move(step));
  return launch(c10d::OpType::ALLGATHER, std::move(steps), std::move(dense), list, timeout_or_default(opts.timeout),
                opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  if (passes_through()) return engine_for(input, "allgather_into_tensor")._allgather_base(output, input, opts);
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                std::vector<at::Tensor>& inputs,
                                                                                const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "hca allgather_into_tensor: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  check_nonempty(inputs.size(), "the input list", "allgather_into_tensor");
  if (passes_through()) return engine_for(inputs[0], "allgather_into_tensor").allgather_into_tensor_coalesced(outputs, inputs, opts);
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  DenseTensors dense(all);
  std::vector<Step> steps;
  for (size_t i = 0; i < inputs.size(); ++i) {
    steps.push_back(allgather_step(dense.dense()[i], dense.dense()[outputs.size() + i], "allgather_into_tensor"));
  }
  return launch(c10d::OpType::_ALLGATHER_BASE, std::move(steps), std::move(dense), outputs,
                timeout_or_default(opts.timeout), opts.asyncOp);
}

ProcessGroupHCA::Step ProcessGroupHCA::reduce_scatter_step(const at::Tensor& output, const at::Tensor& input,
                                                           const c10d::ReduceOp& op, const char* name) const {
  const DType dtype = checked_dtype(output, name);
  checked_dtype(input, name);
  check_same_layout(input, output, output.numel() * getSize(), "the input", name);
  const ReduceOp rop = checked_reduce_op(op, dtype, name);
  Step step{plan_reduce_scatter({dtype, static_cast<size_t>(output.numel())}, getSize(), options_), {}, rop,
            signature(name, describe_tensors({output}) + ", " + op_name(rop))};
  for (int j = 0; j < getSize(); ++j) step.spans.push_back({byte_offset(input, j * output.numel()), output.data_ptr()});
  return step;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == 1 && inputs.size() == 1, "hca reduce_scatter: expects one output tensor "
                    "and one input list");
  if (passes_through()) return engine_for(outputs[0], "reduce_scatter").reduce_scatter(outputs, inputs, opts);
  TORCH_CHECK_VALUE(static_cast<int>(inputs[0].size()) == getSize(), "hca reduce_scatter: the input list has ",
                    inputs[0].size(), " tensors, expected one per rank (", getSize(), ")");
  for (const auto& in : inputs[0]) {
    checked_dtype(in, "reduce_scatter");
    check_same_layout(in, outputs[0], outputs[0].numel(), "an input tensor", "reduce_scatter");
  }
  // Stack the inputs so one plan addresses them; the copy costs one pass.
  at::Tensor stacked = at::cat(inputs[0]).reshape({-1});
  std::vector<at::Tensor> outs{outputs[0]}, ins{stacked};
  return reduce_scatter_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  if (passes_through()) return engine_for(output, "reduce_scatter_tensor")._reduce_scatter_base(output, input, opts);
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "hca reduce_scatter_tensor: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  check_nonempty(inputs.size(), "the input list", "reduce_scatter_tensor");
  if (passes_through()) {
    return engine_for(inputs[0], "reduce_scatter_tensor").reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  DenseTensors dense(all);
  std::vector<Step> steps;
  for (size_t i = 0; i < inputs.size(); ++i) {
    steps.push_back(reduce_scatter_step(dense.dense()[i], dense.dense()[outputs.size() + i], opts.reduceOp,
                                        "reduce_scatter_tensor"));
  }
  return launch(c10d::OpType::_REDUCE_SCATTER_BASE, std::move(steps), std::move(dense), outputs,
                timeout_or_default(opts.timeout), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::barrier(const c10d::BarrierOptions& opts) {
  if (passes_through()) return cpu_engine_->barrier(opts);
  std::vector<Step> steps(1);
  steps[0].signature = signature("barrier", "");
  return launch(c10d::OpType::BARRIER, std::move(steps), DenseTensors({}), {}, timeout_or_default(opts.timeout),
                opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::endCoalescing() {
  return launch(c10d::OpType::COALESCED, {}, DenseTensors({}), {}, timeout_, true);
}

}  // namespace hca
