// Groups from where the ranks run. Each rank reports its place: for each level
// of the machine, coarsest first (CPU packages, then NUMA nodes; or GPU link
// domains), the set of domains its devices lie in. Ranks that share a domain
// form a group; where the places do not partition the ranks, TF's halves stay.
#pragma once
#include <string>
#include <vector>

#include "groups.h"

namespace hca {

using DomainSet = std::vector<int>;    // domain ids; empty: unknown
using Place = std::vector<DomainSet>;  // one set per level, coarsest first

struct Hierarchy {
  Groups groups;
  int level = -1;      // the level the groups follow; -1: TF's halves
  std::string reason;  // why, in words: which ranks share what, or why nothing was found
};

// `level_names` name the levels in words (e.g. "CPU package", "NUMA node").
// The groups of the coarsest level at which every rank's set is known, any two
// sets are equal or disjoint, and there are at least two distinct sets;
// default_groups(world) with the reason when no level qualifies.
Hierarchy groups_from_places(const std::vector<Place>& places, const std::vector<std::string>& level_names);

// Devices (at most 64) split into cliques of `linked`, where a link counts only
// if both ends report it: the largest clique first, then the largest of the
// rest, and so on. On a DGX-1's NVLink cube mesh this gives its two quads,
// whatever the devices' order. Returns a clique id per device.
std::vector<int> link_cliques(const std::vector<std::vector<bool>>& linked);

}  // namespace hca
