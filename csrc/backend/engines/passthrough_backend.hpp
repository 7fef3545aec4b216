// The `nccl` algorithm as a wrapper backend: allreduce packs the tensors as the
// seeds do and hands each pack to a stock engine (ProcessGroupNCCL for CUDA
// tensors, ProcessGroupGloo for CPU tensors); every other operation goes to
// the engine as it is.
#pragma once
#include <atomic>
#include <optional>
#include "../../plan/packing.h"
#include "../c10d_overrides.hpp"
#include "../calls/call_args.hpp"
#include "../calls/stream_call.hpp"
#include "../calls/work_hca.hpp"
#include "engine_backend.hpp"

namespace hca {

class PassthroughBackend : public EngineBackend {
 public:
  // `engines.cuda` may be null (torch without NCCL, or no GPU): CUDA tensors are then refused.
  PassthroughBackend(int rank, int size, std::chrono::milliseconds timeout, PackingOptions packing, Engines engines);

  const std::string getBackendName() const override { return "hca"; }
  const PackingOptions& packing() const { return packing_; }

  HCA_OVERRIDE_COLLECTIVES
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout;
    EngineBackend::setTimeout(timeout);
  }

 protected:
  void stop_queue() override { queue_.stop(); }
  WorkQueue& queue() override { return queue_; }

 private:
  // PREMUL_SUM where the engine is gloo, which lacks it: the engine sums, and the
  // results are multiplied by the factor (`scale`) after, in the call's turn (as
  // AVG divides after the sum). NCCL (CUDA tensors) has PREMUL_SUM and gets it as it is.
  // The engine's options for a reduce or reduce-scatter: SUM where `scale` multiplies after.
  template <typename Options>
  static Options summing(const Options& opts, const std::optional<PremulFactor>& scale) {
    Options engine_opts = opts;
    if (scale) engine_opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    return engine_opts;
  }
  // A reduction's `engine_work` into `sums` (the engine's outputs: the caller's, or dense
  // copies that `written` writes back), then the scale where there is one, then the write-back.
  static EngineCall scaled_after(c10::intrusive_ptr<c10d::Work> engine_work, std::vector<at::Tensor> sums,
                                 const std::optional<PremulFactor>& scale, EngineTensors written);
  // A reduce-scatter through gloo: `reduce(outs, ins, opts)`, then the scale or the write-back
  // (scaled_after). Where gloo's MIN or MAX would drop a NaN (nans_go_round), `reduce` runs
  // alike on the tensors' NaN masks (masks_of) after it, and the NaNs are put back first.
  template <typename Inputs, typename Reduce>
  static EngineCall reduce_scatter_through(std::vector<at::Tensor> outs, Inputs ins,
                                           const c10d::ReduceScatterOptions& opts,
                                           const std::optional<PremulFactor>& scale, EngineTensors written,
                                           Reduce reduce);
  // Each tensor's NaN mask (nan_mask), of its shape, for the same call on them.
  static std::vector<at::Tensor> masks_of(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op);
  static std::vector<std::vector<at::Tensor>> masks_of(const std::vector<std::vector<at::Tensor>>& lists,
                                                       c10d::ReduceOp::RedOpType op);
  // `call`, then, once `masks_work` (that call on `masks`) is done, the NaNs they mark put back
  // into `results` (the engine's outputs), before `call`'s own step (a write-back).
  static EngineCall with_nans_put_back(EngineCall call, c10::intrusive_ptr<c10d::Work> masks_work,
                                       std::vector<at::Tensor> results, std::vector<at::Tensor> masks,
                                       c10d::ReduceOp::RedOpType op);
  // An all_gather into slots of different sizes on CPU tensors (dense, flat: `slots`, `input`),
  // which gloo's all_gather refuses: a gloo broadcast from each rank in turn into its slot, as
  // NCCL gathers such slots; this rank's input is copied into its own slot after. `timeout`: the call's.
  EngineCall allgather_by_broadcasts(std::vector<at::Tensor> slots, at::Tensor input,
                                     std::chrono::milliseconds timeout, EngineTensors written);
  // What the ranks of a reduce-scatter agree on (`outputs`: their text).
  static CallTerms reduce_scatter_terms(const std::vector<at::Tensor>& inputs, const std::string& outputs,
                                        const c10d::ReduceScatterOptions& opts);
  std::atomic<std::chrono::milliseconds> timeout_;
  PackingOptions packing_;
  WorkQueue queue_;
};

}  // namespace hca
