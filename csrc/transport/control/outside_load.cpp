#include "outside_load.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace hca {
namespace {

// The fields of /proc/<pid>/stat after the command's name (which may hold
// spaces and parentheses: it ends at the last ')'), from the state (field 3) on.
std::optional<std::vector<uint64_t>> stat_fields(int pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* file = std::fopen(path, "re");
  if (!file) return std::nullopt;
  char text[1024];
  const size_t n = std::fread(text, 1, sizeof text - 1, file);
  std::fclose(file);
  text[n] = '\0';
  const char* rest = std::strrchr(text, ')');
  if (!rest || rest[1] != ' ' || rest[2] == '\0') return std::nullopt;
  std::vector<uint64_t> fields{0};  // the state, a letter
  for (const char* p = rest + 4; *p != '\0' && *p != '\n';) {
    char* end = nullptr;
    fields.push_back(std::strtoull(p, &end, 10));
    if (end == p) return std::nullopt;
    p = *end == ' ' ? end + 1 : end;
  }
  return fields;
}

// Indices into stat_fields (field numbers of proc(5) less 3).
constexpr size_t kUserTime = 11, kSystemTime = 12, kStartTime = 19;

double ticks_per_second() {
  static const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  return hz;
}

// The first line of /proc/stat: every core's time in user, nice, system, idle,
// iowait, irq, softirq and steal (ticks); busy is all but idle, iowait and
// steal (time the hypervisor gave to others is nobody's here).
std::optional<double> busy_seconds() {
  FILE* file = std::fopen("/proc/stat", "re");
  if (!file) return std::nullopt;
  unsigned long long user, nice, system, idle, iowait, irq, softirq;
  const int read = std::fscanf(file, "cpu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &system, &idle, &iowait,
                               &irq, &softirq);
  std::fclose(file);
  if (read != 7) return std::nullopt;
  return static_cast<double>(user + nice + system + irq + softirq) / ticks_per_second();
}

}  // namespace

uint64_t process_start_time(int pid) {
  const auto fields = stat_fields(pid);
  return fields && fields->size() > kStartTime ? (*fields)[kStartTime] : 0;
}

std::optional<CpuSample> sample_cpu(const std::vector<ProcessId>& group) {
  const auto busy = busy_seconds();
  if (!busy) return std::nullopt;
  CpuSample sample{std::chrono::steady_clock::now(), *busy, {}};
  for (const ProcessId& process : group) {
    const auto fields = stat_fields(process.pid);
    if (!fields || fields->size() <= kStartTime || (*fields)[kStartTime] != process.started) continue;
    sample.group.emplace_back(process.pid,
                              static_cast<double>((*fields)[kUserTime] + (*fields)[kSystemTime]) / ticks_per_second());
  }
  return sample;
}

double outside_cores(const CpuSample& from, const CpuSample& to) {
  const double seconds = std::chrono::duration<double>(to.at - from.at).count();
  if (seconds <= 0) return 0;
  double group_seconds = 0;
  for (const auto& [pid, cpu] : to.group) {
    for (const auto& [earlier_pid, earlier_cpu] : from.group) {
      if (pid == earlier_pid) group_seconds += cpu - earlier_cpu;
    }
  }
  return (to.busy_seconds - from.busy_seconds - group_seconds) / seconds;
}

bool OutsideLoad::busy(const std::vector<ProcessId>& group) {
  std::unique_lock<std::mutex> lock(looking_, std::try_to_lock);
  if (!lock.owns_lock()) return busy_;  // another thread of this process is looking
  if (last_ && std::chrono::steady_clock::now() - last_->at < kShortestWindow) return busy_;
  const auto now = sample_cpu(group);
  if (!now) return true;  // unknown: as if they were, the safe side beside busy processes
  if (last_) busy_ = outside_cores(*last_, *now) >= kBusyCores;
  last_ = now;
  return busy_;
}

}  // namespace hca
