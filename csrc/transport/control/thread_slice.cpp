#include "thread_slice.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace hca {
namespace {

// The kernel's struct sched_attr (glibc has no wrapper before 2.41).
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;  // for SCHED_OTHER and SCHED_BATCH: the slice
  uint64_t sched_deadline;
  uint64_t sched_period;
  uint32_t sched_util_min;
  uint32_t sched_util_max;
};

constexpr uint32_t kSchedOther = 0, kSchedBatch = 3;
constexpr uint64_t kResetOnFork = 1;
constexpr uint64_t kShortSliceNs = 100'000;  // the shortest the kernel allows

}  // namespace

void prefer_prompt_wakeups() {
#if defined(SYS_sched_getattr) && defined(SYS_sched_setattr)
  SchedAttr attr{};
  if (syscall(SYS_sched_getattr, 0, &attr, sizeof(attr), 0) != 0) return;
  if (attr.sched_policy != kSchedOther && attr.sched_policy != kSchedBatch) return;
  if (attr.sched_runtime != 0 && attr.sched_runtime <= kShortSliceNs) return;
  attr.size = sizeof(attr);
  attr.sched_flags &= kResetOnFork;  // kept; the other flags ask for changes
  attr.sched_runtime = kShortSliceNs;
  syscall(SYS_sched_setattr, 0, &attr, 0);  // policy and nice as read
#endif
}

}  // namespace hca
