// The `nccl` algorithm as a wrapper backend: allreduce packs the tensors as the
// seeds do and hands each pack to a stock engine (ProcessGroupNCCL for CUDA
// tensors, ProcessGroupGloo for CPU tensors); every other operation goes to
// the engine as it is.
#pragma once
#include <atomic>
#include <mutex>
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
  // `one_node_store`: where every rank runs on one node (and there are several), the group's store,
  // through which the ranks set up shared memory for their agreements on CPU calls; else null,
  // and they agree through gloo.
  PassthroughBackend(int rank, int size, std::chrono::milliseconds timeout, PackingOptions packing, Engines engines,
                     const c10::intrusive_ptr<c10d::Store>& one_node_store = {});
  ~PassthroughBackend() override;

  const std::string getBackendName() const override { return "hca"; }
  const PackingOptions& packing() const { return packing_; }
  // Where the ranks agree on CPU calls: "shared memory", "gloo", or "none" (one rank).
  std::string agreements() const {
    return getSize() == 1 ? "none" : agreed_in_shared_memory_ ? "shared memory" : "gloo";
  }

  // Where the ranks agree through shared memory, this rank's first failure there (a peer's
  // timeout, death, abort; its own abort), as ProcessGroupHCA's; else SUCCESS (gloo keeps none).
  c10d::ErrorType getError() override;

  HCA_OVERRIDE_COLLECTIVES
  void setTimeout(std::chrono::milliseconds timeout) override {
    EngineBackend::setTimeout(timeout);  // first: it refuses a negative timeout before anything changes
    timeout_ = timeout;
  }

 protected:
  void stop_queue() override { queue_.stop(); }
  WorkQueue& queue() override { return queue_; }
  void agree(const CallTerms& terms, const char* op) override;
  void end_parts(bool abort) override;

 private:
  std::atomic<std::chrono::milliseconds> timeout_;
  PackingOptions packing_;
  std::unique_ptr<SharedAgreements> shared_;  // null: agreements through gloo (or after a shutdown)
  bool agreed_in_shared_memory_ = false;
  std::mutex shared_mutex_;         // get_error beside a shutdown's release of `shared_`
  uint32_t failure_at_end_ = 0;     // this rank's failure word when `shared_` was released
  WorkQueue queue_;
};

}  // namespace hca
