// Groups of ranks for hierarchical copy: every rank belongs to exactly one group.
#pragma once
#include <vector>

namespace hca {

using Groups = std::vector<std::vector<int>>;

// TF's DGX-1 rule, made whole: two halves [0, n/2) and [n/2, n). For an odd n
// the extra rank joins the second half (TF drops it). Worlds under 4 ranks form
// one group, since halves of a single rank add a step and save nothing.
Groups default_groups(int world);

// Throws std::invalid_argument (message starts with "groups:") unless `groups`
// partitions the ranks 0..world-1.
void validate_groups(const Groups& groups, int world);

// The groups of a subset of the ranks (a split): each group keeps its members
// among `ranks` (sorted, distinct), renumbered by their position there; groups
// left empty are dropped.
Groups restrict_groups(const Groups& groups, const std::vector<int>& ranks);

// Index of the group that holds `rank`; the groups must be valid.
int group_of(const Groups& groups, int rank);

}  // namespace hca
