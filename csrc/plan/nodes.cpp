#include "nodes.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>

namespace hca {
std::string ranks_text(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

namespace {

// `schedule` over a node's local ranks, renumbered to the node's global ranks.
Schedule in_global_ranks(Schedule schedule, const std::vector<int>& members) {
  for (auto& step : schedule.steps) {
    for (auto& edge : step) edge = {edge.kind, members[edge.src], members[edge.dst]};
  }
  for (int& r : schedule.result_ranks) r = members[r];
  return schedule;
}

// Indents every line of `text` (steps_text's lines) under a heading.
std::string indented(const std::string& text) {
  std::istringstream lines(text);
  std::string line, out;
  while (std::getline(lines, line)) out += "      " + line + "\n";
  return out.empty() ? "      (a node of one rank: nothing to do)\n" : out;
}

}  // namespace

int Nodes::positions() const {
  size_t most = 0;
  for (const auto& m : members) most = std::max(most, m.size());
  return static_cast<int>(most);
}

int Nodes::leader(int node, int position) const {
  const auto& m = members[node];
  return m[static_cast<size_t>(position) % m.size()];
}

std::vector<int> Nodes::leaders(int position) const {
  std::vector<int> out;
  for (int n = 0; n < count(); ++n) out.push_back(leader(n, position));
  return out;
}

Nodes group_by_node(const std::vector<std::string>& identities) {
  if (identities.empty()) throw std::invalid_argument("nodes: a group needs at least one rank");
  Nodes nodes;
  std::map<std::string, int> index;
  for (size_t r = 0; r < identities.size(); ++r) {
    if (identities[r].empty()) throw std::invalid_argument("nodes: rank " + std::to_string(r) + " has an empty node id");
    auto [it, added] = index.emplace(identities[r], nodes.count());
    if (added) nodes.members.emplace_back();
    nodes.node_of.push_back(it->second);
    nodes.local_rank.push_back(static_cast<int>(nodes.members[it->second].size()));
    nodes.members[it->second].push_back(static_cast<int>(r));
  }
  return nodes;
}

void validate_across_nodes(const PlanOptions& options, const Nodes& nodes) {
  validate(options, nodes.world());
  if (options.algorithm == Algorithm::Direct && nodes.count() > 1) {
    throw std::invalid_argument("algorithm: 'direct' reads every peer's memory, so it serves the ranks of one node; "
                                "across " + std::to_string(nodes.count()) +
                                " nodes use hierarchical_copy or reduce_to_one_device");
  }
  if (!options.groups.empty() && nodes.count() > 1) {
    throw std::invalid_argument("groups: explicit groups cannot span " + std::to_string(nodes.count()) +
                                " nodes (each node groups its own ranks by default); leave groups unset");
  }
}

int pack_position(const Nodes& nodes, const PlanOptions& options, size_t pack_index) {
  if (options.algorithm == Algorithm::ReduceToOneDevice) {
    return options.reduce_to_device < 0 ? 0 : nodes.local_rank[options.reduce_to_device];
  }
  return static_cast<int>(pack_index % static_cast<size_t>(nodes.positions()));
}

int root_position(const Nodes& nodes, int root) { return nodes.local_rank[root]; }

std::string explain_nodes(const std::vector<TensorDesc>& tensors, const Nodes& nodes, const PlanOptions& options) {
  std::ostringstream out;
  out << nodes.count() << " node(s):";
  for (int n = 0; n < nodes.count(); ++n) out << " node " << n << " = ranks " << ranks_text(nodes.members[n]) << ";";
  out << "\n";
  for (const Pack& pack : make_packs(tensors, options.packing)) {
    const int position = pack_position(nodes, options, pack.index);
    const auto leaders = nodes.leaders(position);
    out << "pack " << pack.index << " (" << pack.numel << " x " << dtype_name(pack.dtype) << "), node leaders "
        << ranks_text(leaders) << ":\n";
    for (int n = 0; n < nodes.count(); ++n) {
      const auto& members = nodes.members[n];
      const int local_leader = nodes.local_rank[leaders[n]];
      const int size = static_cast<int>(members.size());
      const Schedule inside = options.algorithm == Algorithm::ReduceToOneDevice
                                  ? one_device_reduce(size, local_leader)
                                  : hierarchical_reduce(default_groups(size), local_leader);
      out << "  node " << n << ": reduce into rank " << leaders[n] << "\n"
          << indented(steps_text(in_global_ranks(inside, members)));
    }
    if (nodes.count() > 1) {
      out << "  between nodes: all-reduce among ranks " << ranks_text(leaders) << " (inter-node group of position "
          << position << ")\n";
    }
    out << "  inside every node: each leader copies the result to its node's other ranks\n";
  }
  return out.str();
}

}  // namespace hca
