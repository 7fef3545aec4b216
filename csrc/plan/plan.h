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

struct PlanOptions {
  Algorithm algorithm = Algorithm::HierarchicalCopy;
  PackingOptions packing;
  int reduce_to_device = -1;  // -1: the destination of reduce, else rank 0
  Groups groups;              // empty: default_groups(world)
};

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
// Pack j is rank j's contribution (tensor j in the caller's numbering), broadcast from j.
std::vector<PackPlan> plan_allgather(const TensorDesc& each, int world);
// Pack j is slice j (tensor j), reduced into rank j.
std::vector<PackPlan> plan_reduce_scatter(const TensorDesc& each, int world, const PlanOptions& options);

// A readable account of an allreduce plan: packs, leaders and steps.
std::string explain(const std::vector<PackPlan>& plan);

}  // namespace hca
