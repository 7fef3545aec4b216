#include "owning_process.hpp"

#include <c10/util/Exception.h>

#include <string>

namespace hca {

void OwningProcess::check(const char* op) const {
  if (is_current()) return;
  C10_THROW_ERROR(DistBackendError,
                  std::string("hca ") + op + ": this process (pid " + std::to_string(getpid()) +
                      ") was forked from the one that created the process group (pid " + std::to_string(pid_) +
                      "); a forked child cannot use its parent's group: create the group in the child, "
                      "or fork before init_process_group");
}

}  // namespace hca
