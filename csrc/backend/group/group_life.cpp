#include "group_life.hpp"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>

namespace hca {

GroupLife::Call::~Call() {
  if (life_) life_->leave();
}

GroupLife::Call GroupLife::enter(const char* op) {
  owner_.check(op);
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::Open) {
    const char* how = aborted_ ? "aborted" : "shut down";
    const char* when = state_ == State::Ended ? " was " : " is being ";
    C10_THROW_ERROR(DistBackendError, std::string("hca ") + op + ": this process group" + when + how +
                                          " (destroy_process_group, shutdown or abort); create a new one");
  }
  ++inside_;
  return Call(this);
}

GroupLife::Call GroupLife::try_enter() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::Open || !owner_.is_current()) return Call(nullptr);
  ++inside_;
  return Call(this);
}

void GroupLife::leave() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (--inside_ == 0) changed_.notify_all();
}

void GroupLife::end(bool abort, const std::function<void()>& on_abort, const std::function<void()>& stop,
                    const std::function<void()>& teardown) {
  if (!owner_.is_current()) return;
  std::unique_lock<std::mutex> lock(mutex_);
  if (abort && !aborted_ && (state_ == State::Open || state_ == State::Ending)) {
    aborted_ = true;
    ++inside_;  // held as a call: teardown waits for it
    lock.unlock();
    {
      const Call held(this);
      on_abort();
    }
    lock.lock();
  }
  if (state_ != State::Open) {
    changed_.wait(lock, [this] { return state_ == State::Ended; });
    return;
  }
  state_ = State::Ending;
  lock.unlock();
  stop();
  lock.lock();
  changed_.wait(lock, [this] { return inside_ == 0; });
  state_ = State::TearingDown;
  lock.unlock();
  teardown();
  lock.lock();
  state_ = State::Ended;
  changed_.notify_all();
}

}  // namespace hca
