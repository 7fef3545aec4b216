// The CPU model of the device: streams that are host threads, each running
// the operations issued on it in order (HostStream), and a StreamDevice over
// them whose staging slots are POSIX shared memory. With it the stream executor
// (deferred waits and writes, the watchdog, releasing streams after a failure)
// runs on CPU tensors, so that CI checks the logic the CUDA executor shares
// with it (TORCH_HCA_CPU_EXECUTOR=streams; the shared-memory executor is faster).
// It is never kinder than a GPU: every stream has a thread of its own, nothing
// orders two streams but events and progress words, the host sees an
// operation's effect only through an event; an operation that throws faults
// the process's model device for good, as a sticky error does a CUDA context
// (later operations on every stream are skipped, every stream's events raise
// the fault); and, where the staging is device memory (staging_place.h),
// touching a peer's staging once that peer died, left or failed, or that of a
// device this process does not see, is such a fault, as reading IPC-mapped
// memory of a process that is gone faults a GPU.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "../control/control_block.h"
#include "../executor.h"
#include "../rendezvous.h"
#include "stream_executor.h"

namespace hca {

class HostStream {
 public:
  explicit HostStream(int device);
  ~HostStream();  // runs what was issued, then joins its thread
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Runs `op` on the stream's thread after everything issued before it; once
  // the device has faulted, runs `if_faulted` (if any) with the fault instead.
  void issue(std::function<void()> op, std::function<void(const std::string&)> if_faulted = nullptr);
  int device() const { return device_; }
  // A mark after everything issued so far (an event).
  uint64_t record();
  // Whether the stream has passed `mark`; throws Failure(DeviceFault) once the device faulted.
  bool passed(uint64_t mark) const;
  // Until the stream has passed `mark` (or faulted: throws).
  void synchronize(uint64_t mark) const;
  // As synchronize, for another stream's operation: returns once faulted.
  void wait_passed(uint64_t mark) const;
  // Whether the caller is the stream's own thread (running one of its operations).
  bool is_current_thread() const { return std::this_thread::get_id() == worker_.get_id(); }

 private:
  struct Op {
    std::function<void()> run;
    std::function<void(const std::string&)> if_faulted;
  };
  void work();

  const int device_;
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::deque<Op> queue_;
  uint64_t issued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

// The stream executor over the model (its streams are HostStreams of the
// model's runtime, passed as Collective::stream). For tests:
// TORCH_HCA_MODEL_FAULT_AT=n makes the n-th data operation this device issues
// fault the device; TORCH_HCA_MODEL_CORRUPT_AT=n makes the n-th reduce flip a bit
// of its result's first element (a wrong result, no fault); TORCH_HCA_MODEL_OP_DELAY_MS=ms
// makes every data operation take that much longer (a slow device).
std::unique_ptr<Executor> make_host_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                                    RingLayout ring);

}  // namespace hca
