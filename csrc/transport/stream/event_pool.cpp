#include "event_pool.h"

#include <unistd.h>

#include <memory>

namespace hca {

EventPool& EventPool::of(DeviceRuntime& runtime) {
  static std::mutex mutex;
  static auto* pools = new std::map<DeviceRuntime*, std::unique_ptr<EventPool>>();  // never destroyed
  std::lock_guard<std::mutex> lock(mutex);
  auto& pool = (*pools)[&runtime];
  if (!pool) pool.reset(new EventPool(runtime));
  return *pool;
}

void EventPool::forget_the_parents() {
  const int pid = static_cast<int>(getpid());
  if (pid_ == pid) return;
  free_.clear();
  pid_ = pid;
}

DeviceRuntime::Event EventPool::take(int device) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    forget_the_parents();
    auto& free = free_[device];
    if (!free.empty()) {
      const DeviceRuntime::Event event = free.back();
      free.pop_back();
      return event;
    }
  }
  return runtime_.create_event();
}

void EventPool::give_back(int device, DeviceRuntime::Event event) {
  std::lock_guard<std::mutex> lock(mutex_);
  forget_the_parents();
  free_[device].push_back(event);
}

}  // namespace hca
