// StreamCall over the CPU model of the device. The caller's CPU torch ops run
// on the host, so the host stands for the caller's current stream (unless it runs
// ahead, TORCH_HCA_MODEL_RUN_AHEAD, as a GPU's): after
// wait() has made that stream wait, the host follows it (and the model raises
// if the call has not finished by then: the caller would read unwritten
// outputs), then waits for the executor to settle it, so that a release after
// a failure is reported by wait() itself. The Future completes on the stream,
// in its turn, as a CUDA host function would; wait() returns after that, as a
// CUDA Work's wait() returns with its Future completed. Buffers the call kept alive are
// poisoned when freed, as a GPU's caching allocator would hand them to the
// next user at once.
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "../../transport/stream/model_runtime.h"
#include "stream_call.hpp"

namespace hca {
namespace {

// NaN in every float type, -1 in every integer type.
constexpr int kPoisonByte = 0xff;

ModelRuntime& model() { return ModelRuntime::instance(); }

// The calling thread's current stream of `device` while it lives, as torch's stream guard.
class CurrentStream {
 public:
  CurrentStream(int device, DeviceRuntime::Stream stream) : device_(device), before_(model().current_stream(device)) {
    model().set_current_stream(device, stream);
  }
  ~CurrentStream() { model().set_current_stream(device_, before_); }
  CurrentStream(const CurrentStream&) = delete;
  CurrentStream& operator=(const CurrentStream&) = delete;

 private:
  int device_;
  DeviceRuntime::Stream before_;
};

class ModelCall final : public StreamCall {
 public:
  ModelCall(int device, DeviceRuntime::Stream internal, DeviceRuntime::Stream caller)
      : StreamCall(model(), device, internal, caller) {}

  void on_stream(std::function<void()> fn) const override {
    model().stream_on(device_index(), stream()).issue([fn = std::move(fn)] {
      at::NoGradGuard no_grad;  // the backend's copies into leaves that require grad
      fn();
    });
  }

  void from_host(std::function<void()> fn) const override {
    HostStream& internal = model().stream_on(device_index(), stream());
    try {
      internal.synchronize(internal.record());
    } catch (const Failure& fault) {
      C10_THROW_ERROR(DistBackendError, std::string("hca: ") + fault.what());
    }
    CurrentStream current(device_index(), stream());
    at::NoGradGuard no_grad;  // the backend's copies into leaves that require grad
    fn();
  }

  std::shared_ptr<const CallTensors> keep(CallTensors tensors) const override {
    return std::shared_ptr<const CallTensors>(new CallTensors(std::move(tensors)), [](const CallTensors* kept) {
      std::vector<c10::Storage> storages;
      kept->each([&](const at::Tensor& t) {
        if (t.defined() && t.has_storage()) storages.push_back(t.storage());
      });
      delete kept;
      for (auto& s : storages) {
        // Our reference is the last: the memory is being freed.
        if (s.use_count() == 1 && s.nbytes() > 0) std::memset(s.mutable_data(), kPoisonByte, s.nbytes());
      }
    });
  }

  void keep_until_passed(std::shared_ptr<const CallTensors> kept) const override {
    on_stream([kept = std::move(kept)] {});  // dropped (and poisoned) once the stream ran it
  }

  at::Tensor host_staging(const at::Tensor& like) const override { return at::empty_like(like); }

  std::vector<c10::Device> devices() const override { return {}; }
  // On a faulted device the Future gets the fault, as a CUDA Future's wait raises it.
  void complete(c10::ivalue::Future& future, const c10::IValue& value) const override {
    auto shared = c10::intrusive_ptr<c10::ivalue::Future>::reclaim_copy(&future);
    HostStream& internal = model().stream_on(device_index(), stream());
    internal.issue([shared, value] { shared->markCompleted(value); },
               [shared](const std::string& fault) {
                 try {
                   C10_THROW_ERROR(DistBackendError, "hca: " + fault);
                 } catch (...) {
                   shared->setError(std::current_exception());
                 }
               });
    future_completed_ = internal.record();
  }

 protected:
  DeviceRuntime::Stream current_stream() const override { return model().current_stream(device_index()); }

  void after_current_stream_waits() const override {
    if (model().host_runs_ahead()) return;  // the caller's stream waits; the host goes on, as a GPU's
    // The caller's next op on the device runs on its current stream of the device.
    HostStream& caller = model().stream_on(device_index(), current_stream());
    try {
      caller.synchronize(caller.record());
      TORCH_CHECK(model().query(end_event()), "hca (CPU model of the device): wait() returned before the call "
                  "finished on the caller's current stream of device ", device_index(),
                  ": the caller would read its outputs before they are written");
    } catch (const Failure& fault) {
      C10_THROW_ERROR(DistBackendError, std::string("hca: ") + fault.what());
    }
    while (!issued()->over()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    // Not from the Future's own callbacks, which run on the stream before that mark.
    HostStream& internal = model().stream_on(device_index(), stream());
    if (const uint64_t mark = future_completed_; mark && !internal.is_current_thread()) internal.wait_passed(mark);
  }

 private:
  // The internal stream's mark after the Future's completion (0: not issued).
  mutable std::atomic<uint64_t> future_completed_{0};
};

}  // namespace

std::unique_ptr<CallStreams> make_model_call_streams() {
  return std::make_unique<CallStreams>(
      model(), [](const at::Device&) { return model().tensor_device(); },
      [](int device) { return model().current_stream(device); },
      [](int device, DeviceRuntime::Stream internal, DeviceRuntime::Stream caller) {
        return std::make_shared<ModelCall>(device, internal, caller);
      });
}

}  // namespace hca
