#include "work_hca.hpp"

#include <ATen/core/jit_type.h>

#include "../../transport/control/failure.h"
#include "../../transport/control/thread_slice.h"
#include "../../transport/control/wait.h"
#include "../../transport/shm/progress.h"
#include "flight_record.hpp"

namespace hca {
namespace {

// How often an idle worker looks at its queue unasked while async calls keep coming
// (see WorkQueueState::submit), and how long without one before it sleeps until notified.
// Each look costs a wake-up, which with more ranks than cores delays the ranks:
// every 200 us made async calls at 3 ranks on 2 cores 1.25-1.7x slower than
// blocking ones, every 1 ms 0.96-1.14x (benchmarks/async_cost.py).
constexpr std::chrono::milliseconds kWatchTick{1};
constexpr std::chrono::milliseconds kWatchBeforeSleeping{5};
// A waiter that comes this soon after its call was queued waits at once (e.g.
// `all_reduce(t, async_op=True).wait()`); one that comes later did something else first.
constexpr std::chrono::microseconds kPromptWait{50};

// Yields until `done` holds or kPollBeforeSleeping has passed; the caller sleeps after.
template <class Done>
void poll_briefly(Done done) {
  const auto until = std::chrono::steady_clock::now() + kPollBeforeSleeping;
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
}

}  // namespace

// The queue's state, which a queued Work's wait() reaches too (it may outlive the WorkQueue).
// One thread at a time, the runner, takes queued Works. A Future's callbacks run on the
// thread that completed it, outside the collective's lock; a callback on the runner that
// issues a collective (PowerSGD's DDP hook waits for the one it issues) first hands the
// runner's role to a spare thread, or it would wait for itself.
class WorkQueueState : public std::enable_shared_from_this<WorkQueueState> {
 public:
  // Starts the first runner.
  void start();
  // See WorkQueue::submit; false once the queue has stopped.
  bool submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline);
  // Runs `work` on this thread if it is next and the runner is idle; false if not.
  bool run_if_next(const WorkHCA& work);
  // Runs what is queued, joins every thread; returns once no waiter runs a Work it took.
  // From a callback of one of its Works on its own thread (a group ended from its
  // Future's callback): another thread runs what is queued, and this one ends
  // once its callbacks return.
  void stop();

 private:
  // A thread's loop: the runner's while it is `me`, else parked until it is again (or stop()).
  void loop(int me);
  // The runner's wait for something queued (or stop()); mutex_ held through `lock`.
  void idle(std::unique_lock<std::mutex>& lock);
  // Lets go of a Work the runner `me` ran and completed; mutex_ not held.
  void release(c10::intrusive_ptr<WorkHCA> work, int me, std::unique_lock<std::mutex>& lock);
  // Pops the head of the queue; mutex_ held.
  c10::intrusive_ptr<WorkHCA> take_front();
  // Makes a parked thread, or a new one, the runner; mutex_ held.
  void hand_off();
  std::mutex mutex_;
  std::mutex running_;  // held while a collective's body runs, on any thread
  std::condition_variable ready_;
  std::condition_variable parked_ready_;
  std::deque<c10::intrusive_ptr<WorkHCA>> queue_;
  size_t unfinished_ = 0;  // queued or running after being queued
  // When the last Work was queued: a watching worker sleeps once that is long ago.
  std::chrono::steady_clock::time_point last_queued_at_;
  const WorkHCA* worker_work_ = nullptr;  // the Work the runner took and has not finished
  bool worker_work_waited_promptly_ = false;  // its waiter came within kPromptWait
  enum class Idle { No, Watching, Sleeping } worker_idle_ = Idle::No;
  // Whether the last queued Work's waiter came within kPromptWait: it ran the Work
  // (WorkHCA::wait) or would have, had the worker not taken it first.
  bool waiters_come_promptly_ = false;
  bool stop_ = false;
  bool joined_ = false;
  std::vector<std::thread> threads_;  // the runner and the parked ones, by number
  std::vector<int> parked_;
  int runner_ = 0;
  int completing_ = 0;  // threads running callbacks of Works they ran: more may be queued
};

