// The c10d::Backend operations that hca's backends override (ProcessGroupHCA,
// and EngineBackend's two: the `nccl` algorithm's wrapper and the group across
// nodes), declared once: torch's signatures are long, and copies drift apart.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/version.h>

// torch 2.14 added gather_single (dist.gather_single: the root's parts in one tensor), which
// neither gloo nor hca had before; hca gives it where torch has it.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
#define HCA_HAS_GATHER_SINGLE 1
#define HCA_OVERRIDE_GATHER_SINGLE                                                                                    \
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input,                                 \
                                               const c10d::GatherOptions& opts) override;
#else
#define HCA_HAS_GATHER_SINGLE 0
#define HCA_OVERRIDE_GATHER_SINGLE
#endif

// The collectives every hca backend gives a form of its own.
#define HCA_OVERRIDE_COLLECTIVES                                                                                      \
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts)      \
      override;                                                                                                       \
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,                                \
                                                     const c10d::AllreduceCoalescedOptions& opts) override;           \
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts)      \
      override;                                                                                                       \
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;  \
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,                             \
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts)       \
      override;                                                                                                       \
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,                               \
                                                 const c10d::AllgatherOptions& opts) override;                        \
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(                                                     \
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts)          \
      override;                                                                                                       \
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,                                     \
                                                std::vector<std::vector<at::Tensor>>& inputs,                         \
                                                const c10d::ReduceScatterOptions& opts) override;                     \
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,                          \
                                                      const c10d::ReduceScatterOptions& opts) override;               \
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(                                                     \
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts)      \
      override;                                                                                                       \
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

// Gathers, scatters, all-to-all and point-to-point messages: ProcessGroupHCA's
// own (gather_scatter.cpp, point_to_point.cpp), or handed to the engines.
#define HCA_OVERRIDE_GATHERS_AND_MESSAGES                                                                             \
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,                                \
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;   \
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,                                            \
                                         std::vector<std::vector<at::Tensor>>& inputs,                                \
                                         const c10d::ScatterOptions& opts) override;                                  \
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,                                 \
                                               std::vector<int64_t>& output_splits,                                   \
                                               std::vector<int64_t>& input_splits,                                    \
                                               const c10d::AllToAllOptions& opts) override;                           \
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,          \
                                          const c10d::AllToAllOptions& opts) override;                                \
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,                   \
                                                     std::vector<at::Tensor>& inputs,                                 \
                                                     const c10d::AllgatherOptions& opts) override;                    \
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;                   \
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;                   \
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;                 \
  HCA_OVERRIDE_GATHER_SINGLE

// torch 2.15's completion hooks (Backend.hpp defines C10D_BACKEND_HAS_HOOKS): whoever registers
// one hears of every call of the backend that ended well (flight_record.hpp). Needs `calls()`.
#ifdef C10D_BACKEND_HAS_HOOKS
#define HCA_OVERRIDE_COMPLETION_HOOKS                                                                                 \
  bool supportsCompletionHooks() const override { return true; }                                                      \
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override {                                       \
    calls().flight().add_completion_hook(id, std::move(hook));                                                        \
  }                                                                                                                   \
  void unregisterCompletionHook(int64_t id) override { calls().flight().remove_completion_hook(id); }
#else
#define HCA_OVERRIDE_COMPLETION_HOOKS
#endif
