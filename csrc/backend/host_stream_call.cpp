// StreamCall over the CPU model of the device: the caller is the host itself
// (its inputs are written before it calls), so wait() blocks it until the
// internal stream has passed the call's end and the executor has settled it,
// and the Future completes on the stream, in its turn, as a CUDA host function
// would. Buffers the call kept alive are poisoned when freed, as a GPU's
// caching allocator would hand them to the next user at once.
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <thread>

#include "../transport/stream/host_streams.h"
#include "stream_call.hpp"

namespace hca {
namespace {

// NaN in every float type, -1 in every integer type.
constexpr int kPoisonByte = 0xff;

class HostStreamCall final : public StreamCall {
 public:
  explicit HostStreamCall(std::shared_ptr<HostStream> stream) : stream_(std::move(stream)) {}

  void* stream() const override { return stream_.get(); }
  int device_index() const override { return -1; }
  void begin() const override {}
  void on_stream(std::function<void()> fn) const override { stream_->issue(std::move(fn)); }
  void end() override { end_ = stream_->record(); }
  void wait_for_end() const override {
    try {
      stream_->synchronize(end_);
    } catch (const std::runtime_error& fault) {
      C10_THROW_ERROR(DistBackendError, std::string("hca: ") + fault.what());
    }
  }

  std::shared_ptr<const CallTensors> keep(CallTensors tensors) const override {
    return std::shared_ptr<const CallTensors>(new CallTensors(std::move(tensors)), [](const CallTensors* kept) {
      std::vector<c10::Storage> storages;
      auto note = [&](const at::Tensor& t) {
        if (t.defined() && t.has_storage()) storages.push_back(t.storage());
      };
      for (const auto& t : kept->args.dense()) note(t);
      for (const auto& t : kept->outputs) note(t);
      delete kept;
      for (auto& s : storages) {
        // Our reference is the last: the memory is being freed.
        if (s.use_count() == 1 && s.nbytes() > 0) std::memset(s.mutable_data(), kPoisonByte, s.nbytes());
      }
    });
  }

  std::vector<c10::Device> devices() const override { return {}; }
  bool query() const override {
    try {
      return stream_->passed(end_);
    } catch (const std::runtime_error&) {
      return true;  // faulted: wait() says so
    }
  }
  void make_current_stream_wait() const override {
    wait_for_end();
    while (!issued()->over()) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // On a faulted device the Future gets the fault, as a CUDA Future's wait raises it.
  void complete(c10::ivalue::Future& future, const c10::IValue& value) const override {
    auto shared = c10::intrusive_ptr<c10::ivalue::Future>::reclaim_copy(&future);
    stream_->issue([shared, value] { shared->markCompleted(value); },
                   [shared](const std::string& fault) {
                     try {
                       C10_THROW_ERROR(DistBackendError, "hca: " + fault);
                     } catch (...) {
                       shared->setError(std::current_exception());
                     }
                   });
  }

 private:
  std::shared_ptr<HostStream> stream_;
  uint64_t end_ = 0;
};

class HostCallStreams final : public CallStreams {
 public:
  std::shared_ptr<StreamCall> call(const at::Device&) override {
    return std::make_shared<HostStreamCall>(stream_);
  }

 private:
  std::shared_ptr<HostStream> stream_ = std::make_shared<HostStream>();
};

}  // namespace

std::unique_ptr<CallStreams> make_host_call_streams() { return std::make_unique<HostCallStreams>(); }

}  // namespace hca
