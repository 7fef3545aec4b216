// The seam between the c10d glue and the media: a collective is a plan, where
// its tensors live, the op, what every rank must agree on, and a deadline; for
// CUDA tensors also the device and the stream to issue it on. An executor runs
// any plan over its medium (shared memory for CPU tensors, CUDA IPC for CUDA).
#pragma once
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

// CUDA only: set when the executor gave up on an issued collective and
// released the streams waiting in it (its outputs are then undefined).
class Released {
 public:
  void set(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (cause_.empty()) cause_ = cause;
  }
  // Empty while not released.
  std::string cause() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return cause_;
  }

 private:
  mutable std::mutex mutex_;
  std::string cause_;
};

struct Collective {
  std::shared_ptr<const std::vector<PackPlan>> plan;
  std::vector<TensorSpan> tensors;
  ReduceOp op = ReduceOp::Sum;
  // Every rank must pass the same text: a mismatch is reported, not executed.
  std::string signature;
  std::chrono::milliseconds timeout{0};
  // CUDA only: the device of the tensors and the cudaStream_t to issue on.
  int device = -1;
  void* stream = nullptr;
  std::shared_ptr<Released> released;  // may be null
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs (shared memory) or issues in stream order (CUDA) one collective.
  // Throws hca::Failure (timeout, dead peer, mismatched call, earlier failure);
  // once it has thrown, every later call throws too.
  virtual void run(const Collective& collective) = 0;
};

}  // namespace hca
