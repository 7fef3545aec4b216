#include "topology.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>

namespace hca {
namespace {

std::string join(const std::vector<int>& ids) {
  std::string text;
  for (int id : ids) text += (text.empty() ? "" : ",") + std::to_string(id);
  return text;
}

bool overlap(const DomainSet& a, const DomainSet& b) {
  for (int x : a) {
    if (std::find(b.begin(), b.end(), x) != b.end()) return true;
  }
  return false;
}

DomainSet sorted_unique(DomainSet set) {
  std::sort(set.begin(), set.end());
  set.erase(std::unique(set.begin(), set.end()), set.end());
  return set;
}

// The groups at `level`, or why that level gives none.
bool groups_at(const std::vector<Place>& places, size_t level, const std::string& name, Hierarchy& out) {
  const int world = static_cast<int>(places.size());
  std::vector<DomainSet> sets;
  for (int r = 0; r < world; ++r) {
    if (places[r].size() <= level || places[r][level].empty()) {
      out.reason = "rank " + std::to_string(r) + " reported no " + name;
      return false;
    }
    sets.push_back(sorted_unique(places[r][level]));
  }
  std::map<DomainSet, std::vector<int>> members;  // a domain's set -> its ranks, ascending
  for (int r = 0; r < world; ++r) {
    for (int q = 0; q < r; ++q) {
      if (sets[q] != sets[r] && overlap(sets[q], sets[r])) {
        out.reason = "rank " + std::to_string(r) + " runs on " + name + " " + join(sets[r]) + " and rank " +
                     std::to_string(q) + " on " + name + " " + join(sets[q]) + ", which overlap without being the same";
        return false;
      }
    }
    members[sets[r]].push_back(r);
  }
  if (members.size() < 2) {
    out.reason = "every rank runs on " + name + " " + join(sets[0]);
    return false;
  }
  Groups groups;
  for (const auto& [set, ranks] : members) groups.push_back(ranks);
  std::sort(groups.begin(), groups.end());  // ordered by lowest rank: the plan's rotation starts in rank 0's group
  out.groups = std::move(groups);
  out.reason.clear();
  for (const auto& group : out.groups) {
    out.reason += (out.reason.empty() ? "" : "; ") + std::string("ranks ") + join(group) + " on " + name + " " +
                  join(sets[group[0]]);
  }
  return true;
}

// The largest clique among `candidates` (Bron-Kerbosch over bit masks); among
// equals, the one whose lowest differing device comes first, so every rank,
// given the devices in the same order, picks the same.
uint64_t largest_clique(const std::vector<uint64_t>& neighbours, uint64_t candidates) {
  uint64_t best = 0;
  auto better = [](uint64_t a, uint64_t b) {
    const int ca = __builtin_popcountll(a), cb = __builtin_popcountll(b);
    if (ca != cb) return ca > cb;
    const uint64_t differ = a ^ b;
    return differ && (a & differ & -differ);  // a holds the lowest device where they differ
  };
  std::function<void(uint64_t, uint64_t, uint64_t)> extend = [&](uint64_t clique, uint64_t open, uint64_t done) {
    if (!open && !done) {
      if (better(clique, best)) best = clique;
      return;
    }
    while (open) {
      const int d = __builtin_ctzll(open);
      const uint64_t bit = uint64_t{1} << d;
      extend(clique | bit, open & neighbours[d], done & neighbours[d]);
      open &= ~bit;
      done |= bit;
    }
  };
  extend(0, candidates, 0);
  return best;
}

}  // namespace

Hierarchy groups_from_places(const std::vector<Place>& places, const std::vector<std::string>& level_names) {
  Hierarchy out;
  std::string why;
  for (size_t level = 0; level < level_names.size(); ++level) {
    Hierarchy at;
    if (groups_at(places, level, level_names[level], at)) {
      at.level = static_cast<int>(level);
      return at;
    }
    why += (why.empty() ? "" : "; ") + at.reason;
  }
  out.groups = default_groups(static_cast<int>(places.size()));
  out.reason = "TF's halves, since no level splits the ranks" + (why.empty() ? std::string() : " (" + why + ")");
  return out;
}

std::vector<int> link_cliques(const std::vector<std::vector<bool>>& linked) {
  const size_t n = linked.size();
  if (n > 64) throw std::invalid_argument("link table: at most 64 devices, got " + std::to_string(n));
  std::vector<uint64_t> neighbours(n, 0);
  for (size_t a = 0; a < n; ++a) {
    if (linked[a].size() != n) throw std::invalid_argument("link table: expected " + std::to_string(n) + " columns a row");
    for (size_t b = 0; b < n; ++b) {
      if (a != b && linked[a][b] && linked[b][a]) neighbours[a] |= uint64_t{1} << b;
    }
  }
  std::vector<int> clique_of(n, -1);
  uint64_t left = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  for (int clique = 0; left; ++clique) {
    const uint64_t best = largest_clique(neighbours, left);
    for (size_t d = 0; d < n; ++d) {
      if (best >> d & 1) clique_of[d] = clique;
    }
    left &= ~best;
  }
  return clique_of;
}

}  // namespace hca
