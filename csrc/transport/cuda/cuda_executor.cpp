#include "cuda_executor.h"

#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../../plan/rounds.h"
#include "../control/segment.h"
#include "../shm/shm_executor.h"
#include "../stream/staging_place.h"
#include "../stream/stream_executor.h"
#include "check.h"
#include "cuda_runtime.h"
#include "data_kernels.h"
#include "stream_ops.h"

namespace hca::cuda {
namespace {

constexpr uint32_t kProtocol = 2;

// What each rank publishes through the store before the ranks choose where
// their staging lives.
struct PeerRecord {
  uint32_t protocol;
  int32_t pid;
  char host[64];
  char uuid[16];
  uint64_t slot_bytes;
  int32_t slots;
};

// The local index of the GPU with this UUID (as uuid_text writes it), or -1.
int device_with_uuid(const std::string& uuid) {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
    if (uuid_text(prop.uuid.bytes) == uuid) return d;
  }
  return -1;
}

[[noreturn]] void setup_failure(const std::string& why) { throw Failure(FailureKind::Setup, "CUDA setup", -1, why); }

// Until every rank has passed `key` (a peer's published setup failure is raised at once).
void barrier(Rendezvous& rendezvous, int world, const std::string& key, std::chrono::milliseconds timeout) {
  rendezvous.add(key, 1);
  await_setup(rendezvous, [&] { return rendezvous.add(key, 0) >= world; }, timeout, "not every rank reached " + key);
}

// The fixed-size record `peer` published under `prefix` + its rank.
template <class Record>
Record await_record(Rendezvous& rendezvous, const std::string& prefix, int peer, std::chrono::milliseconds timeout) {
  const std::string key = prefix + std::to_string(peer);
  await_setup(rendezvous, [&] { return rendezvous.has(key); }, timeout,
              "rank " + std::to_string(peer) + " did not publish its CUDA staging");
  const std::string bytes = rendezvous.get(key);
  Record record{};
  if (bytes.size() != sizeof(record)) setup_failure("rank " + std::to_string(peer) + " runs another torch_hca build");
  std::memcpy(&record, bytes.data(), sizeof(record));
  return record;
}

// Every rank's staging ring, as this rank's GPU addresses it.
class Staging {
 public:
  explicit Staging(RingLayout ring) : ring_(ring) {}
  virtual ~Staging() = default;
  virtual char* base(int rank) const = 0;
  virtual std::string kind() const = 0;
  RingLayout ring() const { return ring_; }

 protected:
  const RingLayout ring_;
};

// Checks `peer`'s record against this rank's (one node, one build, the same staging sizes).
void check_peer(Rendezvous& rendezvous, int peer, const PeerRecord& mine, const std::string& me,
                std::chrono::milliseconds timeout) {
  const auto theirs = await_record<PeerRecord>(rendezvous, "hca_cuda/", peer, timeout);
  const std::string who = "rank " + std::to_string(peer) + " (" + uuid_text(theirs.uuid) + ")";
  if (theirs.protocol != kProtocol) setup_failure(who + " runs another torch_hca build");
  if (std::strncmp(theirs.host, mine.host, sizeof(mine.host)) != 0) {
    setup_failure(who + " runs on '" + theirs.host + "' and " + me + " on '" + mine.host +
                  "': CUDA staging serves the ranks of one node (one kernel, one /dev/shm) only");
  }
  if (theirs.slot_bytes != mine.slot_bytes || theirs.slots != mine.slots) {
    setup_failure(who + " and " + me +
                  " disagree on TORCH_HCA_CUDA_CHUNK_BYTES / TORCH_HCA_CUDA_SLOTS: they must be the same on every rank");
  }
}

// Where the staging lives (staging_place.h): a peer's GPU is reachable when it
// is visible here (CUDA_VISIBLE_DEVICES) and is this GPU or a CUDA peer of it;
// TORCH_HCA_CUDA_STAGING=host asks for host memory. Each rank's record is
// checked first (one node, one build, the same staging sizes asked).
StagingChoice choose_place(Rendezvous& rendezvous, int rank, int world, int device, const CudaConfig& config,
                          std::chrono::milliseconds timeout) {
  PeerRecord mine{};
  mine.protocol = kProtocol;
  mine.pid = static_cast<int32_t>(getpid());
  std::strncpy(mine.host, shared_memory_identity().c_str(), sizeof(mine.host) - 1);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::memcpy(mine.uuid, prop.uuid.bytes, 16);
  mine.slot_bytes = config.slot_bytes;
  mine.slots = config.slots;
  rendezvous.set("hca_cuda/" + std::to_string(rank), std::string(reinterpret_cast<const char*>(&mine), sizeof(mine)));
  const std::string me = "rank " + std::to_string(rank) + " (cuda:" + std::to_string(device) + ", " +
                         uuid_text(mine.uuid) + ")";
  for (int peer = 0; peer < world; ++peer) {
    if (peer != rank) check_peer(rendezvous, peer, mine, me, timeout);
  }
  auto reaches = [device](const std::string& uuid) {
    const int local = device_with_uuid(uuid);
    int can = local == device ? 1 : 0;
    if (local >= 0 && local != device) check(cudaDeviceCanAccessPeer(&can, device, local), "cudaDeviceCanAccessPeer");
    return can != 0;
  };
  return choose_staging_place(rendezvous, "cuda_staging", rank, world, uuid_text(mine.uuid), reaches,
                              config.host_staging, timeout);
}

// This rank's staging (a ring of slots in one cudaMalloc) and every peer's, mapped by IPC.
class IpcStaging final : public Staging {
 public:
  IpcStaging(ControlBlock& control, Rendezvous& rendezvous, int rank, int world, RingLayout ring,
             std::chrono::milliseconds timeout)
      : Staging(ring),
        control_(control),
        rendezvous_(rendezvous),
        rank_(rank),
        world_(world),
        bases_(world, nullptr) {
    const size_t bytes = product_bytes(ring.slot_bytes, static_cast<size_t>(ring.slots), 1, "the CUDA staging");
    check(cudaMalloc(&own_, bytes), "cudaMalloc of the staging slots");
    bases_[rank] = static_cast<char*>(own_);
    try {
      publish_and_map(timeout);
    } catch (...) {
      // Peers may have mapped our slots before this rank failed: they fail as well, and close first.
      close_and_free();
      throw;
    }
  }

