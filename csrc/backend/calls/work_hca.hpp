// Work objects and the ordered queue behind them: collectives run one at a
// time, in call order, on a worker thread (or inline: a blocking call with
// nothing queued, or a queued Work waited on before the worker took it); each
// Work completes a Future, which DDP reads; its callbacks may issue collectives.
#pragma once
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "../group/owning_process.hpp"

namespace hca {

// How long a waiter polls before it sleeps (a futex wake-up costs tens of microseconds).
constexpr std::chrono::microseconds kPollBeforeSleeping{100};

// What a Work on device tensors adds to its host body: work issued to a
// device stream, which the caller's stream must order after.
class DeviceCompletion {
 public:
  virtual ~DeviceCompletion() = default;
  virtual std::vector<c10::Device> devices() const = 0;
  // The device finished what the body issued (never blocks).
  virtual bool query() const = 0;
  // The caller's current stream waits for it (on a GPU the host does not).
  virtual void make_current_stream_wait() const = 0;
  // Completes `future` so that its users' streams wait for the device.
  virtual void complete(c10::ivalue::Future& future, const c10::IValue& value) const = 0;
  // DistBackendError if the device work was released unfinished after a failure
  // (known only once the failure has been detected; later calls raise it too).
  virtual void check_released() const = 0;
};

class WorkQueueState;

// What Backend.get_error says of a rank whose first published failure is `kind` (a FailureKind,
// 0 while healthy): a peer's failure or death is REMOTE_ERROR, a timeout TIMEOUT.
c10d::ErrorType error_type(uint32_t kind);

class WorkHCA : public c10d::Work {
 public:
  // `device` (optional): the stream work the body issues (what it reads and
  // writes is kept alive by whoever watches the stream, not by the Work: DDP
  // keeps only the Future).
  // `title`: the profiler's name for it, if not the op's ("hca:all_reduce"): hca's own calls.
  WorkHCA(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::function<void()> body,
          std::shared_ptr<DeviceCompletion> device = nullptr, const char* title = nullptr);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  // The Future completes first; these follow it, so a Future waiter sees a completed Work.
  bool isCompleted() override { return future_->completed() && (!device_ || device_->query()); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Whether the body issues work to a device stream (the host's end is not the call's).
  bool on_device() const { return device_ != nullptr; }
  // Milliseconds from the call to its end, for a call the host ran to its end (the Flight
  // Recorder's duration); device work is not timed, nor a call not ended well: it throws.
  float getDuration() const override;
  // Waits for the host body: without a timeout, runs it here if it is next in
  // its queue and the worker has not taken it (no thread hand-off), else waits
  // for the worker. For device work, the caller's current stream then waits for the
  // device, without blocking the host; with a `timeout`, the host waits for the device too
  // and raises DistBackendError once it has passed.
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override;
  // Runs the body: the error it threw, if any (complete() follows, outside the queue's lock).
  std::exception_ptr run_body();
  // Lets go of the body's closure (and what it holds), once the Work is complete.
  void release_body();
  // Completes the Work and its Future (a Work without a body, e.g. a send); a failed one
  // writes the process's Flight Recorder dump first (flight_record.hpp), unless `dump` is
  // false: the failure is this rank's own ending of the group, not the call's.
  void complete(std::exception_ptr error, bool dump = true);

 private:
  friend class WorkQueue;
  friend class WorkQueueState;
  OwningProcess owner_;
  std::weak_ptr<WorkQueueState> queue_;  // set while queued; the queue may go first
  std::chrono::steady_clock::time_point queued_at_;
  const std::chrono::steady_clock::time_point made_at_ = std::chrono::steady_clock::now();
  std::atomic<int64_t> duration_ns_{-1};  // set once a host call ended well
  std::vector<at::Tensor> outputs_;
  std::function<void()> body_;
  std::shared_ptr<DeviceCompletion> device_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A send or receive, completed by the mailbox; a receive from any source
// reports who sent (dist.recv returns it).
class PointToPointWork final : public WorkHCA {
 public:
  // `device`: the stream copies of a device tensor's message (see WorkHCA).
  PointToPointWork(int rank, c10d::OpType type, std::vector<at::Tensor> tensors,
                   std::shared_ptr<DeviceCompletion> device = nullptr)
      : WorkHCA(rank, type, std::move(tensors), nullptr, std::move(device)) {}
  int sourceRank() const override { return source_.load(); }
  void set_source(int rank) { source_.store(rank); }

 private:
  std::atomic<int> source_{-1};
};

class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();
  // Queues the work; a blocking call (run_inline) with nothing queued runs on
  // the caller's thread, which saves two thread hand-offs per collective.
  // DistBackendError in a process forked from the one that made the queue,
  // or once the queue has stopped.
  void submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline);
  // Runs what is queued, then ends the worker threads (once; the destructor calls it).
  void stop();

 private:
  OwningProcess owner_;
  std::shared_ptr<WorkQueueState> state_;  // shared with the Works it holds; owns the threads
};

}  // namespace hca
