#include "cuda_executor.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../medium.h"
#include "../round_runner.h"
#include "check.h"
#include "reduce_kernels.h"
#include "stream_ops.h"

namespace hca::cuda {
namespace {

constexpr uint32_t kProtocol = 1;
constexpr uint32_t kPoison = 1u << 30;  // added to a word: every pending wait on it passes

// What each rank publishes through the store before the ranks map each other.
struct PeerRecord {
  uint32_t protocol;
  int32_t pid;
  char host[64];
  char uuid[16];
  uint64_t slot_bytes;
  int32_t slots;
  cudaIpcMemHandle_t handle;
};

std::string hostname() {
  char name[64] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

std::string uuid_text(const char* uuid) {
  static const char* hex = "0123456789abcdef";
  std::string text = "GPU-";
  for (int i = 0; i < 16; ++i) {
    text += hex[(uuid[i] >> 4) & 15];
    text += hex[uuid[i] & 15];
  }
  return text;
}

// The local index of the GPU with this UUID, or -1.
int device_with_uuid(const char* uuid) {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
    if (std::memcmp(prop.uuid.bytes, uuid, 16) == 0) return d;
  }
  return -1;
}

[[noreturn]] void setup_failure(const std::string& why) { throw Failure(FailureKind::Setup, "CUDA setup", -1, why); }

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// This rank's staging (a ring of slots in one cudaMalloc) and every peer's, mapped by IPC.
class IpcStaging {
 public:
  IpcStaging(Rendezvous& rendezvous, int rank, int world, int device, const CudaConfig& config,
             std::chrono::milliseconds timeout)
      : rendezvous_(rendezvous), rank_(rank), world_(world), bases_(world, nullptr) {
    const size_t bytes = config.slot_bytes * static_cast<size_t>(config.slots);
    check(cudaMalloc(&own_, bytes), "cudaMalloc of the staging slots");
    bases_[rank] = static_cast<char*>(own_);
    PeerRecord mine{};
    mine.protocol = kProtocol;
    mine.pid = static_cast<int32_t>(getpid());
    std::strncpy(mine.host, hostname().c_str(), sizeof(mine.host) - 1);
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    std::memcpy(mine.uuid, prop.uuid.bytes, 16);
    mine.slot_bytes = config.slot_bytes;
    mine.slots = config.slots;
    check(cudaIpcGetMemHandle(&mine.handle, own_), "cudaIpcGetMemHandle");
    rendezvous.set("hca_cuda/" + std::to_string(rank),
                   std::string(reinterpret_cast<const char*>(&mine), sizeof(mine)));
    for (int peer = 0; peer < world; ++peer) {
      if (peer != rank) open_peer(peer, mine, device);
    }
    barrier("hca_cuda/opened", timeout);
  }

  ~IpcStaging() {
    for (int peer = 0; peer < world_; ++peer) {
      if (peer != rank_ && bases_[peer]) cudaIpcCloseMemHandle(bases_[peer]);
    }
    // Freeing memory that peers still map is undefined: wait (bounded) until they closed.
    try {
      barrier("hca_cuda/closed", std::chrono::milliseconds(5000));
    } catch (const std::exception&) {
    }
    cudaFree(own_);
  }

  char* base(int rank) const { return bases_[rank]; }

