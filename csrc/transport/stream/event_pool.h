// Events taken from a pool of each device instead of created per call: a call
// used to create and destroy five, each a driver call on a GPU. An event goes
// back once its owner is done with it (where it would have destroyed it): a
// stream that waits on it has captured the record it waits for already, as CUDA
// and the model both define waits.
#pragma once
#include <map>
#include <mutex>
#include <vector>

#include "device_runtime.h"

namespace hca {

class EventPool {
 public:
  // The pool of `runtime`'s events (one per runtime, for the process's life).
  static EventPool& of(DeviceRuntime& runtime);

  // An event of `device`, which is current on the calling thread.
  DeviceRuntime::Event take(int device);
  // `event` (of `device`) is free again.
  void give_back(int device, DeviceRuntime::Event event);

 private:
  explicit EventPool(DeviceRuntime& runtime) : runtime_(runtime) {}
  // A forked child cannot use its parent's events: they are left, never used.
  void forget_the_parents();

  DeviceRuntime& runtime_;
  std::mutex mutex_;
  int pid_ = 0;
  std::map<int, std::vector<DeviceRuntime::Event>> free_;
};

}  // namespace hca