namespace {

// Set on a thread while it runs the callbacks of a Work it took as the runner of a queue.
thread_local const WorkQueueState* completing_queue = nullptr;
thread_local int completing_thread = -1;
// Set when a callback on that thread stopped its queue (its completion is then no longer awaited).
thread_local bool stopped_by_callback = false;

// Named as gloo names its own ("gloo:all_reduce"; the flat forms as the list
// forms), with hca's prefix.
const char* profiling_title(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::BROADCAST: return "hca:broadcast";
    case c10d::OpType::ALLREDUCE: return "hca:all_reduce";
    case c10d::OpType::ALLREDUCE_COALESCED: return "hca:all_reduce_coalesced";
    case c10d::OpType::REDUCE: return "hca:reduce";
    case c10d::OpType::ALLGATHER: return "hca:all_gather";
    case c10d::OpType::_ALLGATHER_BASE: return "hca:all_gather";
    case c10d::OpType::ALLGATHER_COALESCED: return "hca:all_gather_coalesced";
    case c10d::OpType::GATHER: return "hca:gather";
    case c10d::OpType::SCATTER: return "hca:scatter";
    case c10d::OpType::REDUCE_SCATTER: return "hca:reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE: return "hca:reduce_scatter";
    case c10d::OpType::ALLTOALL_BASE: return "hca:all_to_all";
    case c10d::OpType::ALLTOALL: return "hca:all_to_all";
    case c10d::OpType::SEND: return "hca:send";
    case c10d::OpType::RECV:
    case c10d::OpType::RECVANYSOURCE: return "hca:recv";
    case c10d::OpType::BARRIER: return "hca:barrier";
    case c10d::OpType::COALESCED: return "hca:coalesced";
    default: return "hca:unknown";
  }
}

}  // namespace

// The profiling title starts a profiler range (when a profiler runs) that ends
// when the Work finishes: traces show hca:<op> over the backend's real work.
WorkHCA::WorkHCA(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::function<void()> body,
                 std::shared_ptr<DeviceCompletion> device, const char* title)
    : c10d::Work(rank, type, title ? title : profiling_title(type)),
      outputs_(std::move(outputs)),
      body_(std::move(body)),
      device_(std::move(device)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       device_ ? device_->devices() : std::vector<c10::Device>{})) {}

bool WorkHCA::wait(std::chrono::milliseconds timeout) {
  owner_.check("wait");  // a forked child has not the threads that complete it
  shm::Progress::before_blocking();  // a message's callback: another thread moves messages meanwhile
  // Not with a timeout of its own: the caller then expects control back within it.
  if (timeout == kNoTimeout) {
    if (auto queue = queue_.lock()) queue->run_if_next(*this);
  }
  // A small collective ends within microseconds: poll a little before sleeping
  // on the condition variable, whose wake-up costs more than the collective.
  poll_briefly([this] { return c10d::Work::isCompleted(); });
  // With a timeout of its own, the host waits for the device too, as ProcessGroupNCCL's does: the
  // caller asked to learn within it whether the call finished (a late peer's call has not). Both
  // are polled first, since c10d's wait ends in synchronize(), which on the model blocks the host.
  if (timeout != kNoTimeout) {
    const auto deadline = deadline_after(timeout);
    const bool finished = poll_until(deadline, [this] { return c10d::Work::isCompleted(); }) &&
                          (!device_ || poll_until(deadline, [this] { return device_->query(); }));
    if (!finished) {
      C10_THROW_ERROR(DistBackendError, "hca " + std::string(c10d::opTypeToString(retrieveOpType())) +
                                            ": Work.wait(timeout=" + std::to_string(timeout.count()) +
                                            " ms) timed out: the call has not finished (a peer has not called it "
                                            "yet, or the device is still at it)");
    }
  }
  const bool done = c10d::Work::wait(timeout);
  synchronize();
  return done;
}

void WorkHCA::synchronize() {
  if (!device_) return;
  device_->make_current_stream_wait();
  try {
    device_->check_released();
  } catch (...) {
    std::rethrow_exception(with_flight_recorder_dump(std::current_exception()));
  }
}

