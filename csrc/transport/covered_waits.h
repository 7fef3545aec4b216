// The waits on one stream that still have to be issued: a wait for a peer's
// word to reach a value that an earlier wait on the same stream (of this
// collective or an earlier one) already covered passes at once, and on a GPU
// shared by several processes every wait issued may cost a switch between
// them. Used by the stream medium and by the dry run that counts a call's
// waits (explain).
#pragma once
#include <atomic>
#include <cstdint>
#include <vector>

#include "control/control_block.h"

namespace hca {

class CoveredWaits {
 public:
  explicit CoveredWaits(int world) : covered_(world, 0), any_(world, false) {}
  // Another stream: nothing is covered.
  void reset() { std::fill(any_.begin(), any_.end(), false); }
  // Whether a wait for `peer`'s word to reach `at_least` is still needed; if so,
  // it counts as issued from now on.
  bool needed(int peer, uint32_t at_least) {
    if (any_[peer] && reached(covered_[peer], at_least)) return false;
    covered_[peer] = at_least;
    any_[peer] = true;
    issued_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  // Waits issued on peers' words since this was made (any thread may ask).
  uint64_t issued() const { return issued_.load(std::memory_order_relaxed); }

 private:
  std::vector<uint32_t> covered_;
  std::vector<bool> any_;
  std::atomic<uint64_t> issued_{0};
};

}  // namespace hca
