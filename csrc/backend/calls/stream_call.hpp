// One call on a device stream, with ProcessGroupNCCL's semantics: issued on the
// group's internal stream after the caller's current stream; wait() orders the
// caller's current stream after it without blocking the host; the Future
// completes for the caller's streams. The logic is written once, against the
// device runtime (transport/stream/device_runtime.h), so that the CPU model of
// the device runs the very code a GPU would; CUDA (cuda/cuda_call) and the
// model (model_call) add only how torch sees streams and futures.
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../../transport/executor.h"
#include "../../transport/stream/device_runtime.h"
#include "call_args.hpp"
#include "issue_order.hpp"
#include "work_hca.hpp"

namespace hca {

// What the device reads and writes for a call: kept alive until it has finished.
struct CallTensors {
  CallArgs args;
  std::vector<at::Tensor> outputs;

  // `fn` on every tensor the device touches: the dense arguments, then the outputs.
  template <class Fn>
  void each(Fn fn) const {
    for (const auto& t : args.dense()) fn(t);
    for (const auto& t : outputs) fn(t);
  }
};

class StreamCall : public DeviceCompletion {
 public:
  // On the caller's thread: marks "inputs ready" on `caller` (the caller's
  // current stream of `device`).
  StreamCall(DeviceRuntime& runtime, int device, DeviceRuntime::Stream internal, DeviceRuntime::Stream caller);
  ~StreamCall() override;

  DeviceRuntime& runtime() const { return runtime_; }
  // The stream to issue on (a cudaStream_t, or a HostStream of the model).
  void* stream() const { return internal_; }
  int device_index() const { return device_; }
  // Before issuing (on any thread): the internal stream waits for the caller's.
  void begin() const;
  // Issues `fn` on the internal stream after what was issued so far: torch ops
  // run with it current (CUDA), or the model's stream runs `fn` in its turn.
  virtual void on_stream(std::function<void()> fn) const = 0;
  // Runs `fn`, host code that issues torch ops and calls of other groups, on this
  // thread with the internal stream current. CUDA queues its ops there; the
  // model's run on the host at once, so the host first waits for what the stream
  // was given and then stands for it, as it does for the caller's stream.
  virtual void from_host(std::function<void()> fn) const = 0;
  // After issuing: the end of everything issued so far.
  void end();
  // Blocks the host until the stream has passed the end.
  void wait_for_end() const;
  // `tensors`, kept by whoever holds the result until the device is done with them.
  virtual std::shared_ptr<const CallTensors> keep(CallTensors tensors) const;
  // For calls no executor watches (point-to-point): `kept` stays valid until
  // the stream has passed what was issued so far, without anyone holding it
  // (CUDA: the caching allocator is told the stream uses it; the model: the
  // stream drops it in its turn).
  virtual void keep_until_passed(std::shared_ptr<const CallTensors> kept) const = 0;
  // Host memory the device copies `like`'s bytes to and from in stream order
  // (CUDA: pinned, so that the copies are asynchronous).
  virtual at::Tensor host_staging(const at::Tensor& like) const = 0;
  // Whether the stream has passed the end (never blocks); throws Failure once
  // the device faulted, for callers that must not go on with undefined data.
  bool passed_end() const;
  const std::shared_ptr<Issued>& issued() const { return issued_; }

  // A device error makes the call complete, and wait() raise it at once.
  bool query() const override;
  void make_current_stream_wait() const override;
  void check_released() const override;

 protected:
  // The calling thread's current stream of the call's device (torch's current stream).
  virtual DeviceRuntime::Stream current_stream() const = 0;
  // After the caller's current stream was made to wait for the end (the model:
  // the host, which runs the caller's CPU ops, follows that stream).
  virtual void after_current_stream_waits() const {}
  DeviceRuntime::Event end_event() const { return end_; }

 private:
  // DistBackendError with the device's fault, once one was seen.
  void check_fault() const;
  void note_fault(const std::string& fault) const;

  DeviceRuntime& runtime_;
  int device_;
  DeviceRuntime::Stream internal_;
  DeviceRuntime::Event ready_ = nullptr, end_ = nullptr;
  std::shared_ptr<Issued> issued_ = std::make_shared<Issued>();
  mutable std::mutex fault_mutex_;
  mutable std::string fault_;
};

// A group's internal stream per device. Every call of the group is issued on
// it: its collectives share the round counter, the progress words and the
// staging ring, which only an order on one stream keeps consistent. It is the
// group's own (not one shared with other groups or the user), because a stream
// waiting on a peer holds back everything queued behind it.
class CallStreams {
 public:
  using MakeCall = std::function<std::shared_ptr<StreamCall>(int device, DeviceRuntime::Stream internal,
                                                              DeviceRuntime::Stream caller)>;
  using CallerStream = std::function<DeviceRuntime::Stream(int device)>;
  // `index_of`: the runtime's device index of a tensor device; `caller_stream`:
  // the calling thread's current stream of a device (torch's current stream).
  CallStreams(DeviceRuntime& runtime, std::function<int(const at::Device&)> index_of, CallerStream caller_stream,
              MakeCall make);
  ~CallStreams();
  // A call on `device` (from the caller's thread: it marks the caller's
  // stream). A caller's stream that is capturing a graph is refused first,
  // before anything is created or recorded on the device.
  std::shared_ptr<StreamCall> call(const at::Device& device) { return call_on(index_of_(device)); }
  // The same, by the runtime's device index.
  std::shared_ptr<StreamCall> call_on(int device);
  // Blocks the host until the calling thread's current stream of `device` has
  // passed what was queued on it so far.
  void synchronize_caller(const at::Device& device);
  // The runtime's indices of the devices this group has issued calls on.
  std::vector<int> devices();
  DeviceRuntime& runtime() const { return runtime_; }
  // The runtime's index of a tensor device.
  int index_of(const at::Device& device) const { return index_of_(device); }

 private:
  DeviceRuntime& runtime_;
  std::function<int(const at::Device&)> index_of_;
  CallerStream caller_stream_;
  MakeCall make_;
  std::mutex mutex_;
  std::map<int, DeviceRuntime::Stream> streams_;
};

// The CPU model's (model_call.cpp), and CUDA's (cuda/cuda_call.cpp; null in a
// build without CUDA).
std::unique_ptr<CallStreams> make_model_call_streams();
std::unique_ptr<CallStreams> make_cuda_call_streams();

// A Work body for host code that issues torch ops (`body`) on `call`'s stream
// and that no executor watches: it returns once they are issued, `kept` kept
// for as long as the stream reads it (keep_until_passed), and settles the call.
// `body` runs on this thread (StreamCall::from_host). With `turn` (taken when
// the call was made), it issues in that turn: after every earlier call of the
// device, and so do the calls `body` makes; the turn passes once they have issued.
std::function<void()> issued_and_waited(std::shared_ptr<StreamCall> call, std::shared_ptr<const CallTensors> kept,
                                        std::function<void()> body, std::shared_ptr<IssueTicket> turn = nullptr);

// A Work step for a barrier: an empty call on each of `calls` (made on the
// caller's thread), returning once every stream has passed its call, that is the
// caller's stream and the group's earlier calls there; DistBackendError if that
// takes longer than `timeout` (a device still busy, or stuck).
std::function<void()> drained(std::vector<std::shared_ptr<StreamCall>> calls, std::chrono::milliseconds timeout);

}  // namespace hca
