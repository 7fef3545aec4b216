#include "schedule.h"

#include <sstream>

namespace hca {
namespace {

void add_step(Schedule& schedule, Step step) {
  if (!step.empty()) schedule.steps.push_back(std::move(step));
}

std::vector<int> all_ranks(int world) {
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  return ranks;
}

// The leader of every group when `root` leads its own group: the others take
// the member at root's position in its group (wrapping in smaller groups).
std::vector<int> group_leaders(const Groups& groups, int root) {
  const int home = group_of(groups, root);
  size_t position = 0;
  while (groups[home][position] != root) ++position;
  std::vector<int> leaders;
  for (size_t g = 0; g < groups.size(); ++g) {
    leaders.push_back(static_cast<int>(g) == home ? root : groups[g][position % groups[g].size()]);
  }
  return leaders;
}

// Steps 1 and 2: members into their leader, leaders into root.
void add_reduce_up(Schedule& schedule, const Groups& groups, const std::vector<int>& leaders, int root) {
  Step members, across;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int r : groups[g]) {
      if (r != leaders[g]) members.push_back({EdgeKind::Reduce, r, leaders[g]});
    }
    if (leaders[g] != root) across.push_back({EdgeKind::Reduce, leaders[g], root});
  }
  add_step(schedule, std::move(members));
  add_step(schedule, std::move(across));
}

}  // namespace

Schedule hierarchical_reduce(const Groups& groups, int root) {
  Schedule schedule;
  add_reduce_up(schedule, groups, group_leaders(groups, root), root);
  schedule.result_ranks = {root};
  return schedule;
}

Schedule hierarchical_allreduce(const Groups& groups, int world, size_t pack_index) {
  const int root = static_cast<int>(pack_index % static_cast<size_t>(world));
  const auto leaders = group_leaders(groups, root);
  Schedule schedule;
  add_reduce_up(schedule, groups, leaders, root);
  Step across, members;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (leaders[g] != root) across.push_back({EdgeKind::Copy, root, leaders[g]});
    for (int r : groups[g]) {
      if (r != leaders[g]) members.push_back({EdgeKind::Copy, leaders[g], r});
    }
  }
  add_step(schedule, std::move(across));
  add_step(schedule, std::move(members));
  schedule.result_ranks = all_ranks(world);
  return schedule;
}

Schedule one_device_reduce(int world, int root) {
  Schedule schedule;
  Step gather;
  for (int r = 0; r < world; ++r) {
    if (r != root) gather.push_back({EdgeKind::Reduce, r, root});
  }
  add_step(schedule, std::move(gather));
  schedule.result_ranks = {root};
  return schedule;
}

Schedule one_device_allreduce(int world, int root) {
  Schedule schedule = one_device_reduce(world, root);
  Schedule back = broadcast_schedule(world, root);
  for (auto& step : back.steps) add_step(schedule, std::move(step));
  schedule.result_ranks = all_ranks(world);
  return schedule;
}

Schedule direct_allreduce(int world) {
  Schedule schedule;
  Step all;
  for (int dst = 0; dst < world; ++dst) {
    for (int src = 0; src < world; ++src) {
      if (src != dst) all.push_back({EdgeKind::Reduce, src, dst});
    }
  }
  add_step(schedule, std::move(all));
  schedule.result_ranks = all_ranks(world);
  return schedule;
}

Schedule broadcast_schedule(int world, int src) {
  Schedule schedule;
  Step fan_out;
  for (int r = 0; r < world; ++r) {
    if (r != src) fan_out.push_back({EdgeKind::Copy, src, r});
  }
  add_step(schedule, std::move(fan_out));
  schedule.result_ranks = all_ranks(world);
  return schedule;
}

Schedule copy_schedule(int src, int dst) {
  Schedule schedule;
  if (src != dst) add_step(schedule, {{EdgeKind::Copy, src, dst}});
  schedule.result_ranks = {dst};
  return schedule;
}

std::string steps_text(const Schedule& schedule) {
  std::ostringstream out;
  for (size_t s = 0; s < schedule.steps.size(); ++s) {
    out << "step " << s + 1 << ":";
    const char* sep = " ";
    for (const Edge& e : schedule.steps[s]) {
      out << sep << (e.kind == EdgeKind::Reduce ? "reduce " : "copy ") << e.src << "->" << e.dst;
      sep = ", ";
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace hca
