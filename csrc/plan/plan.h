// The plan of one collective: its packs, and for each pack the schedule that
// any transport executes. This is the whole of "who sends what to whom".
#pragma once
#include <string>
#include <vector>

#include "groups.h"
#include "packing.h"
#include "schedule.h"
#include "types.h"

namespace hca {

// What an allreduce of some size runs where the user left the choice to hca:
// from `from_bytes` on (up to the next choice's), `algorithm` with one pack, or
// one pack per rank (every rank then leads the reduction of a part).
struct SizeChoice {
  long long from_bytes = 0;
  Algorithm algorithm = Algorithm::HierarchicalCopy;
  bool pack_per_rank = false;
};

struct PlanOptions {
  Algorithm algorithm = Algorithm::HierarchicalCopy;
  PackingOptions packing;
  int reduce_to_device = -1;  // -1: the destination of reduce, else rank 0
  Groups groups;              // empty: default_groups(world)
  // Non-empty: an allreduce's algorithm and packing follow its bytes (the first
  // choice from 0 bytes, then ascending); the other collectives keep the above.
  std::vector<SizeChoice> by_size;
};

// The options an allreduce of `tensors` on `world` ranks runs with: `options`,
// or, where they choose by size, the algorithm and packing for its bytes.
PlanOptions options_for_call(const std::vector<TensorDesc>& tensors, int world, const PlanOptions& options);

// Each throws std::invalid_argument naming the bad option: the packing alone,
// what needs no world size, and everything for a group of `world` ranks.
void validate(const PackingOptions& packing);
void validate(const PlanOptions& options);
void validate(const PlanOptions& options, int world);

struct PackPlan {
  Pack pack;
  Schedule schedule;
};

std::vector<PackPlan> plan_allreduce(const std::vector<TensorDesc>& tensors, int world, const PlanOptions& options);
std::vector<PackPlan> plan_reduce(const std::vector<TensorDesc>& tensors, int world, int root,
                                  const PlanOptions& options);
// One pack per tensor, each copied from src to all.
std::vector<PackPlan> plan_broadcast(const std::vector<TensorDesc>& tensors, int world, int src);
// Pack j is rank j's contribution, counts[j] elements (tensor j in the caller's
// numbering), broadcast from j; the world is counts.size(). The counts may differ
// from rank to rank (allgather's list form, as NCCL takes it). Empty packs are left out.
std::vector<PackPlan> plan_allgather(DType dtype, const std::vector<size_t>& counts);
// Pack j is slice j, counts[j] elements (tensor j), reduced into rank j; as above.
std::vector<PackPlan> plan_reduce_scatter(DType dtype, const std::vector<size_t>& counts, const PlanOptions& options);

// Pack j is rank j's tensor (tensor j), copied to `root`.
std::vector<PackPlan> plan_gather(const TensorDesc& each, int world, int root);
// Pack j is `root`'s tensor j, copied to rank j.
std::vector<PackPlan> plan_scatter(const TensorDesc& each, int world, int root);
// Pack i * world + j (tensor i * world + j) is what rank i sends rank j:
// counts[i * world + j] elements, copied from i to j. Empty ones are left out.
std::vector<PackPlan> plan_alltoall(DType dtype, const std::vector<size_t>& counts, int world);
// The all-to-all counts from every rank's announcement (concatenated, rank by
// rank: the counts it sends to each rank, then those it expects from each);
// throws std::invalid_argument naming the first pair of ranks that disagree.
std::vector<size_t> alltoall_counts(const std::vector<int64_t>& announced, int world);

// A readable account of an allreduce plan: packs, leaders and steps.
std::string explain(const std::vector<PackPlan>& plan);

}  // namespace hca
