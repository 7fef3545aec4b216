// The CPU model of the device: streams on hardware queues that are host threads,
// each running the operations issued on it in order (HostStream), and a StreamDevice over
// them whose staging slots are POSIX shared memory. With it the stream executor
// (deferred waits and writes, the watchdog, releasing streams after a failure)
// runs on CPU tensors, so that CI checks the logic the CUDA executor shares
// with it (TORCH_HCA_CPU_EXECUTOR=streams; the shared-memory executor is faster).
// It is never kinder than a GPU: nothing orders two streams but events,
// progress words and the hardware queue they share (below), the host sees an
// operation's effect only through an event; an operation that throws faults
// the process's model device for good, as a sticky error does a CUDA context
// (later operations on every stream are skipped, every stream's events raise
// the fault); and, where the staging is device memory (staging_place.h),
// touching a peer's staging once that peer died, left or failed, or that of a
// device this process does not see, is such a fault, as reading IPC-mapped
// memory of a process that is gone faults a GPU.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "../control/control_block.h"
#include "../executor.h"
#include "../rendezvous.h"
#include "stream_executor.h"

namespace hca {

// A stream of the model. A GPU runs a process's streams of a device on a few
// hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), the n-th
// stream created on queue n mod that count, each queue in the order its
// operations were issued: an operation that waits (for an event, a peer's
// progress word) holds back every stream's work queued behind it on its queue.
// The model keeps that rule: a queue is a host thread, shared by its streams.
class HostStream {
 public:
  explicit HostStream(int device);
  ~HostStream();  // waits for what was issued (unless called from its queue's thread)
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Runs `op` on the stream's queue after everything issued before it there;
  // once the device has faulted, runs `if_faulted` (if any) with the fault instead.
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
  // Whether the caller is the thread of the stream's queue (running one of its operations).
  bool is_current_thread() const;

  class Queue;  // a hardware work queue (host_streams.cpp)
  struct Counts {  // under the queue's mutex
    uint64_t issued = 0, completed = 0;
  };

 private:
  const int device_;
  std::shared_ptr<Queue> queue_;
  std::shared_ptr<Counts> counts_;  // shared with the queue's entries, which may outlive the stream
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
