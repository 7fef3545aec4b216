// Waiting for another rank: spin a few hundred cycles, then yield, then sleep
// with growing pauses, so ranks that outnumber cores back off instead of
// spinning a core away. Every wait has a deadline and notices a dead peer.
#pragma once
#include <sched.h>

#include <chrono>
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

// Until ready(); every 50 ms asks alive() whether `peer` is still there, and
// calls gone() (which throws) if it is not.
template <class Ready, class Alive, class Gone>
void wait_for(Ready ready, Alive alive, Gone gone, const WaitContext& ctx, int peer) {
  for (int i = 0; i < 256; ++i) {
    if (ready()) return;
    cpu_relax();
  }
  const auto start = Clock::now();
  auto next_liveness_check = start + std::chrono::milliseconds(50);
  while (!ready()) {
    const auto now = Clock::now();
    const auto waited = now - start;
    // Yield rather than spin: a peer sharing this core runs at once, and on
    // an idle core the call returns at once. Sleep only after a long wait.
    if (waited < std::chrono::milliseconds(1)) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::min<Clock::duration>(waited / 8, std::chrono::microseconds(500)));
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
