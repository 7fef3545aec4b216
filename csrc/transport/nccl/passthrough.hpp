// The `nccl` algorithm: torch_hca's packing in front of an existing engine
// (ProcessGroupNCCL for CUDA tensors, ProcessGroupGloo for CPU tensors). The
// packs are concatenated here, all-reduced by the engine, and copied back.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

#include "../../plan/packing.h"

namespace hca::nccl {

// The elements of `pack` as one dense tensor: a view where the pack is one run
// of one tensor (results land in place), else a concatenated copy.
at::Tensor packed(const std::vector<at::Tensor>& tensors, const Pack& pack);
// Copies `flat` (from packed) back into the tensors, where it is a copy.
void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, const Pack& pack);

// What an engine runs for `op`: AVG as SUM (gloo has no AVG, and the seeds
// divide once after the sum anyway); the caller divides once, at the end.
c10d::ReduceOp engine_op(const c10d::ReduceOp& op);
// Whether the engine of `tensors` averages them itself: NCCL, for floating CUDA tensors.
bool engine_averages(const std::vector<at::Tensor>& tensors);

// One packed allreduce, issued to the engine on construction (so engine calls
// keep the caller's order); finish() orders the current stream after it (NCCL's
// wait does not block the host) and writes the results back there.
class PackedAllreduce {
 public:
  // `tensors` must be contiguous. AVG the engine lacks is run as SUM and divided once here.
  PackedAllreduce(c10d::Backend& engine, std::vector<at::Tensor> tensors, std::vector<Pack> packs,
                  c10d::ReduceOp op, std::chrono::milliseconds timeout);
  void finish();
  // The packs the engine reduces: kept alive until the streams that read them have passed finish().
  const std::vector<at::Tensor>& flats() const { return flats_; }
  // Whether finish() writes into the tensors: AVG's division, or a pack concatenated from
  // several runs copied back (a pack that is one run is summed in place by the engine).
  bool writes_tensors() const;

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<Pack> packs_;
  std::vector<at::Tensor> flats_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  bool average_;
  int world_;
};

}  // namespace hca::nccl
