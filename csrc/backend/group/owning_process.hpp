// The process that made a group. A child forked from it (a DataLoader worker,
// a user's os.fork) inherits the group's memory but none of its threads, and
// shares its shared-memory mappings with the parent: it must neither run the
// group's calls (it would act as the parent's rank, putting the ranks out of
// step) nor tear the group down (joining threads it does not have, telling
// peers the group ended). The group's objects are left as they are in a child.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <utility>

namespace hca {

// Moves `object` (a pointer that owns, a queue) where it is never destroyed:
// in a forked child, for what the parent's threads were using when it forked
// (a condition variable they wait on cannot even be destroyed in the child).
template <class T>
void leave_in_child(T& object) {
  new T(std::move(object));
}

// How many forks led to this process (counted in each child at fork): checked
// on every call, it costs a load where getpid() would cost a system call.
uint64_t forks_so_far();

class OwningProcess {
 public:
  bool is_current() const { return forks_so_far() == forks_; }
  // A DistBackendError naming `op` in any other process.
  void check(const char* op) const;

 private:
  uint64_t forks_ = forks_so_far();
  pid_t pid_ = getpid();  // for the message
};

}  // namespace hca
