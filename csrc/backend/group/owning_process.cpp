#include "owning_process.hpp"

#include <c10/util/Exception.h>
#include <pthread.h>

#include <atomic>
#include <string>

namespace hca {
namespace {

std::atomic<uint64_t> forks{0};
const bool counting_forks = pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1); }) == 0;

}  // namespace

uint64_t forks_so_far() { return forks.load(std::memory_order_relaxed); }

void OwningProcess::check(const char* op) const {
  if (is_current()) return;
  C10_THROW_ERROR(DistBackendError,
                  std::string("hca ") + op + ": this process (pid " + std::to_string(getpid()) +
                      ") was forked from the one that created the process group (pid " + std::to_string(pid_) +
                      "); a forked child cannot use its parent's group: create the group in the child, "
                      "or fork before init_process_group");
}

}  // namespace hca
