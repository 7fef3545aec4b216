#include "plan.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace hca {
namespace {

const Groups& groups_or_default(const PlanOptions& options, int world, Groups& storage) {
  if (!options.groups.empty()) return options.groups;
  storage = default_groups(world);
  return storage;
}

Schedule reduce_schedule(const PlanOptions& options, const Groups& groups, int world, int root) {
  return options.algorithm != Algorithm::HierarchicalCopy ? one_device_reduce(world, root)
                                                           : hierarchical_reduce(groups, root);
}

// Tensor `index` of the call, whole, as pack `index`.
Pack one_tensor_pack(size_t index, DType dtype, size_t numel) { return {index, dtype, numel, {{index, 0, numel}}}; }

PackPlan copy_pack(size_t index, DType dtype, size_t numel, int src, int dst) {
  return {one_tensor_pack(index, dtype, numel), copy_schedule(src, dst)};
}

}  // namespace

void validate(const PackingOptions& packing) {
  if (packing.num_packs < 0) throw std::invalid_argument("num_packs: requires num_packs >= 0");
  if (packing.agg_small_grads_max_bytes < 0) throw std::invalid_argument("agg_small_grads_max_bytes: must be >= 0");
  if (packing.agg_small_grads_max_group < 0) throw std::invalid_argument("agg_small_grads_max_group: must be >= 0");
}

void validate(const PlanOptions& options) {
  validate(options.packing);
  if (options.reduce_to_device < -1) {
    throw std::invalid_argument("reduce_to_device: must be a rank (>= 0), got " +
                                std::to_string(options.reduce_to_device));
  }
  for (const auto& group : options.groups) {
    if (group.empty()) throw std::invalid_argument("groups: every group needs at least one rank");
    for (int r : group) {
      if (r < 0) throw std::invalid_argument("groups: ranks must be >= 0, got " + std::to_string(r));
    }
  }
  for (size_t i = 0; i < options.by_size.size(); ++i) {
    const long long from = options.by_size[i].from_bytes;
    if (i == 0 ? from != 0 : from <= options.by_size[i - 1].from_bytes) {
      throw std::invalid_argument("by_size: the choices must start at 0 bytes and ascend, got " + std::to_string(from) +
                                  " bytes at choice " + std::to_string(i));
    }
  }
}

void validate(const PlanOptions& options, int world) {
  validate(options);
  if (options.reduce_to_device >= world) {
    throw std::invalid_argument("reduce_to_device: " + std::to_string(options.reduce_to_device) +
                                " is outside the group of " + std::to_string(world) + " ranks");
  }
  if (!options.groups.empty()) validate_groups(options.groups, world);
}

PlanOptions options_for_call(const std::vector<TensorDesc>& tensors, int world, const PlanOptions& options) {
  if (options.by_size.empty()) return options;
  long long bytes = 0;
  for (const auto& t : tensors) bytes += static_cast<long long>(t.numel * element_size(t.dtype));
  auto choice = options.by_size.begin();
  while (choice + 1 != options.by_size.end() && (choice + 1)->from_bytes <= bytes) ++choice;
  PlanOptions chosen = options;
  chosen.by_size.clear();
  chosen.algorithm = choice->algorithm;
  chosen.packing.num_packs = choice->pack_per_rank ? world : 1;
  return chosen;
}

std::vector<PackPlan> plan_allreduce(const std::vector<TensorDesc>& tensors, int world, const PlanOptions& given) {
  const PlanOptions options = options_for_call(tensors, world, given);
  Groups storage;
  const Groups& groups = groups_or_default(options, world, storage);
  std::vector<PackPlan> plan;
  for (auto& pack : make_packs(tensors, options.packing)) {
    // Only hierarchical copy rotates its leaders over the packs: there, packs spread the work.
    Schedule schedule = options.algorithm == Algorithm::ReduceToOneDevice
                            ? one_device_allreduce(world, std::max(options.reduce_to_device, 0))
                        : options.algorithm == Algorithm::Direct ? direct_allreduce(world)
                                                                 : hierarchical_allreduce(groups, world, pack.index);
    plan.push_back({std::move(pack), std::move(schedule)});
  }
  return plan;
}

