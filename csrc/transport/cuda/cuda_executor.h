// The stream executor (stream/stream_executor.h) over CUDA: per-rank staging
// slots in raw cudaMalloc memory shared through CUDA IPC (or, where a rank
// cannot map a peer's GPU memory, in host shared memory), copies and reduce
// kernels on the collective's stream, and ranks ordered by stream memory
// operations on their progress words in the node's control block (registered
// with the GPU): no kernel ever waits for another process, so several ranks may
// share a GPU.
#pragma once
#include <chrono>
#include <memory>

#include "../control/control_block.h"
#include "../executor.h"
#include "../rendezvous.h"

namespace hca::cuda {

// A slot where the ranks' GPUs differ, and where every rank shares one GPU
// (ring_slot_bytes: there each round costs a switch between the processes).
constexpr size_t kSlotBytesSpread = 8u << 20;
constexpr size_t kSlotBytesOneGpu = 64u << 20;

struct CudaConfig {
  size_t slot_bytes = 0;  // TORCH_HCA_CUDA_CHUNK_BYTES; 0: one of the two above, chosen at setup
  int slots = 4;          // TORCH_HCA_CUDA_SLOTS: the ring
  // TORCH_HCA_CUDA_STAGING=host: stage in host shared memory even where the
  // GPUs could map each other's memory (one rank saying so is enough).
  bool host_staging = false;
};

// Nothing touches the GPU until the first collective, which chooses and sets
// up the staging on the collective's device (every rank takes part).
std::unique_ptr<Executor> make_cuda_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                             CudaConfig config);

}  // namespace hca::cuda
