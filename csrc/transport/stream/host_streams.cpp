#include "host_streams.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "../../plan/rounds.h"
#include "../shm/kernels.h"
#include "../shm/shm_executor.h"
#include "aligned_span.h"
#include "model_runtime.h"
#include "staging_place.h"

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
    if (faulted()) throw Failure(FailureKind::DeviceFault, "CPU model of the device", -1, what());
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

class HostStream::Queue {
 public:
  Queue() : worker_([this] { work(); }) { worker_.detach(); }  // runs for the process's life, as the device does

  void push(std::shared_ptr<Counts> counts, std::function<void()> op,
            std::function<void(const std::string&)> if_faulted) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++counts->issued;
      entries_.push_back({std::move(counts), std::move(op), std::move(if_faulted)});
    }
    changed_.notify_all();
  }
  uint64_t issued(const Counts& counts) {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts.issued;
  }
  bool passed(const Counts& counts, uint64_t mark) {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts.completed >= mark;
  }
  void wait_passed(const Counts& counts, uint64_t mark) {
    std::unique_lock<std::mutex> lock(mutex_);
    // Another queue's fault is not announced here: look again now and then.
    while (counts.completed < mark && !context().faulted()) changed_.wait_for(lock, std::chrono::milliseconds(10));
  }
  bool is_current_thread() const { return std::this_thread::get_id() == id_; }

 private:
  struct Entry {
    std::shared_ptr<Counts> counts;
    std::function<void()> run;
    std::function<void(const std::string&)> if_faulted;
  };

  void work() {
    id_ = std::this_thread::get_id();
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      changed_.wait(lock, [&] { return !entries_.empty(); });
      Entry entry = std::move(entries_.front());
      entries_.pop_front();
      lock.unlock();
      if (!context().faulted()) {
        try {
          entry.run();
        } catch (const std::exception& e) {
          context().fault(e.what());
        }
      } else if (entry.if_faulted) {
        entry.if_faulted(context().what());
      }
      entry.run = {};  // what it captured goes before the host hears it ran
      entry.if_faulted = {};
      lock.lock();
      ++entry.counts->completed;
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Entry> entries_;
  std::atomic<std::thread::id> id_{};
  std::thread worker_;
};

namespace {

// CUDA_DEVICE_MAX_CONNECTIONS as the driver reads it: 8 unless set, at most 32.
size_t queues_per_device() {
  const char* text = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const long asked = text && *text ? std::strtol(text, nullptr, 10) : 8;
  return static_cast<size_t>(std::min(32L, std::max(1L, asked)));
}

// The queue of the next stream created on `device`, round robin.
std::shared_ptr<HostStream::Queue> next_queue(int device) {
  struct Queues {
    std::vector<std::shared_ptr<HostStream::Queue>> queues;
    size_t created = 0;
  };
  static std::mutex mutex;
  static auto* devices = new std::map<int, Queues>();  // never destroyed: the queues' threads run to the end
  std::lock_guard<std::mutex> lock(mutex);
  Queues& mine = (*devices)[device];
  if (mine.queues.empty()) {
    for (size_t i = 0; i < queues_per_device(); ++i) mine.queues.push_back(std::make_shared<HostStream::Queue>());
  }
  return mine.queues[mine.created++ % mine.queues.size()];
}

}  // namespace

HostStream::HostStream(int device)
    : device_(device), queue_(next_queue(device)), counts_(std::make_shared<Counts>()) {}

HostStream::~HostStream() {
  // The last owner may be one of the queue's own operations (a Work freed by a Future's callback).
  if (!queue_->is_current_thread()) queue_->wait_passed(*counts_, queue_->issued(*counts_));
}

void HostStream::issue(std::function<void()> op, std::function<void(const std::string&)> if_faulted) {
  queue_->push(counts_, std::move(op), std::move(if_faulted));
}

uint64_t HostStream::record() { return queue_->issued(*counts_); }

bool HostStream::passed(uint64_t mark) const {
  context().throw_if_faulted();
  return queue_->passed(*counts_, mark);
}

void HostStream::wait_passed(uint64_t mark) const { queue_->wait_passed(*counts_, mark); }

void HostStream::synchronize(uint64_t mark) const {
  wait_passed(mark);
  context().throw_if_faulted();
}

bool HostStream::is_current_thread() const { return queue_->is_current_thread(); }

