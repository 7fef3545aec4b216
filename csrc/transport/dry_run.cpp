#include "dry_run.h"

#include <algorithm>
#include <memory>

#include "covered_waits.h"
#include "executor.h"
#include "round_runner.h"

namespace hca {
namespace {

// Addresses that are never touched: the runner only offsets them.
char* const kNowhere = reinterpret_cast<char*>(uintptr_t{1} << 32);

class CountingMedium final : public Medium {
 public:
  CountingMedium(int world, RingLayout ring) : ring_(ring), covered_(world) {}
  char* staging(int rank, uint64_t round) const override {
    return kNowhere + (static_cast<size_t>(rank) * ring_.slots + round % ring_.slots) * ring_.slot_bytes;
  }
  size_t slot_bytes() const override { return ring_.slot_bytes; }
  int slots() const override { return ring_.slots; }
  void copy(void*, const void*, size_t) override {}
  void reduce(DType, ReduceOp, void*, const void*, const void* const*, size_t, size_t, void*, int) override {}
  void wait(int peer, uint32_t at_least, const WaitContext&) override { covered_.needed(peer, at_least); }
  void signal(uint32_t) override {}
  uint64_t issued() const { return covered_.issued(); }

 private:
  RingLayout ring_;
  CoveredWaits covered_;
};

}  // namespace

std::vector<uint64_t> peer_waits_of_call(const std::vector<PackPlan>& plan, int world, RingLayout ring) {
  Collective collective;
  collective.plan = std::make_shared<const std::vector<PackPlan>>(plan);
  size_t tensors = 0;
  for (const auto& p : plan) {
    for (const auto& segment : p.pack.segments) tensors = std::max(tensors, segment.tensor + 1);
  }
  collective.tensors.assign(tensors, TensorSpan{kNowhere, kNowhere});
  const size_t rounds = std::max<size_t>(1, cut_rounds(plan, ring.slot_bytes).size());
  const size_t warm = (static_cast<size_t>(ring.slots) + rounds - 1) / rounds;  // every slot used once
  std::vector<uint64_t> waits;
  for (int rank = 0; rank < world; ++rank) {
    CountingMedium medium(world, ring);
    RoundRunner runner(medium, rank, world);
    // As on the group's stream, where every call goes: waits of earlier calls still cover.
    for (size_t i = 0; i < warm; ++i) runner.run(collective, WaitContext{});
    const uint64_t before = medium.issued();
    runner.run(collective, WaitContext{});
    waits.push_back(medium.issued() - before);
  }
  return waits;
}

}  // namespace hca
