// The executor for CPU tensors: POSIX shared memory between the ranks of one
// node. Its staging region (a ring of slots per rank) is a segment of its own;
// progress and failures go through the node's control block.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "../control/control_block.h"
#include "../executor.h"
#include "../medium.h"
#include "../round_runner.h"

namespace hca::shm {

// Every rank's ring of `slots` staging slots of `slot_bytes` in one segment
// published under `key`, rank r's ring first at r * slots * slot_bytes. Ranks
// whose TORCH_HCA_SHM_CHUNK_BYTES / TORCH_HCA_SHM_SLOTS differ fail, naming both.
std::unique_ptr<SharedSegment> staging_segment(Rendezvous& rendezvous, const std::string& key, int rank, int world,
                                               size_t slot_bytes, int slots, std::chrono::milliseconds timeout);

// Every operation runs at once on the calling thread.
class HostMedium final : public Medium {
 public:
  HostMedium(ControlBlock& control, char* region, size_t slot_bytes, int slots);
  char* staging(int rank, uint64_t round) const override;
  size_t slot_bytes() const override { return slot_bytes_; }
  int slots() const override { return slots_; }
  void copy(void* dst, const void* src, size_t bytes) override;
  void reduce(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t n,
              void* out, int divisor) override;
  void wait(int peer, uint32_t at_least, const WaitContext& ctx) override;
  bool reached_now(int peer, uint32_t at_least) const override;
  void signal(uint32_t value) override;

 private:
  ControlBlock& control_;
  char* region_;
  size_t slot_bytes_;
  int slots_;
};

class ShmExecutor final : public Executor {
 public:
  // `slot_bytes` (TORCH_HCA_SHM_CHUNK_BYTES) and `slots` must agree across ranks.
  ShmExecutor(ControlBlock& control, Rendezvous& rendezvous, size_t slot_bytes, int slots,
              std::chrono::milliseconds timeout);
  void run(const Collective& collective) override;
  std::string staging() const override { return "host shared memory (a POSIX segment every rank maps)"; }
  size_t staging_slot_bytes() const override { return medium_->slot_bytes(); }

 private:
  ControlBlock& control_;
  std::unique_ptr<SharedSegment> region_;
  std::unique_ptr<HostMedium> medium_;
  std::unique_ptr<RoundRunner> runner_;
};

}  // namespace hca::shm