  ~IpcStaging() override {
    if (own_) close_and_free();
  }

  // Why this rank could not map some peer's staging ("" where it mapped all).
  const std::string& map_failure() const { return map_failure_; }
  // Where some rank could not map a peer's: every rank lets go of what it
  // mapped, and frees its own once every rank has (a barrier), before the
  // ranks stage in host memory instead.
  void abandon(std::chrono::milliseconds timeout) {
    close_peers();
    barrier(rendezvous_, world_, "hca_cuda/closed_unmapped", timeout);
    cudaFree(own_);
    own_ = nullptr;
  }

  char* base(int rank) const override { return bases_[rank]; }
  std::string kind() const override { return "GPU memory, each rank's mapped by its peers through CUDA IPC"; }

 private:
  void publish_and_map(std::chrono::milliseconds timeout) {
    cudaIpcMemHandle_t handle{};
    check(cudaIpcGetMemHandle(&handle, own_), "cudaIpcGetMemHandle");
    rendezvous_.set("hca_cuda_ipc/" + std::to_string(rank_),
                    std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
    for (int peer = 0; peer < world_ && map_failure_.empty(); ++peer) {
      if (peer != rank_) open_peer(peer, timeout);
    }
  }

  // Freeing memory that peers still map is undefined: it is freed once every
  // peer has closed its mappings or is gone, and left allocated (until the
  // process ends) when one does not say so in time (it hangs). Through the
  // control block: the store may be gone with rank 0 by now.
  void close_and_free() {
    close_peers();
    control_.mark_staging_closed();
    if (control_.await_peers_closed_staging()) cudaFree(own_);
  }

  void close_peers() {
    for (int peer = 0; peer < world_; ++peer) {
      if (peer != rank_ && bases_[peer]) cudaIpcCloseMemHandle(bases_[peer]);
      if (peer != rank_) bases_[peer] = nullptr;
    }
  }

  void open_peer(int peer, std::chrono::milliseconds timeout) {
    const auto handle = await_record<cudaIpcMemHandle_t>(rendezvous_, "hca_cuda_ipc/", peer, timeout);
    void* mapped = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      map_failure_ = "could not map the staging of rank " + std::to_string(peer) + " by CUDA IPC (" +
                     cudaGetErrorString(err) + ")";
      return;
    }
    bases_[peer] = static_cast<char*>(mapped);
  }

