// The CPU model of the device: a StreamDevice whose streams are host threads,
// each running the operations issued on it in order, over staging slots in
// POSIX shared memory. With it the stream executor (deferred waits and writes,
// the watchdog, releasing streams after a failure) runs on CPU tensors, so that
// CI checks the logic the CUDA executor shares with it
// (TORCH_HCA_CPU_EXECUTOR=streams; the shared-memory executor is faster).
// It is never kinder than a GPU: every stream has a thread of its own, nothing
// orders two streams, the host sees an operation's effect only through an
// event, and an operation that throws faults the process's model device for
// good, as a sticky error does a CUDA context: later operations on every stream
// are skipped, and every stream's events raise the fault.
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
  HostStream();
  ~HostStream();  // runs what was issued, then joins its thread
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Runs `op` on the stream's thread after everything issued before it; once
  // the device has faulted, runs `if_faulted` (if any) with the fault instead.
  void issue(std::function<void()> op, std::function<void(const std::string&)> if_faulted = nullptr);
  // A mark after everything issued so far (an event).
  uint64_t record();
  // Whether the stream has passed `mark`; throws std::runtime_error once it faulted.
  bool passed(uint64_t mark) const;
  // Until the stream has passed `mark` (or faulted: throws).
  void synchronize(uint64_t mark) const;

 private:
  struct Op {
    std::function<void()> run;
    std::function<void(const std::string&)> if_faulted;
  };
  void work();

  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::deque<Op> queue_;
  uint64_t issued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

// The stream executor over the model (its streams are the HostStreams the
// caller issues on, passed as Collective::stream). TORCH_HCA_MODEL_FAULT_AT=n
// (tests) makes the n-th data operation this device issues fault the device.
std::unique_ptr<Executor> make_host_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                                    RingLayout ring);

}  // namespace hca
