// The process that made a group. A child forked from it (a DataLoader worker,
// a user's os.fork) inherits the group's memory but none of its threads, and
// shares its shared-memory mappings with the parent: it must neither run the
// group's calls (it would act as the parent's rank, putting the ranks out of
// step) nor tear the group down (joining threads it does not have, telling
// peers the group ended). The group's objects are left as they are in a child.
#pragma once
#include <unistd.h>

#include <utility>

namespace hca {

// Moves `object` (a pointer that owns, a queue) where it is never destroyed:
// in a forked child, for what the parent's threads were using when it forked
// (a condition variable they wait on cannot even be destroyed in the child).
template <class T>
void leave_in_child(T& object) {
  new T(std::move(object));
}

class OwningProcess {
 public:
  bool is_current() const { return getpid() == pid_; }
  // A DistBackendError naming `op` in any other process.
  void check(const char* op) const;

 private:
  pid_t pid_ = getpid();
};

}  // namespace hca
