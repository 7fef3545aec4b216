#include "shm_executor.h"

#include <cstring>

#include "kernels.h"

namespace hca::shm {

HostMedium::HostMedium(ControlBlock& control, char* region, size_t slot_bytes, int slots)
    : control_(control), region_(region), slot_bytes_(slot_bytes), slots_(slots) {}

char* HostMedium::staging(int rank, uint64_t round) const {
  const size_t slot = static_cast<size_t>(rank) * slots_ + round % static_cast<uint64_t>(slots_);
  return region_ + slot * slot_bytes_;
}

void HostMedium::copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

void HostMedium::reduce(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc,
                        size_t n, void* out, int divisor) {
  reduce_into(dtype, op, dst, first, srcs, nsrc, n, out, divisor);
}

void HostMedium::wait(int peer, uint32_t at_least, const WaitContext& ctx) {
  control_.wait_progress(peer, ProgressWord::Host, at_least, ctx);
}

bool HostMedium::reached_now(int peer, uint32_t at_least) const {
  return reached(control_.progress(peer, ProgressWord::Host).load(std::memory_order_acquire), at_least);
}

void HostMedium::signal(uint32_t value) { control_.signal_progress(value); }

std::unique_ptr<SharedSegment> staging_segment(Rendezvous& rendezvous, const std::string& key, int rank, int world,
                                               size_t slot_bytes, int slots, std::chrono::milliseconds timeout) {
  const size_t bytes = product_bytes(slot_bytes, static_cast<size_t>(slots), static_cast<size_t>(world),
                                     "the staging (" + key + ": slot bytes x slots x ranks)");
  return std::make_unique<SharedSegment>(
      rendezvous, key, rank, world, bytes,
      std::to_string(slots) + " slots of " + std::to_string(slot_bytes) + " bytes per rank",
      timeout, [](char*) {},
      "TORCH_HCA_SHM_CHUNK_BYTES and TORCH_HCA_SHM_SLOTS must be the same on every rank",
      bytes / static_cast<size_t>(world));  // a rank's slots on its own NUMA node: leaders read them where they can
}

ShmExecutor::ShmExecutor(ControlBlock& control, Rendezvous& rendezvous, size_t slot_bytes, int slots,
                         std::chrono::milliseconds timeout)
    : control_(control) {
  slot_bytes = aligned_slot_bytes(slot_bytes);
  region_ = staging_segment(rendezvous, "hca_shm_staging", control.rank(), control.world(), slot_bytes, slots, timeout);
  medium_ = std::make_unique<HostMedium>(control, region_->data(), slot_bytes, slots);
  runner_ = std::make_unique<RoundRunner>(*medium_, control.rank(), control.world());
}

void ShmExecutor::run(const Collective& collective) {
  const WaitContext ctx = control_.begin(collective.signature, collective.timeout, collective.internal);
  try {
    // A rank that came early stages what it can while the others arrive: after
    // the last arrival that copy is no longer in anyone's way. Ranks that come
    // together stage round by round as before, each round read while the next is staged.
    control_.post(collective.signature, ctx, collective.internal);
    const size_t staged = runner_->stage_ahead(collective, [&] { return !control_.all_posted(); });
    control_.await_posted(ctx, collective.internal);
    runner_->run(collective, ctx, staged);
  } catch (const Failure& failure) {
    // Mismatched calls (only await_posted finds them) moved no byte, and every rank found them at
    // this collective: the group goes on.
    if (failure.kind() != FailureKind::Mismatch) control_.publish_failure(failure);
    throw;
  }
}

}  // namespace hca::shm
