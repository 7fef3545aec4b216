// The node level of the hierarchy: ranks grouped by the node they run on.
// Inside a node the schedules of schedule.h run; between nodes, for each pack,
// one rank per node (the pack's node leader) joins an all-reduce among the
// node leaders of that pack, which an existing engine carries. This file says
// who leads which pack; it knows nothing of engines or media.
#pragma once
#include <string>
#include <vector>

#include "plan.h"

namespace hca {

struct Nodes {
  // Node n's ranks, ascending; nodes are numbered in the order of their lowest rank.
  std::vector<std::vector<int>> members;
  std::vector<int> node_of;     // per rank
  std::vector<int> local_rank;  // per rank: its index in members[node_of[rank]]

  int count() const { return static_cast<int>(members.size()); }
  int world() const { return static_cast<int>(node_of.size()); }
  // Leader positions: the largest node's size. Position p's leader on node n is
  // its local rank p % size(n), so every local rank of the largest node leads.
  int positions() const;
  int leader(int node, int position) const;
  // The leaders of `position`, one per node in node order: the members of the
  // inter-node group of that position (a rank of a small node may lead several).
  std::vector<int> leaders(int position) const;
};

// "0, 2, 3": ranks as messages and explanations list them.
std::string ranks_text(const std::vector<int>& ranks);

// Groups ranks whose identities (hostname, or an override) are equal; throws
// std::invalid_argument for an empty list or an empty identity.
Nodes group_by_node(const std::vector<std::string>& identities);

// Throws std::invalid_argument naming the option that cannot span nodes:
// explicit `groups` (each node uses the default groups of its own ranks).
void validate_across_nodes(const PlanOptions& options, const Nodes& nodes);

// The leader position of a pack: hierarchical copy rotates packs over the
// positions; reduce_to_one_device keeps one, that of reduce_to_device (its
// local rank; 0 when unset), and `root` (>= 0) pins rooted collectives to the
// root's position so that the root leads its own node.
int pack_position(const Nodes& nodes, const PlanOptions& options, size_t pack_index);
int root_position(const Nodes& nodes, int root);

// A readable account of a multi-node allreduce: the nodes, then for each pack
// the reduction inside every node (in global ranks), the all-reduce between
// the pack's node leaders, and the copy back.
std::string explain_nodes(const std::vector<TensorDesc>& tensors, const Nodes& nodes, const PlanOptions& options);

}  // namespace hca