namespace {

class HostStreams final : public StreamDevice {
 public:
  // With `device` current.
  HostStreams(ControlBlock& control, Rendezvous& rendezvous, int device, RingLayout ring,
              std::chrono::milliseconds timeout)
      : control_(control), ring_(ring), choice_(choose_place(rendezvous, control, device, timeout)) {
    why_host_ = "some rank cannot map a peer's device memory, or TORCH_HCA_CUDA_STAGING=host";
    if (choice_.place == StagingPlace::DeviceMemory) settle_mapping(rendezvous, timeout);
    if (choice_.place == StagingPlace::HostMemory) {
      FittedRing fitted = agree_host_ring(rendezvous, "model_host_ring", control.rank(), control.world(), ring, timeout);
      ring_ = fitted.ring;
      ring_cut_ = std::move(fitted.note);
    }
    staging_ = shm::staging_segment(rendezvous, "hca_stream_staging", control.rank(), control.world(),
                                    ring_.slot_bytes, ring_.slots, timeout);
    if (const char* at = std::getenv("TORCH_HCA_MODEL_FAULT_AT")) fault_at_ = std::strtoll(at, nullptr, 10);
    if (const char* at = std::getenv("TORCH_HCA_MODEL_CORRUPT_AT")) corrupt_at_ = std::strtoll(at, nullptr, 10);
    if (const char* ms = std::getenv("TORCH_HCA_MODEL_OP_DELAY_MS")) {
      op_delay_ = std::chrono::milliseconds(std::strtoll(ms, nullptr, 10));
    }
  }

  // As the CUDA staging is freed (cuda_executor.cpp): once every peer has let
  // go of its view of ours, through the control block (the store may be gone).
  // A peer's stream touching it after this rank left faults (check_peer_memory).
  ~HostStreams() override {
    control_.mark_staging_closed();
    control_.await_peers_closed_staging();
  }