std::vector<PackPlan> plan_reduce(const std::vector<TensorDesc>& tensors, int world, int root,
                                  const PlanOptions& options) {
  Groups storage;
  const Groups& groups = groups_or_default(options, world, storage);
  std::vector<PackPlan> plan;
  for (auto& pack : make_packs(tensors, options.packing)) {
    plan.push_back({std::move(pack), reduce_schedule(options, groups, world, root)});
  }
  return plan;
}

std::vector<PackPlan> plan_broadcast(const std::vector<TensorDesc>& tensors, int world, int src) {
  std::vector<PackPlan> plan;
  for (auto& pack : make_packs(tensors, PackingOptions{0, 0, 0})) {
    plan.push_back({std::move(pack), broadcast_schedule(world, src)});
  }
  return plan;
}

std::vector<PackPlan> plan_allgather(DType dtype, const std::vector<size_t>& counts) {
  const int world = static_cast<int>(counts.size());
  std::vector<PackPlan> plan;
  for (int j = 0; j < world; ++j) {
    if (counts[j] > 0) plan.push_back({one_tensor_pack(j, dtype, counts[j]), broadcast_schedule(world, j)});
  }
  return plan;
}

std::vector<PackPlan> plan_gather(const TensorDesc& each, int world, int root) {
  std::vector<PackPlan> plan;
  if (each.numel == 0) return plan;
  for (int j = 0; j < world; ++j) plan.push_back(copy_pack(j, each.dtype, each.numel, j, root));
  return plan;
}

std::vector<PackPlan> plan_scatter(const TensorDesc& each, int world, int root) {
  std::vector<PackPlan> plan;
  if (each.numel == 0) return plan;
  for (int j = 0; j < world; ++j) plan.push_back(copy_pack(j, each.dtype, each.numel, root, j));
  return plan;
}

std::vector<PackPlan> plan_alltoall(DType dtype, const std::vector<size_t>& counts, int world) {
  if (counts.size() != static_cast<size_t>(world) * static_cast<size_t>(world)) {
    throw std::invalid_argument("alltoall: expected world * world counts");
  }
  std::vector<PackPlan> plan;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] > 0) plan.push_back(copy_pack(p, dtype, counts[p], p / world, p % world));
  }
  return plan;
}

std::vector<size_t> alltoall_counts(const std::vector<int64_t>& announced, int world) {
  const size_t n = static_cast<size_t>(world);
  if (announced.size() != 2 * n * n) throw std::invalid_argument("alltoall: expected 2 * world counts from each rank");
  std::vector<size_t> counts(n * n);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      const int64_t sends = announced[i * 2 * n + j], expects = announced[j * 2 * n + n + i];
      if (sends != expects) {
        throw std::invalid_argument("rank " + std::to_string(i) + " sends " + std::to_string(sends) +
                                    " elements to rank " + std::to_string(j) + ", but rank " + std::to_string(j) +
                                    " expects " + std::to_string(expects) + " from rank " + std::to_string(i));
      }
      counts[i * n + j] = static_cast<size_t>(sends);
    }
  }
  return counts;
}

std::vector<PackPlan> plan_reduce_scatter(DType dtype, const std::vector<size_t>& counts, const PlanOptions& options) {
  const int world = static_cast<int>(counts.size());
  Groups storage;
  const Groups& groups = groups_or_default(options, world, storage);
  std::vector<PackPlan> plan;
  for (int j = 0; j < world; ++j) {
    if (counts[j] > 0) plan.push_back({one_tensor_pack(j, dtype, counts[j]), reduce_schedule(options, groups, world, j)});
  }
  return plan;
}

std::string explain(const std::vector<PackPlan>& plan) {
  std::ostringstream out;
  for (const auto& [pack, schedule] : plan) {
    out << "pack " << pack.index << " (" << pack.numel << " x " << dtype_name(pack.dtype) << ", tensors";
    for (const auto& seg : pack.segments) {
      out << " " << seg.tensor << "[" << seg.offset << ":" << seg.offset + seg.numel << "]";
    }
    out << ")\n" << steps_text(schedule);
  }
  return out.str();
}

}  // namespace hca
