// Schedules: for one pack, which rank reduces or copies its staged data into
// which other rank, step by step. Every rank first stages its own input
// (implicit step); then the steps run in order, the edges of one step at once.
#pragma once
#include <string>
#include <vector>

#include "groups.h"
#include "types.h"

namespace hca {

enum class EdgeKind : uint8_t { Reduce, Copy };

// Reduce: dst's data becomes dst ⊕ src. Copy: dst's data becomes src's.
struct Edge {
  EdgeKind kind;
  int src;
  int dst;
};

using Step = std::vector<Edge>;

struct Schedule {
  std::vector<Step> steps;
  // Ranks whose output must hold the result at the end.
  std::vector<int> result_ranks;
};

// Hierarchical copy for pack `pack_index`: the leader of the pack is rank
// pack_index % world; its group reduces into it, every other group into the
// member at the same position, the group leaders into the pack's leader, and
// the sum flows back along the same edges.
Schedule hierarchical_allreduce(const Groups& groups, int world, size_t pack_index);
// The reduce half of the above, rooted at `root` (its group leads).
Schedule hierarchical_reduce(const Groups& groups, int root);
// Everyone reduces into `root`, which copies the result back to everyone.
Schedule one_device_allreduce(int world, int root);
Schedule one_device_reduce(int world, int root);
// One step: every rank reduces every peer's staged data (and its own) into its
// output, in rank order, so that every rank holds the same bits.
Schedule direct_allreduce(int world);
// `src` copies its data to everyone else; every rank ends with the result
// (src's own output gets its input, for when they differ, as in allgather).
Schedule broadcast_schedule(int world, int src);

// `src`'s data lands in `dst`'s output (for src == dst: its own input).
Schedule copy_schedule(int src, int dst);

// Human-readable steps, e.g. "step 1: reduce 1->0, 3->2".
std::string steps_text(const Schedule& schedule);

}  // namespace hca