  ControlBlock& control_;
  Rendezvous& rendezvous_;
  int rank_, world_;
  void* own_ = nullptr;
  std::vector<char*> bases_;
  std::string map_failure_;
};

// Every rank's ring in one POSIX shared-memory segment, which every rank maps
// and registers with its GPU: the kernels read and write it over the bus. A
// peer that dies leaves the memory mapped here (unlike IPC-mapped GPU memory).
class HostStaging final : public Staging {
 public:
  // `why`: why not in GPU memory; `fitted`: the ring, cut to what /dev/shm holds.
  HostStaging(Rendezvous& rendezvous, int rank, int world, FittedRing fitted, std::string why,
              std::chrono::milliseconds timeout)
      : Staging(fitted.ring),
        why_(std::move(why)),
        cut_(std::move(fitted.note)),
        segment_(shm::staging_segment(rendezvous, "hca_cuda_host_staging", rank, world, ring_.slot_bytes, ring_.slots,
                                      timeout)) {
    check(cudaHostRegister(segment_->data(), segment_->size(), cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister of the host staging");
    void* device = nullptr;
    check(cudaHostGetDevicePointer(&device, segment_->data(), 0), "cudaHostGetDevicePointer of the host staging");
    device_base_ = static_cast<char*>(device);
  }
  ~HostStaging() override { cudaHostUnregister(segment_->data()); }

  char* base(int rank) const override { return device_base_ + static_cast<size_t>(rank) * ring_.bytes(); }
  std::string kind() const override {
    return "host shared memory registered with every GPU (" + why_ + ")" + (cut_.empty() ? "" : "; " + cut_);
  }

 private:
  std::string why_, cut_;
  std::unique_ptr<SharedSegment> segment_;
  char* device_base_ = nullptr;
};

// Every rank's ring, in the place and of the slot size the ranks chose together.
std::unique_ptr<Staging> open_staging(ControlBlock& control, Rendezvous& rendezvous, int device,
                                      const CudaConfig& config, std::chrono::milliseconds timeout) {
  const int rank = control.rank(), world = control.world();
  const StagingChoice choice = choose_place(rendezvous, rank, world, device, config, timeout);
  const size_t slot_bytes = ring_slot_bytes(config.slot_bytes, choice.devices, kSlotBytesSpread, kSlotBytesOneGpu);
  const RingLayout ring{aligned_slot_bytes(slot_bytes), config.slots};
  std::string why = "some rank cannot map a peer's GPU memory, or TORCH_HCA_CUDA_STAGING=host";
  if (choice.place == StagingPlace::DeviceMemory) {
    auto mapped = std::make_unique<IpcStaging>(control, rendezvous, rank, world, ring, timeout);
    const std::string failed = agree_mapped(rendezvous, "hca_cuda_mapped", rank, world, mapped->map_failure(), timeout);
    if (failed.empty()) return mapped;
    mapped->abandon(timeout);
    why = failed + ", so every rank stages in host memory";
  }
  FittedRing fitted{ring, ""};
  try {
    fitted = agree_host_ring(rendezvous, "hca_cuda_host_ring", rank, world, ring, timeout);
  } catch (const Failure&) {
    throw;
  } catch (const std::runtime_error& e) {  // not one slot fits in /dev/shm
    setup_failure(e.what());
  }
  return std::make_unique<HostStaging>(rendezvous, rank, world, std::move(fitted), why, timeout);
}

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

  uint64_t progress_word(int rank, ProgressWord word = ProgressWord::Stream) const {
    return device_address(&control_.progress(rank, word));
  }
  // Every rank's failure word, as the GPU addresses them.
  ReleaseWords failure_words() const {
    return {reinterpret_cast<const uint32_t*>(device_address(&control_.failure_word(0))),
            static_cast<uint32_t>(sizeof(RankSlot) / sizeof(uint32_t)), control_.world()};
  }

 private:
  uint64_t device_address(const void* host) const {
    return device_base_ + static_cast<uint64_t>(static_cast<const char*>(host) - control_.data());
  }

  ControlBlock& control_;
  uint64_t device_base_ = 0;
};

// CUDA streams as a StreamDevice: IPC-mapped staging, copy and reduce kernels
// (which do nothing once any rank's failure word is set), and stream memory
// operations on the registered control block.
class CudaDevice final : public StreamDevice {
 public:
  // With `device` current.
  CudaDevice(ControlBlock& control, Rendezvous& rendezvous, int device, const CudaConfig& config,
             std::chrono::milliseconds timeout)
      : ops_(device),
        registered_(control),
        released_(registered_.failure_words()),
        staging_(open_staging(control, rendezvous, device, config, timeout)) {}

  DeviceRuntime& runtime() override { return cuda::runtime(); }
  char* staging(int rank) const override { return staging_->base(rank); }
  std::string staging_kind() const override { return staging_->kind(); }
  RingLayout ring() const override { return staging_->ring(); }
  void copy(Stream stream, void* dst, const void* src, size_t bytes) override {
    copy_async(cuda(stream), released_, dst, src, bytes);
  }
  void reduce(Stream stream, DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs,
              size_t nsrc, size_t n, void* out, int divisor) override {
    reduce_async(cuda(stream), released_, dtype, op, dst, first, srcs, nsrc, n, out, divisor);
  }
  void wait_progress(Stream stream, int rank, uint32_t value, ProgressWord word) override {
    ops_.wait_geq(cuda(stream), registered_.progress_word(rank, word), value);
  }
  void write_progress(Stream stream, int rank, uint32_t value) override {
    ops_.write(cuda(stream), registered_.progress_word(rank), value);
  }

 private:
  static cudaStream_t cuda(Stream stream) { return static_cast<cudaStream_t>(stream); }

  StreamOps ops_;
  RegisteredControl registered_;
  ReleaseWords released_;
  std::unique_ptr<Staging> staging_;
};

}  // namespace

std::unique_ptr<Executor> make_cuda_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                             CudaConfig config) {
  auto open = [&control, config](Rendezvous& rendezvous, int device, std::chrono::milliseconds timeout) {
    DeviceGuard guard(cuda::runtime(), device);
    return std::unique_ptr<StreamDevice>(new CudaDevice(control, rendezvous, device, config, timeout));
  };
  return make_stream_executor(control, std::move(rendezvous), std::move(open));
}

}  // namespace hca::cuda
