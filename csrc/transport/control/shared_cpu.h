// Two ranks of a group on one CPU take turns on it: each wait of one for the
// other is a context switch, and a small collective takes 3-4x its time on two
// CPUs. Linux leaves them there for tens of milliseconds while another CPU idles
// (it does not pull a task that ran within the last half millisecond, and a rank
// always has), and puts them back together at wake-ups (a woken task goes to its
// waker's CPU). So a rank that keeps waiting for a lower rank on its own CPU
// moves itself to an allowed CPU that no rank of its group says it runs on: once
// for a pair (the higher rank moves), never where the ranks outnumber the
// thread's allowed CPUs (then sharing is the only way), and within the thread's
// affinity, which it leaves as it was.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>

namespace hca {

class SharedCpuEscape {
 public:
  // Shared waits, each within kWithin of the last, before a move.
  static constexpr int kWaitsInARow = 8;
  static constexpr std::chrono::microseconds kWithin{1000};
  // At most one look at the CPUs (and move) per group in this long. A move costs ~35 us here; the
  // scheduler may undo it, or move the peer onto the same CPU at the same time, so the next may be
  // needed soon. Ranks that outnumber the CPUs share them for good, and look once per period.
  static constexpr std::chrono::milliseconds kLooksApart{1};

  // After a wait of this thread, on CPU `here`, found the lower rank it waits for on `here`
  // too. `world`: the group's ranks; `cpu_said_by(r)`: the CPU rank r said it runs on.
  // Returns whether this thread moved (then to a CPU no rank said it runs on).
  bool after_shared_wait(int here, int world, int rank, const std::function<int(int)>& cpu_said_by);

 private:
  using Clock = std::chrono::steady_clock;
  std::atomic<int> in_a_row_{0};
  std::atomic<int> cpu_{-1};                  // where the shared waits in a row were
  std::atomic<Clock::rep> last_shared_{0};    // when the last one was
  std::atomic<Clock::rep> last_look_{0};
};

}  // namespace hca
