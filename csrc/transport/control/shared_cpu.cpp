#include "shared_cpu.h"

#include <sched.h>

namespace hca {
namespace {

// Moves the calling thread to `cpu` (one of `allowed`, its affinity) and gives it `allowed` back:
// the scheduler may move it again later, as it may any thread. False where the system refused.
bool move_this_thread(int cpu, const cpu_set_t& allowed) {
  cpu_set_t only;
  CPU_ZERO(&only);
  CPU_SET(cpu, &only);
  if (sched_setaffinity(0, sizeof only, &only) != 0) return false;  // 0: this thread, not the process
  return sched_setaffinity(0, sizeof allowed, &allowed) == 0;
}

}  // namespace

bool SharedCpuEscape::after_shared_wait(int here, int world, int rank, const std::function<int(int)>& cpu_said_by) {
  const auto now = Clock::now().time_since_epoch().count();
  const bool in_a_row = cpu_.exchange(here, std::memory_order_relaxed) == here &&
                        now - last_shared_.exchange(now, std::memory_order_relaxed) <=
                            std::chrono::duration_cast<Clock::duration>(kWithin).count();
  if (!in_a_row) {
    in_a_row_.store(1, std::memory_order_relaxed);
    return false;
  }
  if (in_a_row_.fetch_add(1, std::memory_order_relaxed) + 1 < kWaitsInARow) return false;
  in_a_row_.store(0, std::memory_order_relaxed);
  if (now - last_look_.load(std::memory_order_relaxed) < std::chrono::duration_cast<Clock::duration>(kLooksApart).count()) {
    return false;
  }
  last_look_.store(now, std::memory_order_relaxed);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < world) return false;
  cpu_set_t unclaimed = allowed;
  for (int r = 0; r < world; ++r) {
    const int cpu = cpu_said_by(r);
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_CLR(cpu, &unclaimed);
  }
  const int unclaimed_count = CPU_COUNT(&unclaimed);
  if (unclaimed_count == 0) return false;
  // Ranks that move at once spread over those CPUs rather than meet on the first.
  for (int cpu = 0, skip = rank % unclaimed_count; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &unclaimed) && skip-- == 0) return move_this_thread(cpu, allowed);
  }
  return false;
}

}  // namespace hca
