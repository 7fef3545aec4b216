// The part of a device runtime that issuing work on streams needs: devices and
// each thread's current device, streams and events that belong to a device.
// CUDA's runtime is one implementation (cuda/cuda_runtime); the CPU model of
// the device (model_runtime) is the other, with CUDA's rules, so that the code
// written against this interface (the stream executor, the backend's calls)
// runs in CI the way it would run on a GPU.
//
// The rules every implementation keeps (CUDA's "stream and event behavior"):
// - a thread's current device is 0 until it sets one; a call that needs a
//   context creates the current device's (set_device creates that device's);
// - streams and events belong to the device current when they were made; a
//   null stream is the legacy default stream of the device current at the call;
// - record() fails unless the event and the stream are of one device; wait(),
//   query() and synchronize() work across devices.
#pragma once
#include <memory>

namespace hca {

class DeviceRuntime {
 public:
  using Stream = void*;
  using Event = void*;

  virtual ~DeviceRuntime() = default;

  // The calling thread's current device (creates no context).
  virtual int current_device() = 0;
  virtual void set_device(int device) = 0;
  // Makes `device` current again when a guard ends. By default only where it
  // has a context: setting it would create one.
  virtual void restore_device(int device) {
    if (has_context(device)) set_device(device);
  }
  // Whether this process has a context on `device` (asks; creates none).
  virtual bool has_context(int device) = 0;

  // A stream of the current device, of the highest priority, not ordered with
  // the legacy default stream. Never destroyed: freeing memory a stream used
  // (recordStream) records an event on that stream, however long after, so
  // streams are pooled instead (torch never destroys its pooled streams either).
  virtual Stream create_stream() = 0;
  // An event of the current device, without timing.
  virtual Event create_event() = 0;
  virtual void destroy_event(Event event) = 0;
  // `event` marks everything issued on `stream` so far.
  virtual void record(Event event, Stream stream) = 0;
  // `stream` runs nothing issued after this until it has passed `event` (at
  // once for an event never recorded).
  virtual void wait(Stream stream, Event event) = 0;
  // Whether the stream has passed `event`; throws Failure(DeviceFault) once
  // the device faulted (its streams then never pass, their outputs undefined).
  virtual bool query(Event event) = 0;
  // Blocks the host until the stream has passed `event` (or throws, as query).
  virtual void synchronize(Event event) = 0;
  // Whether `stream` is capturing a graph (work issued on it would be recorded, not run).
  virtual bool capturing(Stream stream) = 0;
};

// Makes `device` current on the calling thread while it lives, then restores
// the previous one (restore_device): a fresh thread reports device 0, and
// setting it back would create a context (hundreds of MB, or a failure on an
// EXCLUSIVE_PROCESS GPU) on GPU 0.
class DeviceGuard {
 public:
  DeviceGuard(DeviceRuntime& runtime, int device) : runtime_(runtime), previous_(runtime.current_device()) {
    changed_ = device != previous_;
    if (changed_) runtime_.set_device(device);
  }
  ~DeviceGuard() {
    try {
      if (changed_) runtime_.restore_device(previous_);
    } catch (...) {
      // A faulted device: the thread keeps `device` current.
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  DeviceRuntime& runtime_;
  int previous_;
  bool changed_ = false;
};

}  // namespace hca
