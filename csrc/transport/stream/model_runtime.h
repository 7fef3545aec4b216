// The CPU model of the device runtime: CUDA's rules (device_runtime.h) kept by
// host threads, never kinder than a GPU. A process sees TORCH_HCA_MODEL_DEVICES
// devices (default: enough for its tensors'), or with TORCH_HCA_MODEL_VISIBLE
// the physical devices listed there, numbered from 0 in that order, as
// CUDA_VISIBLE_DEVICES makes them; its CPU tensors stand for memory of device
// TORCH_HCA_MODEL_DEVICE (default 0). A process can map the memory of the
// physical devices it sees only (every two of them are peers). Each thread has a current
// device (0 until set) and, per device, a current stream (the legacy default
// stream until set), as torch keeps them. Every call but current_device and
// has_context needs a context on the current device and creates it; with
// TORCH_HCA_MODEL_EXCLUSIVE=<folder>, a device takes one process's context only
// (EXCLUSIVE_PROCESS: a second process fails, as cudaErrorDevicesUnavailable).
// Launching a kernel on a stream of a device that is not current fails, as on CUDA.
// A thread may capture a graph on its current (side) stream: capturing() says so
// for that stream, and every other device call from that thread fails meanwhile
// (stricter than CUDA's global capture mode, which refuses only unsafe calls).
// The caller's torch ops on its CPU tensors run on the host, so by default the
// host follows the caller's current stream once a Work's wait() ordered it; with
// TORCH_HCA_MODEL_RUN_AHEAD=1 it does not, as a GPU's host runs ahead of its
// streams: the caller then reads outputs only after _model.synchronize().
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "device_runtime.h"
#include "host_streams.h"

namespace hca {

class ModelRuntime final : public DeviceRuntime {
 public:
  // The process's runtime (made once, never destroyed: its streams' threads may run to the end).
  static ModelRuntime& instance();

  int devices() const { return static_cast<int>(visible_.size()); }
  // The physical device behind this process's device `device`.
  int physical(int device) const { return visible_.at(device); }
  // Whether this process sees that physical device (and may map its memory).
  bool sees_physical(int physical) const;
  // The device the process's CPU tensors stand for the memory of.
  int tensor_device() const { return tensor_device_; }
  // Whether the host runs ahead of the caller's streams (TORCH_HCA_MODEL_RUN_AHEAD).
  bool host_runs_ahead() const { return host_runs_ahead_; }

  int current_device() override;
  void set_device(int device) override;
  // Without creating a context, as torch's guards restore a device that has
  // none: the thread reads `device` as current again, so that a call that
  // forgets its guard resolves to it, as it could on a GPU.
  void restore_device(int device) override { current_device_of_thread() = device; }
  bool has_context(int device) override;
  Stream create_stream() override;
  Event create_event() override;
  void destroy_event(Event event) override;
  void record(Event event, Stream stream) override;
  void wait(Stream stream, Event event) override;
  bool query(Event event) override;
  void synchronize(Event event) override;
  bool capturing(Stream stream) override;
  // The calling thread starts (or ends) capturing on its current stream of the tensor device.
  void capture(bool active);

  // The calling thread's current stream of `device` (null: the legacy default
  // stream), what torch's current CUDA stream of that device is.
  Stream current_stream(int device);
  void set_current_stream(int device, Stream stream);
  // `stream`, or for null the legacy default stream of `device`.
  HostStream& stream_on(int device, Stream stream);
  // Before a kernel is launched on `stream` from this thread: throws as CUDA's
  // launch fails when the stream is not of the current device.
  HostStream& launch_on(Stream stream);
  // The devices this process has a context on.
  std::vector<int> contexts();

 private:
  ModelRuntime();
  void check_device(int device) const;
  // A context on the current device, created if there is none (or Failure).
  int with_context();
  void create_context(int device);
  HostStream& legacy(int device);
  static int& current_device_of_thread();
  HostStream& resolve(Stream stream) { return stream_on(with_context(), stream); }
  // Fails a device call made while the calling thread captures.
  static void refuse_while_capturing(const char* call);

  std::vector<int> visible_;  // the physical device of each of this process's devices
  int tensor_device_ = 0;
  bool host_runs_ahead_ = false;
  std::string exclusive_folder_;
  std::mutex mutex_;
  std::set<int> contexts_;
  std::vector<int> exclusive_locks_;  // descriptors held for the process's life
  std::map<int, std::unique_ptr<HostStream>> legacy_;
  std::map<HostStream*, std::shared_ptr<HostStream>> streams_;
  std::set<Stream> capturing_;
};

}  // namespace hca
