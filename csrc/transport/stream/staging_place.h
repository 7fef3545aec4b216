// Where a stream device's staging lives, chosen the same on every rank: in
// device memory that each rank maps from its peers (CUDA IPC) where every rank
// can map every peer's device, else in host shared memory that every device
// maps (one visible GPU per process, as SLURM or Kubernetes launch; GPUs that
// are not peers; or a rank that asks for it). NCCL chooses alike: its P2P
// transport where GPUs reach each other, its shared-memory transport otherwise.
#pragma once
#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "../rendezvous.h"

namespace hca {

enum class StagingPlace { DeviceMemory, HostMemory };

// The staging ring of each rank; every rank must use the same.
struct RingLayout {
  size_t slot_bytes;
  int slots;
  size_t bytes() const { return slot_bytes * static_cast<size_t>(slots); }
};

struct StagingChoice {
  StagingPlace place;
  std::vector<std::string> devices;  // each rank's device id, as it reported it
};

// Every rank reports `my_device` (an id of its physical device, the same text
// wherever that device is seen) under `topic`; `reaches(id)` says whether this
// rank can map the memory of the device with that id. One rank that cannot
// reach a peer's device, or that sets `host_asked`, makes every rank stage in
// host memory.
StagingChoice choose_staging_place(Rendezvous& rendezvous, const std::string& topic, int rank, int world,
                                  const std::string& my_device, const std::function<bool(const std::string&)>& reaches,
                                  bool host_asked, std::chrono::milliseconds timeout);

// Whether two or more ranks reported one and the same device (exchanged
// reports, so the same answer on every rank): processes sharing a GPU.
bool share_one_device(const std::vector<std::string>& devices);
// Whether ranks that report these devices are two or more, each on a device of its own.
bool each_on_its_own(const std::vector<std::string>& devices);

// The slot size for a ring: `asked` where it is set (non-zero), else
// `one_device` where two or more ranks reported one and the same device
// (StagingChoice::devices) and `spread` otherwise. Processes that share a GPU
// take turns on it, and each round of a call costs about a switch between them
// (a millisecond on an H200) whatever its size, so there fewer, larger rounds
// are faster. The same on every rank: the devices are the exchanged reports.
size_t ring_slot_bytes(size_t asked, const std::vector<std::string>& devices, size_t spread, size_t one_device);

// After each rank tried to map every peer's device staging (CUDA IPC), which
// can fail where the driver said the devices are peers (a container without
// the right namespaces): `mine` is "" where this rank mapped all, else why not.
// Returns the first failure in rank order, "rank R <why>", the same on every
// rank, or "" where every rank mapped every peer's: a barrier as well.
std::string agree_mapped(Rendezvous& rendezvous, const std::string& topic, int rank, int world,
                         const std::string& mine, std::chrono::milliseconds timeout);

// Host staging sized to what /dev/shm holds (containers give it 64 MiB):
// `world` rings of `asked` where `free_bytes` holds them, else fewer slots (down
// to 2), else smaller slots (halved, down to kLeastSlotBytes). `note` says what
// was cut and why ("" where nothing was). Throws std::runtime_error naming the
// sizes where not even 2 of the smallest slots a rank fit.
struct FittedRing {
  RingLayout ring;
  std::string note;
};
constexpr size_t kLeastSlotBytes = 4096;
FittedRing fit_ring(RingLayout asked, int world, size_t free_bytes);
// fit_ring of the bytes /dev/shm has free as rank 0 finds them now, the same on
// every rank (rank 0's failure too); rank 0 writes the note to stderr.
FittedRing agree_host_ring(Rendezvous& rendezvous, const std::string& topic, int rank, int world, RingLayout asked,
                           std::chrono::milliseconds timeout);

}  // namespace hca
