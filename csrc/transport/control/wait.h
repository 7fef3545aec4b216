// Waiting for another rank: spin a few hundred cycles (unless the rank waits
// for its turn on this very CPU), yield a little, then
// sleep until the rank rings (a futex on shared memory), so ranks that outnumber
// cores, or share them with other busy processes, give their core away and get
// it back as soon as there is something to do. Every wait has a deadline and
// notices a dead peer.
#pragma once
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <string>
#include <thread>

#include "failure.h"

namespace hca {

using Clock = std::chrono::steady_clock;

struct WaitContext {
  Clock::time_point deadline;
  std::string operation;  // for messages, e.g. "collective #12 allreduce(Float[10], SUM, ...)"
  std::chrono::milliseconds timeout;
};

// Now + timeout, saturated (users pass huge timeouts to mean "never").
inline Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = Clock::now();
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  return timeout >= room ? Clock::time_point::max() : now + timeout;
}

// Polls `ready`, pausing 20 us at first and up to 1 ms, until it holds (true) or `deadline` has
// passed (false): for what has no doorbell to sleep on, such as a device's events.
template <class Ready>
bool poll_until(Clock::time_point deadline, Ready ready) {
  for (auto pause = std::chrono::microseconds(20); !ready();
       pause = std::min(2 * pause, std::chrono::microseconds(1000))) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
  }
  return true;
}

// Throw hca::Failure naming the operation and the rank.
[[noreturn]] void throw_timeout(const WaitContext& ctx, int peer);
[[noreturn]] void throw_dead(const WaitContext& ctx, int peer, int pid);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A futex on a word of memory shared between processes (not FUTEX_PRIVATE):
// sleeps while `word` holds `expected`, for at most `at_most`, or until woken.
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::microseconds at_most) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a plain 32-bit word");
  const timespec timeout{static_cast<time_t>(at_most.count() / 1000000), static_cast<long>(at_most.count() % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &timeout, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// How long a waiter yields before it sleeps: a peer rank sharing its core
// runs at once (a switch, no wake-up), and a short wait costs no wake-up.
constexpr std::chrono::microseconds kYieldBeforeSleeping{1000};
// A yield that came back this long after the peer rang lost the core for a
// time slice (4 ms here). If another process took it (every round of a
// one-pack all-reduce beside busy processes took that long), a sleeper's
// wake-up takes the core back at once, so the process's waits then sleep
// without yielding for a while. If the group's ranks took it (more ranks than
// cores, computing beside their collectives), yields stay: they hand the core
// between ranks without a wake-up's cost.
constexpr std::chrono::microseconds kLateAfterYield{2000};
constexpr std::chrono::milliseconds kNoYieldsAfterALateOne{1000};
// The longest sleep: a wait still looks at its deadline, its own failure (an
// abort from another thread rings no peer's doorbell) and the peer's life.
constexpr std::chrono::microseconds kLongestSleep{5000};

// Until when this process's waits sleep without yielding (a steady_clock count).
inline std::atomic<Clock::rep>& yields_off_until() {
  static std::atomic<Clock::rep> until{0};
  return until;
}

// Until ready(); every 50 ms asks alive() whether `peer` is still there, and
// calls gone() (which throws) if it is not. sleep(at_most) blocks until the
// peer rings its doorbell (or at_most has passed; it may return early);
// last_rung() is when it last rang; outsiders_busy() whether processes other
// than the ranks keep the cores busy (asked after a late yield only).
// peer_may_be_running: false where the peer waits for this thread's CPU, which
// no spin (256 pauses: 6 us on this project's VM) gives it.
template <class Ready, class Alive, class Gone, class Sleep, class LastRung, class OutsidersBusy>
void wait_for(Ready ready, Alive alive, Gone gone, Sleep sleep, LastRung last_rung, OutsidersBusy outsiders_busy,
              bool peer_may_be_running, const WaitContext& ctx, int peer) {
  for (int i = 0; peer_may_be_running && i < 256; ++i) {
    if (ready()) return;
    cpu_relax();
  }
  const auto start = Clock::now();
  bool yielding = start.time_since_epoch().count() >= yields_off_until().load(std::memory_order_relaxed);
  auto next_liveness_check = start + std::chrono::milliseconds(50);
  while (!ready()) {
    auto now = Clock::now();
    if (yielding && now - start < kYieldBeforeSleeping) {
      sched_yield();
      now = Clock::now();
      if (ready() && now - last_rung() > kLateAfterYield && outsiders_busy()) {
        yields_off_until().store((now + kNoYieldsAfterALateOne).time_since_epoch().count(), std::memory_order_relaxed);
      }
    } else {
      sleep(kLongestSleep);
      now = Clock::now();
    }
    if (now > next_liveness_check) {
      if (!alive()) {
        if (ready()) return;
        gone();
      }
      next_liveness_check = now + std::chrono::milliseconds(50);
    }
    if (now > ctx.deadline) {
      if (ready()) return;
      throw_timeout(ctx, peer);
    }
  }
}

}  // namespace hca
