#include "host_streams.h"

#include <sched.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "../../plan/rounds.h"
#include "../shm/kernels.h"
#include "../shm/shm_executor.h"

namespace hca {

namespace {

// The model's device context: one per process, as a CUDA context is per process
// and GPU. The first operation that throws faults it for every stream.
class DeviceContext {
 public:
  void fault(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!faulted_.load(std::memory_order_relaxed)) what_ = why;
    faulted_.store(true, std::memory_order_release);
  }
  bool faulted() const { return faulted_.load(std::memory_order_acquire); }
  std::string what() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return "the device faulted: " + what_;
  }
  void throw_if_faulted() const {
    if (faulted()) throw std::runtime_error(what());
  }

 private:
  mutable std::mutex mutex_;
  std::atomic<bool> faulted_{false};
  std::string what_;
};

DeviceContext& context() {
  static DeviceContext shared;
  return shared;
}

}  // namespace

HostStream::HostStream() : worker_([this] { work(); }) {}

HostStream::~HostStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  // The last owner may be one of its own operations (a Work freed by a Future's callback).
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();
  } else {
    worker_.join();
  }
}

void HostStream::issue(std::function<void()> op, std::function<void(const std::string&)> if_faulted) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({std::move(op), std::move(if_faulted)});
    ++issued_;
  }
  changed_.notify_all();
}

uint64_t HostStream::record() {
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_;
}

bool HostStream::passed(uint64_t mark) const {
  context().throw_if_faulted();
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= mark;
}

void HostStream::synchronize(uint64_t mark) const {
  std::unique_lock<std::mutex> lock(mutex_);
  // Another stream's fault is not announced here: look again now and then.
  while (completed_ < mark && !context().faulted()) changed_.wait_for(lock, std::chrono::milliseconds(10));
  context().throw_if_faulted();
}

void HostStream::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped, everything run
    Op op = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    if (!context().faulted()) {
      try {
        op.run();
      } catch (const std::exception& e) {
        context().fault(e.what());
      }
    } else if (op.if_faulted) {
      op.if_faulted(context().what());
    }
    op = {};  // what it captured goes before the host hears it ran
    lock.lock();
    ++completed_;
    changed_.notify_all();
  }
}

namespace {

HostStream& host(StreamDevice::Stream stream) { return *static_cast<HostStream*>(stream); }

struct HostEvent {
  HostStream* stream;
  uint64_t mark;
};

class HostStreams final : public StreamDevice {
 public:
  HostStreams(ControlBlock& control, Rendezvous& rendezvous, RingLayout ring, std::chrono::milliseconds timeout)
      : control_(control),
        ring_bytes_(ring.slot_bytes * static_cast<size_t>(ring.slots)),
        staging_(shm::staging_segment(rendezvous, "hca_stream_staging", control.rank(), control.world(),
                                      ring.slot_bytes, ring.slots, timeout)) {
    if (const char* at = std::getenv("TORCH_HCA_MODEL_FAULT_AT")) fault_at_ = std::strtoll(at, nullptr, 10);
  }

  char* staging(int rank) const override { return staging_->data() + static_cast<size_t>(rank) * ring_bytes_; }
  void copy(Stream stream, void* dst, const void* src, size_t bytes) override {
    issue_data(stream, [=] { std::memcpy(dst, src, bytes); });
  }
  void reduce(Stream stream, DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs,
              size_t nsrc, size_t n, void* out, int divisor) override {
    issue_data(stream, [=, sources = std::vector<const void*>(srcs, srcs + nsrc)] {
      shm::reduce_into(dtype, op, dst, first, sources.data(), nsrc, n, out, divisor);
    });
  }
  void scale_copy(Stream stream, DType dtype, void* dst, const void* src, size_t n, int divisor) override {
    issue_data(stream, [=] { shm::scale_copy(dtype, dst, src, n, divisor); });
  }
  // As a GPU's front end waits: no deadline (the executor's watchdog releases it).
  void wait_progress(Stream stream, int rank, uint32_t value) override {
    auto* word = &control_.progress(rank, ProgressWord::Stream);
    host(stream).issue([word, value] {
      for (int i = 0; !reached(word->load(std::memory_order_acquire), value) && !context().faulted(); ++i) {
        if (i < 64) {
          sched_yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
    });
  }
  void write_progress(Stream stream, int rank, uint32_t value) override {
    auto* word = &control_.progress(rank, ProgressWord::Stream);
    host(stream).issue([word, value] { word->store(value, std::memory_order_release); });
  }
  Event record(Stream stream) override { return new HostEvent{&host(stream), host(stream).record()}; }
  bool finished(Event event) override {
    const auto* e = static_cast<HostEvent*>(event);
    try {
      return e->stream->passed(e->mark);
    } catch (const std::runtime_error& fault) {
      throw Failure(FailureKind::Setup, "CPU model of the device", -1, fault.what());
    }
  }
  void destroy(Event event) override { delete static_cast<HostEvent*>(event); }
  void check_issuable(Stream) override {}
  std::unique_ptr<Scope> make_current() override { return nullptr; }

 private:
  // A data operation, or the injected fault in its place; skipped once this
  // rank has failed, as the CUDA kernels skip themselves.
  template <class Op>
  void issue_data(Stream stream, Op op) {
    if (++data_ops_ == fault_at_) {
      host(stream).issue([n = data_ops_] {
        throw std::runtime_error("injected fault at data operation " + std::to_string(n) +
                                 " (TORCH_HCA_MODEL_FAULT_AT)");
      });
      return;
    }
    host(stream).issue([released = &control_.failure_word(control_.rank()), op = std::move(op)] {
      if (released->load(std::memory_order_acquire) == 0) op();
    });
  }

  ControlBlock& control_;
  size_t ring_bytes_;
  std::unique_ptr<SharedSegment> staging_;
  int64_t data_ops_ = 0;  // by the executor's issuing thread only
  int64_t fault_at_ = -1;
};

}  // namespace

std::unique_ptr<Executor> make_host_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                                    RingLayout ring) {
  ring.slot_bytes = aligned_slot_bytes(ring.slot_bytes);
  auto open = [&control, ring](Rendezvous& rendezvous, int, std::chrono::milliseconds timeout) {
    return std::unique_ptr<StreamDevice>(new HostStreams(control, rendezvous, ring, timeout));
  };
  return make_stream_executor(control, std::move(rendezvous), std::move(open), ring);
}

}  // namespace hca
