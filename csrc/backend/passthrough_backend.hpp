// The `nccl` algorithm as a wrapper backend: allreduce packs the tensors as the
// seeds do and hands each pack to a stock engine (ProcessGroupNCCL for CUDA
// tensors, ProcessGroupGloo for CPU tensors); every other collective goes to
// the engine as it is. The same wrapper will carry the node leaders' stage of
// multi-node.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "../plan/packing.h"
#include "work_hca.hpp"

namespace hca {

class PassthroughBackend : public c10d::Backend {
 public:
  // `cuda_engine` may be null (torch without NCCL, or no GPU): CUDA tensors are then refused.
  PassthroughBackend(int rank, int size, std::chrono::milliseconds timeout, PackingOptions packing,
                     c10::intrusive_ptr<c10d::Backend> cpu_engine, c10::intrusive_ptr<c10d::Backend> cuda_engine);

  const std::string getBackendName() const override { return "hca"; }
  const PackingOptions& packing() const { return packing_; }

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
  void startCoalescing() override {}
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

 private:
  c10d::Backend& engine_for(const at::Tensor& tensor, const char* op) const;

  std::chrono::milliseconds timeout_;
  PackingOptions packing_;
  c10::intrusive_ptr<c10d::Backend> cpu_engine_, cuda_engine_;
  WorkQueue queue_;
};

}  // namespace hca
