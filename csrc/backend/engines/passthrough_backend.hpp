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
  std::atomic<std::chrono::milliseconds> timeout_;
  PackingOptions packing_;
  WorkQueue queue_;
};

}  // namespace hca
