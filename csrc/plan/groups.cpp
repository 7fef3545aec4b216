#include "groups.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hca {

Groups default_groups(int world) {
  Groups groups;
  if (world <= 0) return groups;
  const int first = world < 4 ? world : world / 2;
  groups.emplace_back();
  for (int r = 0; r < first; ++r) groups[0].push_back(r);
  if (first < world) {
    groups.emplace_back();
    for (int r = first; r < world; ++r) groups[1].push_back(r);
  }
  return groups;
}

void validate_groups(const Groups& groups, int world) {
  std::vector<int> seen(world, 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) throw std::invalid_argument("groups: group " + std::to_string(g) + " is empty");
    for (int r : groups[g]) {
      if (r < 0 || r >= world) {
        throw std::invalid_argument("groups: rank " + std::to_string(r) + " is outside the world of " +
                                    std::to_string(world) + " ranks");
      }
      if (seen[r]++) throw std::invalid_argument("groups: rank " + std::to_string(r) + " appears in two groups");
    }
  }
  for (int r = 0; r < world; ++r) {
    if (!seen[r]) throw std::invalid_argument("groups: rank " + std::to_string(r) + " is in no group");
  }
}

Groups restrict_groups(const Groups& groups, const std::vector<int>& ranks) {
  Groups out;
  for (const auto& group : groups) {
    std::vector<int> kept;
    for (int r : group) {
      auto at = std::lower_bound(ranks.begin(), ranks.end(), r);
      if (at != ranks.end() && *at == r) kept.push_back(static_cast<int>(at - ranks.begin()));
    }
    if (!kept.empty()) out.push_back(std::move(kept));
  }
  return out;
}

int group_of(const Groups& groups, int rank) {
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int r : groups[g]) {
      if (r == rank) return static_cast<int>(g);
    }
  }
  throw std::logic_error("rank " + std::to_string(rank) + " is in no group");
}

}  // namespace hca
