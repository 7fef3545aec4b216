#include "progress.h"

#include <algorithm>
#include <atomic>

#include "../control/wait.h"
#include "mailbox.h"

namespace hca::shm {
namespace {

// The number of the progress thread this is (0: none), whether it still moves
// messages or has handed that role on and runs the callbacks it had taken.
thread_local uint64_t this_thread_number = 0;

}  // namespace

Progress& Progress::of_process() {
  // Never freed: a thread may still be returning from run() at exit.
  static std::atomic<Progress*> current{nullptr};
  Progress* progress = current.load();
  while (!progress || progress->pid_ != getpid()) {
    auto* made = new Progress();
    if (current.compare_exchange_strong(progress, made)) return *made;
    delete made;  // another thread made this process's first
  }
  return *progress;
}

bool Progress::on_progress_thread() { return this_thread_number != 0; }

void Progress::before_blocking() {
  if (this_thread_number == 0) return;
  Progress& progress = of_process();
  std::lock_guard<std::mutex> lock(progress.mutex_);
  if (progress.runner_ == this_thread_number) progress.start_runner();
}

void Progress::posted(Mailbox& mailbox) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(members_.begin(), members_.end(), &mailbox) == members_.end()) members_.push_back(&mailbox);
    ++posts_;
    if (runner_ == 0 || runner_ == this_thread_number) start_runner();
  }
  wake_.notify_all();
}

void Progress::leave(Mailbox& mailbox) {
  std::vector<std::pair<uint64_t, std::thread>> ending;
  {
    std::lock_guard<std::mutex> stepping(stepping_);  // waits for a pass that may be stepping it
    std::lock_guard<std::mutex> lock(mutex_);
    members_.erase(std::remove(members_.begin(), members_.end(), &mailbox), members_.end());
    // A progress thread cannot join itself: with nothing left to move, the
    // threads return, and the next start joins them.
    if (!members_.empty() || on_progress_thread()) return;
    runner_ = 0;
    ending.swap(threads_);
    returned_.clear();
  }
  wake_.notify_all();
  for (auto& [number, thread] : ending) thread.join();
}

void Progress::start_runner() {
  for (auto it = threads_.begin(); it != threads_.end();) {
    if (std::find(returned_.begin(), returned_.end(), it->first) == returned_.end()) {
      ++it;
      continue;
    }
    it->second.join();  // it has returned from run(): at once
    it = threads_.erase(it);
  }
  returned_.clear();
  runner_ = next_number_++;
  threads_.emplace_back(runner_, std::thread([this, me = runner_] { run(me); }));
}

void Progress::run(uint64_t me) {
  this_thread_number = me;
  std::vector<Mailbox*> members;
  std::vector<Completion> finished;
  auto last_moved = Clock::now();
  while (true) {
    uint64_t posts;
    bool moved = false, busy = false;
    {
      std::lock_guard<std::mutex> stepping(stepping_);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (runner_ == me && members_.empty()) runner_ = 0;
        if (runner_ != me) {
          returned_.push_back(me);
          return;
        }
        members = members_;
        posts = posts_;
      }
      const auto now = Clock::now();
      for (Mailbox* mailbox : members) {
        moved = mailbox->step(now) || moved;
        busy = busy || mailbox->busy();
        mailbox->take_completed(finished);
      }
    }
    // Outside the pass: a callback may post (then another thread moves
    // messages from here on) or end a group (leave() waits for the pass).
    for (Completion& completion : finished) completion();
    moved = moved || !finished.empty();
    finished.clear();
    const auto now = Clock::now();
    if (moved) {
      last_moved = now;
      continue;
    }
    // Back off as the control block's waits do: spin, then yield, then sleep.
    const auto idle = now - last_moved;
    if (idle < std::chrono::microseconds(50)) {
      cpu_relax();
    } else if (idle < std::chrono::milliseconds(1)) {
      sched_yield();
    } else {
      // With nothing of ours in flight, only peers' early messages need draining.
      const auto pause = busy ? std::chrono::microseconds(200) : std::chrono::microseconds(2000);
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait_for(lock, pause, [&] { return runner_ != me || members_.empty() || posts_ != posts; });
    }
  }
}

}  // namespace hca::shm
