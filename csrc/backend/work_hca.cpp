#include "work_hca.hpp"

#include <ATen/core/jit_type.h>

namespace hca {
namespace {

// Yields until `done` holds or kPollBeforeSleeping has passed; the caller sleeps after.
template <class Done>
void poll_briefly(Done done) {
  const auto until = std::chrono::steady_clock::now() + kPollBeforeSleeping;
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
}

}  // namespace

// The queue's state, which a queued Work's wait() reaches too (it may outlive the WorkQueue).
class WorkQueueState {
 public:
  // See WorkQueue::submit.
  void submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline);
  // Runs `work` on this thread if it is next and the worker is idle; false if not.
  bool run_if_next(const WorkHCA& work);
  // The worker thread's loop, until stop().
  void loop();
  void stop();

 private:
  // Pops the head of the queue; mutex_ held.
  c10::intrusive_ptr<WorkHCA> take_front();
  std::mutex mutex_;
  std::mutex running_;  // held while a collective runs, on any thread
  std::condition_variable ready_;
  std::deque<c10::intrusive_ptr<WorkHCA>> queue_;
  size_t unfinished_ = 0;  // queued or running after being queued
  std::atomic<size_t> queued_{0};  // queue_.size(), read while polling without the lock
  bool worker_busy_ = false;  // the worker took a Work and has not finished it
  bool sleeping_ = false;  // the worker waits on ready_
  bool stop_ = false;
};

WorkHCA::WorkHCA(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::function<void()> body,
                 std::shared_ptr<DeviceCompletion> device, std::vector<at::Tensor> stash)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      body_(std::move(body)),
      device_(std::move(device)),
      stash_(std::move(stash)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       device_ ? device_->devices() : std::vector<c10::Device>{})) {}

bool WorkHCA::wait(std::chrono::milliseconds timeout) {
  // Not with a timeout of its own: the caller then expects control back within it.
  if (timeout == kNoTimeout) {
    if (auto queue = queue_.lock()) queue->run_if_next(*this);
  }
  // A small collective ends within microseconds: poll a little before sleeping
  // on the condition variable, whose wake-up costs more than the collective.
  poll_briefly([this] { return c10d::Work::isCompleted(); });
  const bool done = c10d::Work::wait(timeout);
  synchronize();
  return done;
}

void WorkHCA::synchronize() {
  if (!device_) return;
  device_->make_current_stream_wait();
  stash_.clear();
  device_->check_released();
}

void WorkHCA::execute() {
  std::exception_ptr error;
  try {
    body_();
  } catch (...) {
    error = std::current_exception();
  }
  body_ = nullptr;
  complete(error);
}

void WorkHCA::complete(std::exception_ptr error) {
  if (error) {
    future_->setError(error);
    finish(error);
  } else {
    const c10::IValue value(outputs_);
    if (device_) {
      device_->complete(*future_, value);
    } else {
      future_->markCompleted(value);
    }
    finish();
  }
}

void WorkQueueState::submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline) {
  std::unique_lock<std::mutex> running;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!run_inline || unfinished_ > 0) {
      queue_.push_back(work);
      ++unfinished_;
      queued_.fetch_add(1, std::memory_order_release);
      if (sleeping_) ready_.notify_one();
      return;
    }
    // Nothing is queued; taken under mutex_, so later submissions run after us.
    running = std::unique_lock<std::mutex>(running_);
  }
  work->execute();
}

bool WorkQueueState::run_if_next(const WorkHCA& work) {
  c10::intrusive_ptr<WorkHCA> taken;
  std::unique_lock<std::mutex> running;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (worker_busy_ || queue_.empty() || queue_.front().get() != &work) return false;
    taken = take_front();
    // Everything before it has finished; taken under mutex_, so the worker's next Work waits for it.
    running = std::unique_lock<std::mutex>(running_);
  }
  taken->execute();
  running.unlock();
  std::lock_guard<std::mutex> lock(mutex_);
  --unfinished_;
  return true;
}

c10::intrusive_ptr<WorkHCA> WorkQueueState::take_front() {
  auto work = std::move(queue_.front());
  queue_.pop_front();
  queued_.fetch_sub(1, std::memory_order_relaxed);
  return work;
}

void WorkQueueState::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (queue_.empty() && !stop_) {
      // Poll a little before sleeping: the next async call often follows at once.
      lock.unlock();
      poll_briefly([this] { return queued_.load(std::memory_order_acquire) > 0; });
      lock.lock();
      sleeping_ = true;
      ready_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      sleeping_ = false;
    }
    if (queue_.empty()) return;
    auto work = take_front();
    worker_busy_ = true;
    lock.unlock();
    {
      std::lock_guard<std::mutex> running(running_);
      work->execute();
    }
    lock.lock();
    worker_busy_ = false;
    --unfinished_;
  }
}

void WorkQueueState::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    queued_.fetch_add(1, std::memory_order_release);  // ends a poll at once
  }
  ready_.notify_all();
}

WorkQueue::WorkQueue() : state_(std::make_shared<WorkQueueState>()), worker_([state = state_.get()] { state->loop(); }) {}

WorkQueue::~WorkQueue() {
  state_->stop();
  worker_.join();  // after the queued Works have run
}

void WorkQueue::submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline) {
  work->queue_ = state_;
  state_->submit(work, run_inline);
}

}  // namespace hca