 private:
  void open_peer(int peer, const PeerRecord& mine, int device) {
    const std::string bytes = rendezvous_.get("hca_cuda/" + std::to_string(peer));
    PeerRecord theirs{};
    if (bytes.size() != sizeof(theirs)) setup_failure("rank " + std::to_string(peer) + " runs another torch_hca build");
    std::memcpy(&theirs, bytes.data(), sizeof(theirs));
    const std::string who = "rank " + std::to_string(peer) + " (" + uuid_text(theirs.uuid) + ")";
    const std::string me = "rank " + std::to_string(rank_) + " (cuda:" + std::to_string(device) + ", " +
                           uuid_text(mine.uuid) + ")";
    if (theirs.protocol != kProtocol) setup_failure(who + " runs another torch_hca build");
    if (std::strncmp(theirs.host, mine.host, sizeof(mine.host)) != 0) {
      setup_failure(who + " runs on host '" + theirs.host + "' and " + me + " on '" + mine.host +
                    "': CUDA IPC serves the ranks of one node only");
    }
    if (theirs.slot_bytes != mine.slot_bytes || theirs.slots != mine.slots) {
      setup_failure(who + " and " + me +
                    " disagree on TORCH_HCA_CUDA_CHUNK_BYTES / TORCH_HCA_CUDA_SLOTS: they must be the same on every rank");
    }
    const int local = device_with_uuid(theirs.uuid);
    if (local < 0) setup_failure(who + "'s GPU is not visible to " + me + " (CUDA_VISIBLE_DEVICES?)");
    if (local != device) {
      int can = 0;
      check(cudaDeviceCanAccessPeer(&can, device, local), "cudaDeviceCanAccessPeer");
      if (!can) {
        setup_failure(me + " cannot reach the memory of " + who + " on cuda:" + std::to_string(local) +
                      " (no peer access between the two GPUs)");
      }
    }
    void* mapped = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&mapped, theirs.handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      setup_failure(me + " could not map the staging of " + who + " by CUDA IPC: " + cudaGetErrorString(err));
    }
    bases_[peer] = static_cast<char*>(mapped);
  }