  DeviceRuntime& runtime() override { return ModelRuntime::instance(); }
  char* staging(int rank) const override { return staging_->data() + static_cast<size_t>(rank) * ring_.bytes(); }
  RingLayout ring() const override { return ring_; }
  std::string staging_kind() const override {
    return choice_.place == StagingPlace::HostMemory
               ? "host shared memory that every device maps (the CPU model's; " + why_host_ + ")" +
                     (ring_cut_.empty() ? "" : "; " + ring_cut_)
               : "device memory, each rank's mapped by its peers (the CPU model's CUDA IPC)";
  }
  // In the pieces the CUDA copy kernels take (aligned_span.h), so that a wrong cut shows here.
  void copy(Stream stream, void* dst, const void* src, size_t bytes) override {
    issue_data(stream, {dst, src}, [=] {
      const AlignedSpan span = aligned_span(dst, src, bytes);
      const size_t bulk = span.unit * span.units;
      auto* d = static_cast<char*>(dst);
      const auto* s = static_cast<const char*>(src);
      std::memcpy(d, s, span.head);
      std::memcpy(d + span.head, s + span.head, bulk);
      std::memcpy(d + span.head + bulk, s + span.head + bulk, span.tail);
    });
  }
  void reduce(Stream stream, DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs,
              size_t nsrc, size_t n, void* out, int divisor) override {
    std::vector<const void*> touched{dst, first, out};
    touched.insert(touched.end(), srcs, srcs + nsrc);
    const bool corrupt = ++reduces_ == corrupt_at_;
    issue_data(stream, std::move(touched), [=, sources = std::vector<const void*>(srcs, srcs + nsrc)] {
      shm::reduce_into(dtype, op, dst, first, sources.data(), nsrc, n, out, divisor);
      if (corrupt && n > 0) {  // what this rank and its peers read next: the result in the slot and in the output
        static_cast<unsigned char*>(dst)[element_size(dtype) - 1] ^= 0x40;
        if (out != nullptr) static_cast<unsigned char*>(out)[element_size(dtype) - 1] ^= 0x40;
      }
    });
  }
  // As a GPU's front end waits: no deadline (the executor's watchdog releases it).
  void wait_progress(Stream stream, int rank, uint32_t value, ProgressWord kind) override {
    auto* word = &control_.progress(rank, kind);
    ModelRuntime::instance().launch_on(stream).issue([word, value] {
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
    ModelRuntime::instance().launch_on(stream).issue([word, value] { word->store(value, std::memory_order_release); });
  }

 private:
  // Whether any rank of the group has published a failure.
  bool group_released() const {
    for (int r = 0; r < control_.world(); ++r) {
      if (control_.failure_word(r).load(std::memory_order_acquire) != 0) return true;
    }
    return false;
  }

  // As CUDA does (staging_place.h), from the physical devices this process sees;
  // TORCH_HCA_CUDA_STAGING=host asks for host memory here too.
  static StagingChoice choose_place(Rendezvous& rendezvous, const ControlBlock& control, int device,
                                    std::chrono::milliseconds timeout) {
    const ModelRuntime& runtime = ModelRuntime::instance();
    const char* asked = std::getenv("TORCH_HCA_CUDA_STAGING");
    return choose_staging_place(
        rendezvous, "model_staging", control.rank(), control.world(), std::to_string(runtime.physical(device)),
        [&runtime](const std::string& id) { return runtime.sees_physical(std::stoi(id)); },
        asked && std::string(asked) == "host", timeout);
  }

  // As the CUDA staging does after it tried CUDA IPC: where some rank could not
  // map a peer's device memory (here: the ranks TORCH_HCA_MODEL_IPC_FAIL names,
  // comma-separated, fail to map their first peer's), every rank stages in
  // host memory, and says why.
  void settle_mapping(Rendezvous& rendezvous, std::chrono::milliseconds timeout) {
    const int rank = control_.rank();
    std::string mine;
    if (const char* failing = std::getenv("TORCH_HCA_MODEL_IPC_FAIL")) {
      const std::string list = "," + std::string(failing) + ",";
      if (list.find("," + std::to_string(rank) + ",") != std::string::npos) {
        mine = "could not map the staging of rank " + std::to_string(rank == 0 ? 1 : 0) +
               " by CUDA IPC (injected by TORCH_HCA_MODEL_IPC_FAIL)";
      }
    }
    const std::string failed = agree_mapped(rendezvous, "model_mapped", rank, control_.world(), mine, timeout);
    if (failed.empty()) return;
    choice_.place = StagingPlace::HostMemory;
    why_host_ = failed + ", so every rank stages in host memory";
  }

  // Throws (faulting the device) if `p` lies in the staging of a peer that this
  // rank cannot map: device memory of a device it does not see, or of a peer
  // whose memory may be gone (host staging stays mapped in every process).
  void check_peer_memory(const void* p) const {
    const char* at = static_cast<const char*>(p);
    if (!at || at < staging_->data() || at >= staging_->data() + staging_->size()) return;
    const int owner = static_cast<int>(static_cast<size_t>(at - staging_->data()) / ring_.bytes());
    if (owner == control_.rank() || choice_.place == StagingPlace::HostMemory) return;
    if (!ModelRuntime::instance().sees_physical(std::stoi(choice_.devices[owner]))) {
      throw std::runtime_error("an illegal memory access: an operation touched the device memory of rank " +
                               std::to_string(owner) + " (physical device " + choice_.devices[owner] +
                               "), which this process does not see");
    }
    const std::string gone = control_.why_memory_gone(owner);
    if (!gone.empty()) {
      throw std::runtime_error("an illegal memory access: an operation touched the staging of rank " +
                               std::to_string(owner) + " (mapped from its process), which " + gone);
    }
  }

  // A data operation (a kernel: launched on a stream of the current device), or
  // the injected fault in its place; skipped once a rank of the group failed,
  // as the CUDA kernels skip themselves.
  template <class Op>
  void issue_data(Stream stream, std::vector<const void*> touched, Op op) {
    HostStream& target = ModelRuntime::instance().launch_on(stream);
    if (++data_ops_ == fault_at_) {
      target.issue([n = data_ops_] {
        throw std::runtime_error("injected fault at data operation " + std::to_string(n) +
                                 " (TORCH_HCA_MODEL_FAULT_AT)");
      });
      return;
    }
    target.issue([this, touched = std::move(touched), op = std::move(op)] {
      std::this_thread::sleep_for(op_delay_);
      if (group_released()) return;
      for (const void* p : touched) check_peer_memory(p);
      op();
    });
  }

  ControlBlock& control_;
  RingLayout ring_;
  StagingChoice choice_;
  std::string why_host_;  // why the staging is in host memory, where it is
  std::string ring_cut_;  // what /dev/shm's room cut from the ring asked ("" nothing)
  std::unique_ptr<SharedSegment> staging_;
  // By the executor's issuing thread only.
  int64_t data_ops_ = 0, reduces_ = 0;
  int64_t fault_at_ = -1, corrupt_at_ = -1;
  std::chrono::milliseconds op_delay_{0};
};

}  // namespace

std::unique_ptr<Executor> make_host_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                                    RingLayout ring) {
  ring.slot_bytes = aligned_slot_bytes(ring.slot_bytes);
  auto open = [&control, ring](Rendezvous& rendezvous, int device, std::chrono::milliseconds timeout) {
    DeviceGuard guard(ModelRuntime::instance(), device);
    return std::unique_ptr<StreamDevice>(new HostStreams(control, rendezvous, device, ring, timeout));
  };
  return make_stream_executor(control, std::move(rendezvous), std::move(open));
}

}  // namespace hca