std::exception_ptr WorkHCA::run_body() {
  try {
    body_();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void WorkHCA::release_body() { body_ = nullptr; }

float WorkHCA::getDuration() const {
  const int64_t ns = duration_ns_.load();
  TORCH_CHECK(ns >= 0, "hca: getDuration: only a call the host ran, once it ended well, is timed",
              device_ ? " (this one ran on a device)" : "");
  return static_cast<float>(ns) / 1e6f;
}

void WorkHCA::complete(std::exception_ptr error, bool dump) {
  if (error) {
    if (dump) error = with_flight_recorder_dump(error);
    future_->setError(error);
    finish(error);
  } else {
    const c10::IValue value(outputs_);
    if (device_) {
      device_->complete(*future_, value);
    } else {
      duration_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - made_at_)
                         .count();
      future_->markCompleted(value);
    }
    finish();
  }
}

bool WorkQueueState::submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline) {
  std::unique_lock<std::mutex> running;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (joined_) return false;
    if (!run_inline || unfinished_ > 0) {
      work->queued_at_ = last_queued_at_ = std::chrono::steady_clock::now();
      queue_.push_back(work);
      ++unfinished_;
      if (completing_queue == this && completing_thread == runner_) {
        hand_off();
        return true;
      }
      // A watching worker is not woken while waiters come promptly and run their
      // calls: it would compete with them (and the other ranks) for the cores only
      // to find the queue empty; it still looks within kWatchTick, for a call
      // nobody waits on.
      const bool waiter_expected = waiters_come_promptly_ && queue_.size() == 1;
      if (worker_idle_ == Idle::Sleeping || (worker_idle_ == Idle::Watching && !waiter_expected)) {
        ready_.notify_one();
        worker_idle_ = Idle::No;  // one wake-up is enough, however long it takes to run
      }
      return true;
    }
    // Nothing is queued; taken under mutex_, so later submissions run after us.
    running = std::unique_lock<std::mutex>(running_);
  }
  auto error = work->run_body();
  running.unlock();
  work->complete(error);
  work->release_body();
  return true;
}

void WorkQueueState::hand_off() {
  worker_idle_ = Idle::No;
  if (!parked_.empty()) {
    runner_ = parked_.back();
    parked_.pop_back();
    parked_ready_.notify_all();
    return;
  }
  runner_ = static_cast<int>(threads_.size());
  threads_.emplace_back([self = shared_from_this(), me = runner_] { self->loop(me); });
}

bool WorkQueueState::run_if_next(const WorkHCA& work) {
  c10::intrusive_ptr<WorkHCA> taken;
  std::unique_lock<std::mutex> running;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Read only for a Work that was queued (a blocking call's wait() passes here too).
    const auto prompt = [&] { return std::chrono::steady_clock::now() - work.queued_at_ < kPromptWait; };
    if (worker_work_ || queue_.empty() || queue_.front().get() != &work) {
      if (worker_work_ == &work) worker_work_waited_promptly_ = prompt();
      return false;
    }
    taken = take_front();
    waiters_come_promptly_ = prompt();
    // Everything before it has finished; taken under mutex_, so the worker's next Work waits for it.
    running = std::unique_lock<std::mutex>(running_);
  }
  auto error = taken->run_body();
  running.unlock();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --unfinished_;
  }
  taken->complete(error);
  taken->release_body();
  return true;
}

c10::intrusive_ptr<WorkHCA> WorkQueueState::take_front() {
  auto work = std::move(queue_.front());
  queue_.pop_front();
  return work;
}

void WorkQueueState::loop(int me) {
  prefer_prompt_wakeups();  // its collectives run beside the caller's compute
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (runner_ != me) {
      parked_.push_back(me);
      parked_ready_.wait(lock, [&] { return stop_ || runner_ == me; });
      if (runner_ != me) return;
    }
    idle(lock);
    if (queue_.empty()) return;
    auto work = take_front();
    worker_work_ = work.get();
    worker_work_waited_promptly_ = false;
    lock.unlock();
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> running(running_);
      error = work->run_body();
    }
    lock.lock();
    worker_work_ = nullptr;
    waiters_come_promptly_ = worker_work_waited_promptly_;
    --unfinished_;
    ++completing_;
    lock.unlock();
    completing_queue = this;
    completing_thread = me;
    work->complete(error);
    completing_queue = nullptr;
    release(std::move(work), me, lock);
    lock.lock();
    if (stopped_by_callback) {
      stopped_by_callback = false;  // stop() counted it out already
    } else if (--completing_ == 0 && stop_) {
      ready_.notify_all();
    }
  }
}

