#include "rounds.h"

#include <algorithm>
#include <sstream>
#include <utility>

namespace hca {

Role role_of(const Schedule& schedule, int rank) {
  Role role;
  role.result = std::find(schedule.result_ranks.begin(), schedule.result_ranks.end(), rank) !=
                schedule.result_ranks.end();
  int first = -1, last_out = -1;
  bool first_is_src = false, first_is_reduce = false, last_in_is_copy = false;
  for (size_t s = 0; s < schedule.steps.size(); ++s) {
    for (const Edge& e : schedule.steps[s]) {
      if (e.src != rank && e.dst != rank) continue;
      if (first < 0) first = static_cast<int>(s);
      if (first == static_cast<int>(s)) {
        first_is_src = first_is_src || e.src == rank;
        first_is_reduce = first_is_reduce || (e.dst == rank && e.kind == EdgeKind::Reduce);
      }
      if (e.src == rank) {
        last_out = static_cast<int>(s);
        role.readers.push_back(e.dst);
      }
      if (e.dst == rank) {
        role.last_in = static_cast<int>(s);
        last_in_is_copy = e.kind == EdgeKind::Copy;
      }
    }
  }
  // Data others read first must be staged; a rank that first reduces can read
  // its own input in that pass; one that first receives a Copy needs nothing.
  role.stages = first_is_src;
  if (!first_is_src && first_is_reduce) role.fused_step = first;
  role.direct = role.result && last_in_is_copy && last_out < role.last_in;
  std::sort(role.readers.begin(), role.readers.end());
  role.readers.erase(std::unique(role.readers.begin(), role.readers.end()), role.readers.end());
  return role;
}

std::vector<Role> roles_of(const std::vector<PackPlan>& plan, int rank) {
  std::vector<Role> roles;
  roles.reserve(plan.size());
  for (const auto& p : plan) roles.push_back(role_of(p.schedule, rank));
  return roles;
}

std::vector<Round> cut_rounds(const std::vector<PackPlan>& plan, size_t slot_bytes) {
  size_t total = 0;
  for (const auto& p : plan) total += round_up(p.pack.numel * element_size(p.pack.dtype), kPieceAlign);
  const size_t target_rounds = std::max<size_t>(1, (total + slot_bytes - 1) / slot_bytes);
  std::vector<size_t> piece(plan.size()), done(plan.size(), 0);
  for (size_t p = 0; p < plan.size(); ++p) {
    const size_t es = element_size(plan[p].pack.dtype);
    piece[p] = std::max<size_t>(1, std::min(slot_bytes / es, (plan[p].pack.numel + target_rounds - 1) / target_rounds));
  }
  std::vector<Round> rounds(1);
  size_t used = 0;
  for (bool more = !plan.empty(); more;) {
    more = false;
    for (size_t p = 0; p < plan.size(); ++p) {
      const size_t left = plan[p].pack.numel - done[p];
      if (left == 0) continue;
      const size_t es = element_size(plan[p].pack.dtype);
      const size_t count = std::min(piece[p], left);
      if (used + count * es > slot_bytes) {
        rounds.emplace_back();
        used = 0;
      }
      rounds.back().push_back({p, done[p], count, used});
      used = round_up(used + count * es, kPieceAlign);
      done[p] += count;
      more = more || done[p] < plan[p].pack.numel;
    }
  }
  if (rounds.back().empty()) rounds.pop_back();
  return rounds;
}

std::string roles_text(const std::vector<PackPlan>& plan, int world) {
  std::ostringstream out;
  for (int rank = 0; rank < world; ++rank) {
    out << "rank " << rank << ":";
    const char* sep = " ";
    for (size_t p = 0; p < plan.size(); ++p) {
      const Role role = role_of(plan[p].schedule, rank);
      out << sep << "pack " << plan[p].pack.index << " (";
      bool any = false;  // parts written so far, comma-separated
      const auto part = [&](const char* text) -> std::ostream& { return out << (std::exchange(any, true) ? ", " : "") << text; };
      if (role.stages) part("stages");
      if (role.fused_step >= 0) part("reads its input at step ") << role.fused_step + 1;
      if (role.result) {
        part("result");
        if (role.last_in >= 0) out << " at step " << role.last_in + 1 << (role.direct ? " (copied straight out)" : "");
        else out << " = its input";
      }
      if (!any) out << "idle";
      out << ")";
      sep = ", ";
    }
    out << "\n";
  }
  return out.str();
}

std::string rounds_text(const std::vector<Round>& rounds) {
  std::ostringstream out;
  for (size_t r = 0; r < rounds.size(); ++r) {
    out << "round " << r + 1 << ":";
    const char* sep = " ";
    for (const Piece& piece : rounds[r]) {
      out << sep << "pack " << piece.pack << " [" << piece.begin << ":" << piece.begin + piece.count << ") at byte "
          << piece.offset;
      sep = ", ";
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace hca
