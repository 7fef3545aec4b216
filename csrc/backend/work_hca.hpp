// Work objects and the ordered queue behind them: collectives run one at a
// time, in call order, on a worker thread (or inline for a blocking call with
// nothing queued); each Work completes a Future, which DDP reads.
#pragma once
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace hca {

class WorkHCA : public c10d::Work {
 public:
  WorkHCA(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::function<void()> body);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  // The Future completes first; these follow it, so a Future waiter sees a completed Work.
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Runs the body and completes the Work and its Future (with the error, if any).
  void execute();

 private:
  std::vector<at::Tensor> outputs_;
  std::function<void()> body_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();
  // Queues the work; a blocking call (run_inline) with nothing queued runs on
  // the caller's thread, which saves two thread hand-offs per collective.
  void submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline);

 private:
  void loop();
  std::mutex mutex_;
  std::mutex running_;  // held while a collective runs, on either thread
  std::condition_variable ready_;
  std::deque<c10::intrusive_ptr<WorkHCA>> queue_;
  size_t unfinished_ = 0;  // queued or running on the worker
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace hca
