// The life of a process group, in one place: open, then ending (shutdown or
// abort: new calls refused, those already inside finish or fail), then ended
// (the group's parts freed). A call that uses the group's parts holds a Call
// while it does, so an ending on another thread never frees what it uses; any
// number of threads may end the group, at once or again.
#pragma once
#include <condition_variable>
#include <functional>
#include <mutex>

#include "owning_process.hpp"

namespace hca {

class GroupLife {
 public:
  // Held by a call while it uses the group's parts; empty when refused (try_enter).
  class Call {
   public:
    Call(Call&& other) noexcept : life_(other.life_) { other.life_ = nullptr; }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    ~Call();
    explicit operator bool() const { return life_ != nullptr; }

   private:
    friend class GroupLife;
    explicit Call(GroupLife* life) : life_(life) {}
    GroupLife* life_;
  };

  // DistBackendError naming `op` in a forked child, or once ending began.
  Call enter(const char* op);
  // An empty Call once ending began (for readers that have an answer then).
  Call try_enter();
  // The first caller ends the group: `stop` (no new work; what is queued runs or
  // fails), then it waits for the calls inside to leave, then `teardown`. An
  // abort, first or not, runs `on_abort` first (unless teardown began), so that
  // the calls inside give up at once. Every caller returns once the group has
  // ended. Does nothing in a forked child (the parts are the parent's).
  void end(bool abort, const std::function<void()>& on_abort, const std::function<void()>& stop,
           const std::function<void()>& teardown);
  const OwningProcess& owner() const { return owner_; }

 private:
  enum class State { Open, Ending, TearingDown, Ended };
  void leave();

  OwningProcess owner_;
  std::mutex mutex_;
  std::condition_variable changed_;
  State state_ = State::Open;
  int inside_ = 0;
  bool aborted_ = false;
};

}  // namespace hca
