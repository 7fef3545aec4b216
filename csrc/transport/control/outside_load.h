// Whether processes other than a group's ranks keep this machine's cores busy.
// A waiter's yield that came back late lost its core for a time slice, either
// to a rank of the group (ranks that outnumber the cores, or compute beside
// their collectives: yields hand the core between them, cheaper than wake-ups)
// or to another process (then yields only lose the core, and waits should
// sleep on the doorbells, whose rings take it back at once). The CPU time the
// cores spent busy (/proc/stat), less the group's processes' own
// (/proc/<pid>/stat), tells the two apart.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace hca {

// A process by pid and start time (clock ticks since boot): a pid alone may name
// another process, e.g. a peer's pid read from another pid namespace.
struct ProcessId {
  int pid;
  uint64_t started;
};

// A process's start time, as /proc/<pid>/stat gives it (0 where unreadable).
uint64_t process_start_time(int pid);

struct CpuSample {
  std::chrono::steady_clock::time_point at;
  double busy_seconds;  // all cores busy, summed since boot
  // The group's processes found (pid, their CPU seconds since they started).
  std::vector<std::pair<int, double>> group;
};

// Now's sample; nullopt where /proc cannot be read.
std::optional<CpuSample> sample_cpu(const std::vector<ProcessId>& group);

// The cores' worth of CPU time that processes outside the group used between two
// samples. A process of the group missing from either (gone, not there yet, or
// of another pid namespace) counts as an outside one.
double outside_cores(const CpuSample& from, const CpuSample& to);

class OutsideLoad {
 public:
  // Outsiders used at least this many cores: they, not the ranks, take the cores yields give away.
  static constexpr double kBusyCores = 0.5;
  // Samples closer than this are too coarse to compare (/proc counts in 10 ms ticks).
  static constexpr std::chrono::milliseconds kShortestWindow{100};

  // Whether outsiders were busy between the previous look and now; between looks
  // closer than kShortestWindow, the last answer (false until there were two);
  // true where /proc cannot be read (the safe side beside busy processes).
  // Called after a late yield only: a look reads /proc, tens of microseconds.
  bool busy(const std::vector<ProcessId>& group);

 private:
  std::mutex looking_;
  std::optional<CpuSample> last_;
  bool busy_ = false;
};

}  // namespace hca