  void barrier(const std::string& key, std::chrono::milliseconds timeout) {
    rendezvous_.add(key, 1);
    const auto deadline = Clock::now() + timeout;
    while (rendezvous_.add(key, 0) < world_) {
      if (Clock::now() > deadline) setup_failure("not every rank reached " + key + " within " +
                                                 std::to_string(timeout.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  Rendezvous& rendezvous_;
  int rank_, world_;
  void* own_ = nullptr;
  std::vector<char*> bases_;
};

// The control block's pages, visible to the GPU for stream waits and writes.
class RegisteredControl {
 public:
  explicit RegisteredControl(ControlBlock& control) : control_(control) {
    check(cudaHostRegister(control.data(), control.size(), cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister of the control block");
    void* device = nullptr;
    check(cudaHostGetDevicePointer(&device, control.data(), 0), "cudaHostGetDevicePointer");
    device_base_ = reinterpret_cast<uint64_t>(device);
  }
  ~RegisteredControl() { cudaHostUnregister(control_.data()); }
  uint64_t word(int rank) const {
    const auto* host = &control_.progress(rank, ProgressWord::Cuda);
    return device_base_ + static_cast<uint64_t>(reinterpret_cast<const char*>(host) - control_.data());
  }

 private:
  ControlBlock& control_;
  uint64_t device_base_ = 0;
};

// Every operation is issued on the collective's stream; nothing waits on the host.
class CudaMedium final : public Medium {
 public:
  CudaMedium(const IpcStaging& staging, const RegisteredControl& control, const StreamOps& ops, int rank,
             const CudaConfig& config)
      : staging_(staging), control_(control), ops_(ops), rank_(rank), config_(config) {}
  void set_stream(cudaStream_t stream) { stream_ = stream; }

  char* staging(int rank, uint64_t round) const override {
    return staging_.base(rank) + (round % static_cast<uint64_t>(config_.slots)) * config_.slot_bytes;
  }
  size_t slot_bytes() const override { return config_.slot_bytes; }
  int slots() const override { return config_.slots; }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
  }
  void reduce(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t n,
              void* out, int divisor) override {
    reduce_async(stream_, dtype, op, dst, first, srcs, nsrc, n, out, divisor);
  }
  void scale_copy(DType dtype, void* dst, const void* src, size_t n, int divisor) override {
    scale_copy_async(stream_, dtype, dst, src, n, divisor);
  }
  void wait(int peer, uint32_t at_least, const WaitContext&) override {
    ops_.wait_geq(stream_, control_.word(peer), at_least);
  }
  void signal(uint32_t value) override { ops_.write(stream_, control_.word(rank_), value); }

 private:
  const IpcStaging& staging_;
  const RegisteredControl& control_;
  const StreamOps& ops_;
  int rank_;
  CudaConfig config_;
  cudaStream_t stream_ = nullptr;
};

class CudaExecutor final : public Executor {
 public:
  CudaExecutor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous, CudaConfig config)
      : control_(control), rendezvous_(std::move(rendezvous)), config_(config) {}

  ~CudaExecutor() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (device_ < 0) return;
    DeviceGuard guard(device_);
    drain();
    medium_.reset();
    runner_.reset();
    staging_.reset();
    registered_.reset();
  }

  void run(const Collective& collective) override {
    const WaitContext ctx = control_.begin(collective.signature, collective.timeout);
    auto stream = static_cast<cudaStream_t>(collective.stream);
    try {
      if (device_ < 0) set_up(collective.device, collective.timeout);
      if (collective.device != device_) {
        throw Failure(FailureKind::Setup, ctx.operation, -1,
                      "this group's CUDA executor serves cuda:" + std::to_string(device_) + ", not cuda:" +
                          std::to_string(collective.device) + " (one device per rank and group)");
      }
      DeviceGuard guard(device_);
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
      if (capturing != cudaStreamCaptureStatusNone) {
        throw Failure(FailureKind::Setup, ctx.operation, -1, "CUDA graph capture is not supported by hca yet");
      }
      control_.start(collective.signature, ctx);
      medium_->set_stream(stream);
      runner_->run(collective, ctx);
      cudaEvent_t done = nullptr;
      check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventRecord(done, stream), "cudaEventRecord");
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back({done, ctx, collective.released});
    } catch (const Failure& failure) {
      std::lock_guard<std::mutex> lock(mutex_);
      fail(failure);
      throw;
    }
  }

 private:
  struct Pending {
    cudaEvent_t done;
    WaitContext ctx;
    std::shared_ptr<Released> released;
  };

  void set_up(int device, std::chrono::milliseconds timeout) {
    DeviceGuard guard(device);
    ops_ = std::make_unique<StreamOps>(device);
    registered_ = std::make_unique<RegisteredControl>(control_);
    staging_ = std::make_unique<IpcStaging>(*rendezvous_, control_.rank(), control_.world(), device, config_, timeout);
    medium_ = std::make_unique<CudaMedium>(*staging_, *registered_, *ops_, control_.rank(), config_);
    runner_ = std::make_unique<RoundRunner>(*medium_, control_.rank(), control_.world());
    device_ = device;
    watchdog_ = std::thread([this] { watch(); });
  }

  // Publishes the cause and releases every stream that waits on a progress word.
  // Callers hold mutex_. Every unfinished collective is released: its Work says so in wait().
  void fail(const Failure& failure) {
    control_.publish_failure(failure);
    failed_ = true;
    for (auto& p : pending_) {
      if (p.released) p.released->set(failure.what());
    }
    poison();
  }

  void poison() {
    for (int r = 0; r < control_.world(); ++r) {
      auto& word = control_.progress(r, ProgressWord::Cuda);
      word.store(word.load(std::memory_order_relaxed) + kPoison, std::memory_order_release);
    }
  }

  // Pops finished collectives; for the oldest unfinished one, checks peers and its deadline.
  void watch() {
    DeviceGuard guard(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(2));
      while (!pending_.empty() && cudaEventQuery(pending_.front().done) == cudaSuccess) {
        cudaEventDestroy(pending_.front().done);
        pending_.pop_front();
      }
      if (pending_.empty()) continue;
      if (failed_) {
        poison();  // a live peer may have overwritten a poisoned word with a smaller value
        continue;
      }
      const WaitContext ctx = pending_.front().ctx;
      try {
        for (int peer = 0; peer < control_.world(); ++peer) {
          if (peer != control_.rank()) control_.check_peer(peer, ctx);
        }
      } catch (const Failure& failure) {
        fail(failure);
      }
    }
  }

  // Waits until every issued collective has finished (poisoning after the timeout).
  void drain() {
    const auto give_up = Clock::now() + std::chrono::seconds(30);
    for (auto& p : pending_) {
      while (cudaEventQuery(p.done) == cudaErrorNotReady) {
        if (Clock::now() > give_up) poison();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      cudaEventDestroy(p.done);
    }
    pending_.clear();
  }

  ControlBlock& control_;
  std::shared_ptr<Rendezvous> rendezvous_;
  CudaConfig config_;
  int device_ = -1;
  std::unique_ptr<StreamOps> ops_;
  std::unique_ptr<RegisteredControl> registered_;
  std::unique_ptr<IpcStaging> staging_;
  std::unique_ptr<CudaMedium> medium_;
  std::unique_ptr<RoundRunner> runner_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Executor> make_cuda_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                             CudaConfig config) {
  return std::make_unique<CudaExecutor>(control, std::move(rendezvous), config);
}

}  // namespace hca::cuda
