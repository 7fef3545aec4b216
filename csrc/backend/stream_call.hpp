// One call on a device stream, with ProcessGroupNCCL's semantics: issued on the
// group's internal stream after the caller's current stream; wait() orders the
// caller after it; the Future completes for the caller's streams. CUDA
// (cuda/cuda_call) and the CPU model of the device (host_stream_call) implement it.
#pragma once
#include <functional>
#include <memory>

#include "../transport/executor.h"
#include "call_args.hpp"
#include "work_hca.hpp"

namespace hca {

// What the device reads and writes for a call: kept alive until it has finished.
struct CallTensors {
  CallArgs args;
  std::vector<at::Tensor> outputs;
};

class StreamCall : public DeviceCompletion {
 public:
  // The stream to issue on (a cudaStream_t, or a HostStream of the model).
  virtual void* stream() const = 0;
  virtual int device_index() const = 0;
  // Before issuing (on any thread): the internal stream waits for the caller's.
  virtual void begin() const = 0;
  // Issues `fn` on the internal stream after what was issued so far: torch ops
  // run with it current (CUDA), or the model's stream runs `fn` in its turn.
  virtual void on_stream(std::function<void()> fn) const = 0;
  // After issuing: the end of everything issued so far.
  virtual void end() = 0;
  // Blocks the host until the stream has passed the end.
  virtual void wait_for_end() const = 0;
  // `tensors`, kept by whoever holds the result until the device is done with them.
  virtual std::shared_ptr<const CallTensors> keep(CallTensors tensors) const;

  const std::shared_ptr<Issued>& issued() const { return issued_; }
  void check_released() const override;

 private:
  std::shared_ptr<Issued> issued_ = std::make_shared<Issued>();
};

// A group's internal stream per device. Every call of the group is issued on
// it: its collectives share the round counter, the progress words and the
// staging ring, which only an order on one stream keeps consistent. It is the
// group's own (not one shared with other groups or the user), because a stream
// waiting on a peer holds back everything queued behind it.
class CallStreams {
 public:
  virtual ~CallStreams() = default;
  // A call on `device` (from the caller's thread: it marks the caller's stream).
  virtual std::shared_ptr<StreamCall> call(const at::Device& device) = 0;
};

// The CPU model's (host_stream_call.cpp), and CUDA's (cuda/cuda_call.cpp; null
// in a build without CUDA).
std::unique_ptr<CallStreams> make_host_call_streams();
std::unique_ptr<CallStreams> make_cuda_call_streams();

// A Work body for host code that issues torch ops (`body`) on `call`'s stream
// and that no executor watches: it returns once the stream has passed them,
// so that `kept` lives as long as the stream reads it, and settles the call.
std::function<void()> issued_and_waited(std::shared_ptr<StreamCall> call, std::shared_ptr<const CallTensors> kept,
                                        std::function<void()> body);

}  // namespace hca
