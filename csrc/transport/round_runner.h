// Executes plans round by round over any Medium. Each rank stages its data in
// its own slot; a Reduce or Copy edge src->dst is carried out by dst, which
// reads src's slot once src's progress word says the step is done. A slot is
// reused only after the peers that read it in the round that last filled it
// have moved past that round: a peer that never reads it is never waited for.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "../plan/rounds.h"
#include "executor.h"
#include "medium.h"

namespace hca {

// The progress value that says "round r, `steps_done` steps done" (1 = staged).
// 32 bits wrap after 2^28 rounds, which the cyclic compare tolerates.
inline uint32_t progress_value(uint64_t round, size_t steps_done) {
  return static_cast<uint32_t>((round << 4) | steps_done);
}
constexpr size_t kMaxSteps = 14;  // steps_done + 1 must fit the 4 low bits

class RoundRunner {
 public:
  RoundRunner(Medium& medium, int rank, int world);
  // Stages the first rounds of `collective`, one by one while `waiting()` says
  // the peers are not all there yet and every peer has let go of the round's
  // slot already (never waits); returns how many, for run().
  size_t stage_ahead(const Collective& collective, const std::function<bool()>& waiting);
  // Issues every round of `collective` on the medium, in order; the first
  // `staged` were staged by stage_ahead.
  void run(const Collective& collective, const WaitContext& ctx, size_t staged = 0);

 private:
  struct RoundState;
  void read_plan(const Collective& collective);
  // The progress value each peer reaches once done with this rank's slot for
  // `round` (0: the slot was never used), which reuse_slot waits for and
  // slot_free_now looks at.
  uint32_t slot_released_at(uint64_t round) const;
  // The peers that read this rank's slot for `round` in the round that last filled it.
  const std::vector<int>& slot_readers(uint64_t round) const;
  // `round` is the `index`-th of the plan's rounds: its readers fill its slot.
  void note_readers(uint64_t round, size_t index);
  void reuse_slot(uint64_t round, const WaitContext& ctx);
  bool slot_free_now(uint64_t round) const;
  void stage_inputs(const RoundState& state);
  void run_step(const RoundState& state, size_t step, const WaitContext& ctx);
  void reduce_beside_readers(const RoundState& state, const Piece& piece, bool final_step);
  void finish_round(const RoundState& state);

  Medium& medium_;
  int rank_, world_;
  uint64_t rounds_ = 0;  // data rounds issued by this rank, over all collectives
  // The last plan's roles and rounds: a repeated (cached) plan is read once.
  std::shared_ptr<const std::vector<PackPlan>> read_plan_;
  std::vector<Role> roles_;
  std::vector<Round> cut_;
  std::vector<std::vector<int>> round_readers_;  // per round of cut_: who reads this rank's slot, ascending
  std::vector<const void*> sources_, at_span_;
  std::vector<int> source_ranks_;  // whose slots sources_ point into, in the same order
  // Per slot of the ring: the round that last filled it and who read it then.
  std::vector<uint64_t> slot_round_;
  std::vector<std::vector<int>> slot_readers_;
  std::vector<int> every_peer_;
};

}  // namespace hca
