// Reading a plan as one rank executes it: its role in each pack's schedule, and
// the rounds that cut the packs into pieces fitting one staging slot. Every
// executor (shared memory, CUDA) runs the same roles and rounds.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "plan.h"

namespace hca {

// What one rank does for one pack, derived from the pack's schedule.
struct Role {
  bool stages = false;   // copies its input into its staging slot before step 0 (others read it)
  int fused_step = -1;   // instead, its first Reduce reads its input directly, in that step
  bool result = false;   // its output must end with the result
  int last_in = -1;      // the step of its last incoming edge: it writes its output then
  bool direct = false;   // that last edge is a Copy that lands straight in the output
  std::vector<int> readers;  // the ranks that read its slot (its edges' destinations), ascending
};

Role role_of(const Schedule& schedule, int rank);
std::vector<Role> roles_of(const std::vector<PackPlan>& plan, int rank);

// A slice [begin, begin + count) of pack `pack` (elements), staged at byte
// `offset` of every rank's slot during one round.
struct Piece {
  size_t pack, begin, count, offset;
};
using Round = std::vector<Piece>;

// Pieces start on this boundary inside a slot (vector loads, no false sharing).
constexpr size_t kPieceAlign = 64;

// The slot size a medium allocates for a requested one: at least 4 KiB, and a
// multiple of kPieceAlign so that every slot of a ring starts aligned too.
inline size_t aligned_slot_bytes(size_t requested) {
  const size_t bytes = requested < 4096 ? 4096 : requested;
  return (bytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
}

// Cuts the packs into rounds whose pieces fit `slot_bytes`. Every pack gets a
// piece in each round where it can, so the packs' leaders work side by side.
std::vector<Round> cut_rounds(const std::vector<PackPlan>& plan, size_t slot_bytes);

// "rank 2: pack 0 stages, reduces its input at step 1, result at step 3 ..." and
// "round 1: pack 0 [0:1000) at 0, ..." lines.
std::string roles_text(const std::vector<PackPlan>& plan, int world);
std::string rounds_text(const std::vector<Round>& rounds);

}  // namespace hca
