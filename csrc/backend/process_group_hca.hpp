// ProcessGroupHCA: the c10d backend "hca" for hierarchical_copy and
// reduce_to_one_device. It reads each call's arguments once, asks the plan for
// packs and schedules, and hands the collective to the executor of the
// tensors' device, in call order, on its work queue.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "../plan/plan.h"
#include "../transport/control/control_block.h"
#include "../transport/cuda/cuda_executor.h"
#include "../transport/executor.h"
#include "call_args.hpp"
#include "store_rendezvous.hpp"
#include "work_hca.hpp"

namespace hca {

class ProcessGroupHCA : public c10d::Backend {
 public:
  // `options` must have been validated (validate(options, size) runs again here).
  ProcessGroupHCA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout, PlanOptions options, size_t shm_slot_bytes, int shm_slots,
                  cuda::CudaConfig cuda_config);
  ~ProcessGroupHCA() override;

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
  // The executor of `device`'s tensors, chosen here and nowhere else;
  // NotImplementedError naming the device where this build has none.
  Executor& executor_for(const at::Device& device, const char* op);
  // Queues `collectives` (which address args' dense tensors) as one Work.
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, CallArgs args, std::vector<Collective> collectives,
                                        std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                                        bool async_op);
#ifdef HCA_WITH_CUDA
  // launch() for CUDA tensors: stream semantics of ProcessGroupNCCL (cuda_call.cpp).
  c10::intrusive_ptr<c10d::Work> launch_cuda(c10d::OpType type, Executor& executor, CallArgs args,
                                             std::vector<Collective> collectives, std::vector<at::Tensor> outputs,
                                             bool async_op);
#endif
  Collective collective(std::vector<PackPlan> plan, std::vector<TensorSpan> spans, ReduceOp op, const char* name,
                        const std::string& details) const;
  Collective allgather_collective(const CallArgs& args, size_t output, size_t input) const;
  Collective reduce_scatter_collective(const CallArgs& args, size_t output, size_t input, ReduceOp op) const;
  std::chrono::milliseconds timeout_or_default(std::chrono::milliseconds timeout) const;

  PlanOptions options_;
  std::chrono::milliseconds timeout_;
  cuda::CudaConfig cuda_config_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<ControlBlock> control_;
  std::unique_ptr<Executor> shm_executor_;
  std::unique_ptr<Executor> cuda_executor_;  // made at the first CUDA collective
  WorkQueue queue_;  // last: its worker stops before the executors go
};

}  // namespace hca
