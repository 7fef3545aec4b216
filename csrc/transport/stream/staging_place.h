// Where a stream device's staging lives, chosen the same on every rank: in
// device memory that each rank maps from its peers (CUDA IPC) where every rank
// can map every peer's device, else in host shared memory that every device
// maps (one visible GPU per process, as SLURM or Kubernetes launch; GPUs that
// are not peers; or a rank that asks for it). NCCL chooses alike: its P2P
// transport where GPUs reach each other, its shared-memory transport otherwise.
#pragma once
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "../rendezvous.h"

namespace hca {

enum class StagingPlace { DeviceMemory, HostMemory };

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

}  // namespace hca