void WorkQueueState::release(c10::intrusive_ptr<WorkHCA> work, int me, std::unique_lock<std::mutex>& lock) {
  // Freeing a call's tensors (its closure's, its outputs) may run Python, a finalizer, that
  // waits for the group's next call. So the runner does not free a Work nobody else holds: it
  // hands its role on first, and the next call does not wait for this thread. The closure goes
  // now in any case: what it holds may be what the next call waits for (a stream call's ticket).
  if (work.use_count() == 1) {
    lock.lock();
    if (runner_ == me && !stop_) hand_off();
    lock.unlock();
  }
  work->release_body();
  work.reset();  // not under mutex_
}

void WorkQueueState::idle(std::unique_lock<std::mutex>& lock) {
  // Stopping, it still waits for callbacks running elsewhere, which may queue more.
  while ((!stop_ || completing_ > 0) && queue_.empty()) {
    // Each wake-up (a notify, the tick, a spurious one) returns here: the state
    // must be set again, or a submit would take a waiting worker for a busy one.
    if (std::chrono::steady_clock::now() - last_queued_at_ < kWatchBeforeSleeping) {
      worker_idle_ = Idle::Watching;
      ready_.wait_for(lock, kWatchTick);
    } else {
      // Nothing queued for a while: sleep until a submit notifies (no wake-ups while unused).
      worker_idle_ = Idle::Sleeping;
      ready_.wait(lock);
    }
    worker_idle_ = Idle::No;
  }
}

void WorkQueueState::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  threads_.emplace_back([self = shared_from_this()] { self->loop(0); });  // kept alive by its threads
}

void WorkQueueState::stop() {
  const bool from_callback = completing_queue == this;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return;
    stop_ = true;
    if (from_callback) {
      // Its callbacks are not awaited (they are what stops the queue), and if
      // it runs the queue, another thread runs what is queued.
      stopped_by_callback = true;
      if (--completing_ == 0) ready_.notify_all();
      if (completing_thread == runner_) hand_off();
    }
  }
  ready_.notify_all();
  parked_ready_.notify_all();
  // A callback may hand the runner's role on while the others end: join until none is left.
  while (true) {
    std::thread thread;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (threads_.empty()) {
        joined_ = true;
        break;
      }
      thread = std::move(threads_.back());
      threads_.pop_back();
    }
    if (thread.get_id() == std::this_thread::get_id()) {
      thread.detach();  // this callback's thread: it ends when the callback returns
    } else {
      thread.join();
    }
  }
  std::lock_guard<std::mutex> running(running_);  // a waiter that took the last Work has run it
}

WorkQueue::WorkQueue() : state_(std::make_shared<WorkQueueState>()) { state_->start(); }

WorkQueue::~WorkQueue() {
  if (!owner_.is_current()) {
    leave_in_child(state_);  // the parent's threads: a forked child has none to stop
    return;
  }
  stop();
}

void WorkQueue::stop() { state_->stop(); }

void WorkQueue::submit(const c10::intrusive_ptr<WorkHCA>& work, bool run_inline) {
  if (!owner_.is_current()) owner_.check(c10d::opTypeToString(work->retrieveOpType()).c_str());
  work->queue_ = state_;
  if (!state_->submit(work, run_inline)) {
    const std::string op = c10d::opTypeToString(work->retrieveOpType());
    C10_THROW_ERROR(DistBackendError, "hca " + op + ": the process group was shut down (destroy_process_group, "
                                      "shutdown or abort); create a new one");
  }
}

c10d::ErrorType error_type(uint32_t kind) {
  switch (static_cast<FailureKind>(kind)) {
    case FailureKind::None: return c10d::ErrorType::SUCCESS;
    case FailureKind::Timeout: return c10d::ErrorType::TIMEOUT;
    case FailureKind::PeerDied:
    case FailureKind::PeerFailed:
    case FailureKind::BetweenNodes: return c10d::ErrorType::REMOTE_ERROR;
    default: return c10d::ErrorType::COMM_ERROR;
  }
}

}  // namespace hca
