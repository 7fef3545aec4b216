// The seam between the c10d glue and the media: a collective is a plan, where
// its tensors live, the op, what every rank must agree on, and a deadline; for
// CUDA tensors also the device and the stream to issue it on. An executor runs
// any plan over its medium (shared memory for CPU tensors, CUDA IPC for CUDA).
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../plan/plan.h"

namespace hca {

// Where tensor t of a plan's segments is read from (in) and written to (out).
struct TensorSpan {
  const void* in;
  void* out;
};

// Stream media only: what the executor tells about one call issued on a stream
// (its collectives and what the caller issued after them, see end_call).
class Issued {
 public:
  // The executor gave up on it and released the streams waiting in it (its
  // outputs are then undefined); the first cause is kept.
  void release(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (cause_.empty()) cause_ = cause;
  }
  // Empty while not released.
  std::string cause() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return cause_;
  }
  // The device has passed the end of the call, and no peer's failure released it.
  void settle() { settled_.store(true, std::memory_order_release); }
  // Settled, or released: nothing more will happen to it.
  bool over() const { return settled_.load(std::memory_order_acquire) || !cause().empty(); }

 private:
  mutable std::mutex mutex_;
  std::string cause_;
  std::atomic<bool> settled_{false};
};

struct Collective {
  std::shared_ptr<const std::vector<PackPlan>> plan;
  std::vector<TensorSpan> tensors;
  ReduceOp op = ReduceOp::Sum;
  // Every rank must pass the same text: a mismatch is reported, not executed.
  std::string signature;
  std::chrono::milliseconds timeout{0};
  // One of hca's own (the self-test, a count exchange): errors name it by its
  // signature, not by a user's collective number.
  bool internal = false;
  // Stream media only: the device of the tensors, the stream to issue on (a
  // cudaStream_t, or a host stream of the CPU model), the call it belongs to,
  // and what must stay alive until the device has finished with it (the
  // memory it reads and writes: a freed buffer is reused at once).
  int device = -1;
  void* stream = nullptr;
  std::shared_ptr<Issued> issued;
  std::shared_ptr<const void> keep;
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs (shared memory) or issues in stream order (CUDA) one collective.
  // Throws hca::Failure (timeout, dead peer, mismatched call, earlier failure);
  // once it has thrown, every later call throws too, but after a mismatched call
  // (found by every rank before any byte moved), after which the group goes on.
  virtual void run(const Collective& collective) = 0;
  // Stream media only, after a call's last collective and whatever the caller
  // issued on `stream` after it: keeps `keep` alive until the device has passed
  // this point, then settles `issued` (or releases it, after a failure). Media
  // that finish each collective in run() have nothing to do.
  virtual void end_call(void* stream, std::shared_ptr<Issued> issued, std::shared_ptr<const void> keep) {}
  // Where the staging lives, in words (for torch_hca.hierarchy and explain);
  // empty while it is not set up (stream media set it up at the first collective).
  virtual std::string staging() const = 0;
  // Bytes of one rank's staging slot, which cuts large packs into rounds (for
  // explain); 0 while the staging is not set up.
  virtual size_t staging_slot_bytes() const = 0;
  // Stream media only: the waits on peers' progress words issued so far (each
  // a switch between processes on a shared GPU unless the peer is past it), for
  // tests against explain's count; 0 elsewhere.
  virtual uint64_t peer_waits() const { return 0; }
};

}  // namespace hca
