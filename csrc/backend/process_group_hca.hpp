// ProcessGroupHCA: the c10d backend "hca". It checks arguments, asks the plan
// for packs and schedules, and hands them to the transport of the tensors'
// device on its ordered executor.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "../plan/plan.h"
#include "../transport/nccl/passthrough.hpp"
#include "../transport/shm/transport.h"
#include "store_rendezvous.hpp"
#include "tensor_args.hpp"
#include "work_hca.hpp"

namespace hca {

class ProcessGroupHCA : public c10d::Backend {
 public:
  // `cpu_engine` / `cuda_engine`: the stock backends of the `nccl` algorithm
  // (null otherwise; a null CUDA engine means CUDA tensors are refused).
  ProcessGroupHCA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout, PlanOptions options, size_t chunk_bytes,
                  c10::intrusive_ptr<c10d::Backend> cpu_engine, c10::intrusive_ptr<c10d::Backend> cuda_engine);

  const std::string getBackendName() const override { return "hca"; }
  const PlanOptions& options() const { return options_; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // The coalescing manager batches in Python (allreduce_coalesced etc.); the
  // end of a batch is a Work that completes after everything issued before it.
  void startCoalescing() override {}
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

 private:
 public:
  // One transport call: a plan, where its tensors live, and what all ranks must agree on.
  struct Step {
    std::vector<PackPlan> plan;
    std::vector<shm::TensorSpan> spans;
    ReduceOp op = ReduceOp::Sum;
    std::string signature;
  };
 private:
  Step allgather_step(const at::Tensor& output, const at::Tensor& input, const char* name) const;
  Step reduce_scatter_step(const at::Tensor& output, const at::Tensor& input, const c10d::ReduceOp& op,
                           const char* name) const;
  // Queues `steps` as one Work; `dense` holds the tensors they address and is
  // written back to the caller's tensors afterwards.
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, std::vector<Step> steps, DenseTensors dense,
                                        std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                                        bool async_op);
  // A Work running `body` on the executor (inline for a blocking call with nothing queued).
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, std::vector<at::Tensor> outputs, bool async_op,
                                        std::function<void()> body);
  // One step over `tensors`, read and written in place (allreduce, broadcast, reduce).
  c10::intrusive_ptr<c10d::Work> launch_in_place(c10d::OpType type, std::vector<at::Tensor>& tensors,
                                                 std::vector<PackPlan> plan, ReduceOp op, std::string signature,
                                                 std::chrono::milliseconds timeout, bool async_op);
  std::string signature(const char* name, const std::string& details) const;
  bool passes_through() const { return options_.algorithm == Algorithm::Nccl; }
  c10d::Backend& engine_for(const at::Tensor& tensor, const char* name) const;
  c10::intrusive_ptr<c10d::Work> packed_allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                                  std::chrono::milliseconds timeout, bool async_op);
  std::chrono::milliseconds timeout_or_default(std::chrono::milliseconds timeout) const;

  PlanOptions options_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<shm::Transport> shm_;  // null in pass-through mode
  c10::intrusive_ptr<c10d::Backend> cpu_engine_, cuda_engine_;
  Executor executor_;  // last: its worker stops before the transport goes
};

}  // namespace hca
