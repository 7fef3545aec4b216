#include "host_streams.h"

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "../../plan/rounds.h"
#include "../shm/kernels.h"
#include "../shm/shm_executor.h"

namespace hca {
namespace {

class HostStreams final : public StreamDevice {
 public:
  HostStreams(ControlBlock& control, Rendezvous& rendezvous, RingLayout ring, std::chrono::milliseconds timeout)
      : control_(control),
        ring_bytes_(ring.slot_bytes * static_cast<size_t>(ring.slots)),
        staging_(shm::staging_segment(rendezvous, "hca_stream_staging", control.rank(), control.world(),
                                      ring.slot_bytes, ring.slots, timeout)),
        worker_([this] { work(); }) {}

  ~HostStreams() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    queued_.notify_all();
    worker_.join();
  }

  char* staging(int rank) const override { return staging_->data() + static_cast<size_t>(rank) * ring_bytes_; }
  void copy(Stream, void* dst, const void* src, size_t bytes) override {
    issue([=] { std::memcpy(dst, src, bytes); });
  }
  void reduce(Stream, DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc,
              size_t n, void* out, int divisor) override {
    issue([=, sources = std::vector<const void*>(srcs, srcs + nsrc)] {
      shm::reduce_into(dtype, op, dst, first, sources.data(), nsrc, n, out, divisor);
    });
  }
  void scale_copy(Stream, DType dtype, void* dst, const void* src, size_t n, int divisor) override {
    issue([=] { shm::scale_copy(dtype, dst, src, n, divisor); });
  }
  // As a GPU's front end waits: no deadline (the executor's watchdog releases it).
  void wait_progress(Stream, int rank, uint32_t value) override {
    auto* word = &control_.progress(rank, ProgressWord::Stream);
    issue([this, word, value] {
      for (int i = 0; !reached(word->load(std::memory_order_acquire), value) && !stop_; ++i) {
        if (i < 64) {
          sched_yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
    });
  }
  void write_progress(Stream, int rank, uint32_t value) override {
    auto* word = &control_.progress(rank, ProgressWord::Stream);
    issue([word, value] { word->store(value, std::memory_order_release); });
  }
  // An event is the number of operations issued before it.
  Event record(Stream) override { return reinterpret_cast<Event>(static_cast<uintptr_t>(issued_)); }
  bool finished(Event event) override {
    return completed_.load(std::memory_order_acquire) >= reinterpret_cast<uintptr_t>(event);
  }
  void destroy(Event) override {}
  void check_issuable(Stream) override {}
  std::unique_ptr<Scope> make_current() override { return nullptr; }

 private:
  void issue(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(op));
    }
    ++issued_;
    queued_.notify_one();
  }

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped, everything run
      auto op = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      op();
      completed_.fetch_add(1, std::memory_order_release);
      lock.lock();
    }
  }

  ControlBlock& control_;
  size_t ring_bytes_;
  std::unique_ptr<SharedSegment> staging_;
  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::function<void()>> queue_;
  uint64_t issued_ = 0;  // by the executor's issuing thread only
  std::atomic<uint64_t> completed_{0};
  std::atomic<bool> stop_{false};
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Executor> make_host_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                                    RingLayout ring) {
  ring.slot_bytes = aligned_slot_bytes(ring.slot_bytes);
  auto open = [&control, ring](Rendezvous& rendezvous, int, std::chrono::milliseconds timeout) {
    return std::unique_ptr<StreamDevice>(new HostStreams(control, rendezvous, ring, timeout));
  };
  return make_stream_executor(control, std::move(rendezvous), std::move(open), ring, Completion::Host);
}

}  // namespace hca
