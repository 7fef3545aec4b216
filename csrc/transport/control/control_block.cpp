#include "control_block.h"

#include <sched.h>
#include <unistd.h>

#include <cstring>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include "../../plan/types.h"
#include "peer_text.h"

namespace hca {
namespace {

constexpr uint64_t kMagic = 0x7463685f6863615full;  // "_ach_hct"
constexpr uint32_t kLayoutVersion = 12;

}  // namespace

ControlBlock::ControlBlock(Rendezvous& rendezvous, int rank, int world, std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), slots_offset_(round_up(sizeof(ControlHeader), kCacheLine)) {
  const size_t bytes = round_up(slots_offset_ + sizeof(RankSlot) * static_cast<size_t>(world), 4096);
  auto initialize = [&](char* base) {
    new (base) ControlHeader{kMagic, kLayoutVersion, world, sizeof(RankSlot)};
    for (int r = 0; r < world; ++r) new (base + slots_offset_ + r * sizeof(RankSlot)) RankSlot{};
  };
  segment_ = std::make_unique<SharedSegment>(rendezvous, "hca_control", rank, world, bytes,
                                             std::to_string(bytes) + " bytes", timeout,
                                             initialize,
                                             "every rank must run the same torch_hca build");
  const auto& header = *reinterpret_cast<const ControlHeader*>(segment_->data());
  if (header.magic != kMagic || header.version != kLayoutVersion || header.world != world ||
      header.slot_bytes != sizeof(RankSlot)) {
    throw std::runtime_error("hca: rank " + std::to_string(rank) + " found a control block of version " +
                             std::to_string(header.version) + " for " + std::to_string(header.world) +
                             " ranks with " + std::to_string(header.slot_bytes) + "-byte slots, expected version " +
                             std::to_string(kLayoutVersion) + " for " + std::to_string(world) + " ranks with " +
                             std::to_string(sizeof(RankSlot)) + "-byte slots: every rank must run the same build");
  }
  // The lock first: a peer that sees the pid asks the lock whether this rank lives.
  segment_->lock_byte(rank);
  slot(rank).pid_started = process_start_time(static_cast<int>(getpid()));
  slot(rank).pid = static_cast<int32_t>(getpid());
}

namespace {
constexpr uint32_t kLeftDestroyed = 1, kLeftUnasked = 2;  // RankSlot::left
}  // namespace

void ControlBlock::throw_gone(int peer, const WaitContext& ctx) const {
  const uint32_t left = slot(peer).left.load(std::memory_order_acquire);
  if (left) {
    throw Failure(FailureKind::PeerFailed, ctx.operation, peer,
                  "rank " + std::to_string(peer) + " left: " +
                      (left == kLeftDestroyed ? "its process group was shut down (destroy_process_group)"
                                              : "its process group ended without destroy_process_group (its process "
                                                "exited, e.g. on an unhandled exception or Ctrl-C, or dropped the "
                                                "group)") +
                      " while this rank still waited on it");
  }
  throw_dead(ctx, peer, slot(peer).pid);
}

void ControlBlock::mark_left(bool destroyed) {
  slot(rank_).left.store(destroyed ? kLeftDestroyed : kLeftUnasked, std::memory_order_release);
  ring();
}

void ControlBlock::ring() const {
  Doorbell& bell = slot(rank_).bell;
  // Both sides' order is sequentially consistent: a sleeper counted after this
  // load has read the new ring count (and so does not sleep), or sees its change.
  bell.rung_at.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  bell.rings.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(bell.rings);
}

std::vector<ProcessId> ControlBlock::processes() const {
  std::vector<ProcessId> out;
  for (int r = 0; r < world_; ++r) {
    if (slot(r).pid != 0) out.push_back({slot(r).pid, slot(r).pid_started});
  }
  return out;
}

void ControlBlock::signal_progress(uint32_t value) const {
  progress(rank_, ProgressWord::Host).store(value, std::memory_order_release);
  ring();
}

void ControlBlock::mark_staging_closed() { slot(rank_).staging_closed.store(1, std::memory_order_release); }

bool ControlBlock::await_peers_closed_staging() const {
  if (slot(rank_).failed.load(std::memory_order_acquire)) return false;
  const auto give_up = Clock::now() + std::chrono::seconds(5);
  for (int peer = 0; peer < world_; ++peer) {
    while (peer != rank_ && !slot(peer).staging_closed.load(std::memory_order_acquire) && alive(peer)) {
      if (Clock::now() > give_up) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return true;
}

std::string ControlBlock::why_memory_gone(int peer) const {
  const RankSlot& theirs = slot(peer);
  if (theirs.failed.load(std::memory_order_acquire)) return "failed (its process may have exited)";
  if (theirs.left.load(std::memory_order_acquire)) return "left its group (its staging was freed)";
  if (!alive(peer)) return "died";
  return "";
}

bool ControlBlock::alive(int peer) const {
  // This rank (waits for its own messages) lives; a peer not attached yet: only the deadline applies.
  return peer == rank_ || slot(peer).pid == 0 || segment_->byte_locked_elsewhere(peer);
}

namespace {

// Text from a slot, which another process wrote: bounded by the slot, and safe to show.
template <size_t N>
std::string slot_text(const char (&text)[N]) {
  return peer_text(text, N);
}

}  // namespace

RankSlot& ControlBlock::slot(int rank) const {
  return reinterpret_cast<RankSlot*>(segment_->data() + slots_offset_)[rank];
}

void ControlBlock::throw_peer_failed(int peer, const WaitContext& ctx) const {
  const RankSlot& theirs = slot(peer);
  throw Failure(FailureKind::PeerFailed, ctx.operation, peer,
                "rank " + std::to_string(peer) + " failed: " + slot_text(theirs.failure));
}

int ControlBlock::say_where_this_rank_runs() const {
  const int here = sched_getcpu();
  std::atomic<int32_t>& cpu = slot(rank_).placement.cpu;
  if (cpu.load(std::memory_order_relaxed) != here) cpu.store(here, std::memory_order_relaxed);
  return here;
}

template <class Ready>
void ControlBlock::await(int peer, Ready ready, const WaitContext& ctx) const {
  const RankSlot& theirs = slot(peer);
  RankSlot& mine = slot(rank_);
  mine.waiting_on.store(peer, std::memory_order_relaxed);
  mine.waits.fetch_add(1, std::memory_order_relaxed);
  const int here = say_where_this_rank_runs();
  // The peer said last that it ran here; it does not run while this thread does (where it moved
  // since, a yield returns at once and the wait goes on). -1: sched_getcpu failed, nothing known.
  bool peer_may_be_running = here < 0 || theirs.placement.cpu.load(std::memory_order_relaxed) != here;
  if (!peer_may_be_running && peer < rank_ &&
      shared_cpu_escape_.after_shared_wait(here, world_, rank_, [this](int r) { return cpu_said_by(r); })) {
    peer_may_be_running = say_where_this_rank_runs() != here;
  }
  try {
    // This rank's own failure ends the wait too: an abort from another thread.
    auto done = [&] {
      return ready() || theirs.failed.load(std::memory_order_acquire) || mine.failed.load(std::memory_order_acquire);
    };
    Doorbell& bell = slot(peer).bell;
    wait_for(
        done,
        [&] {
          mine.waits.fetch_add(1, std::memory_order_relaxed);
          return alive(peer);
        },
        [&] { throw_gone(peer, ctx); },
        [&](std::chrono::microseconds at_most) {
          bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
          const uint32_t seen = bell.rings.load(std::memory_order_seq_cst);
          if (!done()) futex_wait(bell.rings, seen, at_most);
          bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        },
        [&] { return Clock::time_point(Clock::duration(bell.rung_at.load(std::memory_order_relaxed))); },
        [&] { return outside_load_.busy(processes()); }, peer_may_be_running, ctx, peer);
  } catch (const Failure& failure) {
    mine.waiting_on.store(-1, std::memory_order_relaxed);
    if (failure.kind() == FailureKind::Timeout) throw_timeout_behind(peer, ctx);
    throw;
  }
  mine.waiting_on.store(-1, std::memory_order_relaxed);
  say_where_this_rank_runs();  // where it works until its next wait
  if (ready()) return;
  check_peer_failed(peer, ctx);
  check_usable(ctx.operation);
}

void ControlBlock::throw_timeout_behind(int peer, const WaitContext& ctx) const {
  if (peer == rank_) throw_timeout_on_oneself(ctx);
  // Follow who waits for whom from `peer` (the words are peers': checked) until
  // a rank that waits for nobody, for this rank, or for one already seen.
  std::vector<bool> seen(static_cast<size_t>(world_), false);
  seen[static_cast<size_t>(rank_)] = true;
  std::vector<int> chain{peer};
  for (seen[static_cast<size_t>(peer)] = true;;) {
    const int next = slot(chain.back()).waiting_on.load(std::memory_order_relaxed);
    if (next < 0 || next >= world_ || seen[static_cast<size_t>(next)]) break;
    seen[static_cast<size_t>(next)] = true;
    chain.push_back(next);
  }
  // The chain's words may be stale: its last rank may have timed out as well,
  // or a rank stopped (SIGSTOP) inside a wait still says whom it waited for.
  // The first rank that is not running is the stuck one.
  const int frozen = chain.size() > 1 ? first_not_running(chain) : -1;
  const int blamed = frozen >= 0 ? frozen : chain.back();
  if (blamed == peer) throw_timeout(ctx, peer);
  throw Failure(FailureKind::Timeout, ctx.operation, blamed,
                "Timed out after " + std::to_string(ctx.timeout.count()) + " ms waiting for rank " +
                    std::to_string(blamed) + " (this rank waits for rank " + std::to_string(peer) +
                    ", which waits for it; it never arrived, is stuck, or called a different collective)");
}

void ControlBlock::throw_timeout_on_oneself(const WaitContext& ctx) const {
  // Only a message to oneself waits for this very rank: no other rank can be blamed.
  throw Failure(FailureKind::Timeout, ctx.operation, rank_,
                "Timed out after " + std::to_string(ctx.timeout.count()) +
                    " ms waiting for a message from this rank to itself: its receive needs a send to rank " +
                    std::to_string(rank_) + " with the same tag from this rank (e.g. in the same batch_isend_irecv)");
}

int ControlBlock::first_not_running(const std::vector<int>& chain) const {
  std::vector<uint64_t> before;
  for (int r : chain) before.push_back(slot(r).waits.load(std::memory_order_relaxed));
  // Three of a waiting rank's 50 ms beats; beating too, for peers that look at this rank meanwhile.
  for (int i = 0; i < 6; ++i) {
    slot(rank_).waits.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  for (size_t i = 0; i < chain.size(); ++i) {
    const RankSlot& theirs = slot(chain[i]);
    if (theirs.waits.load(std::memory_order_relaxed) == before[i] && theirs.failed.load(std::memory_order_acquire) == 0) {
      return chain[i];
    }
  }
  return -1;
}

void ControlBlock::wait_progress(int peer, ProgressWord word, uint32_t at_least, const WaitContext& ctx) const {
  const auto& value = progress(peer, word);
  await(peer, [&] { return reached(value.load(std::memory_order_acquire), at_least); }, ctx);
}

void ControlBlock::check_peer_failed(int peer, const WaitContext& ctx) const {
  if (slot(peer).failed.load(std::memory_order_acquire)) throw_peer_failed(peer, ctx);
}

void ControlBlock::check_peer(int peer, const WaitContext& ctx) const {
  check_peer_failed(peer, ctx);
  if (!alive(peer)) throw_gone(peer, ctx);
  if (Clock::now() > ctx.deadline) {
    if (peer == rank_) throw_timeout_on_oneself(ctx);
    throw_timeout(ctx, peer);
  }
}

uint64_t ControlBlock::started_by(int peer) const { return slot(peer).started.load(std::memory_order_acquire); }

std::string ControlBlock::last_started_signature(int peer) const {
  const RankSlot& theirs = slot(peer);
  return slot_text(theirs.signature[theirs.started.load(std::memory_order_acquire) % kSignatureSlots]);
}

void ControlBlock::check_usable(const std::string& operation) const {
  const RankSlot& mine = slot(rank_);
  if (mine.failed.load(std::memory_order_acquire)) {
    throw Failure(FailureKind::Unusable, operation, -1,
                  "this process group is unusable after an earlier error: " + slot_text(mine.failure));
  }
}

WaitContext ControlBlock::begin(const std::string& signature, std::chrono::milliseconds timeout,
                                bool internal) const {
  const std::string operation =
      internal ? signature
               : "collective #" + std::to_string(collectives_ - internal_ + 1) + " " + signature;
  check_usable(operation);
  return {deadline_after(timeout), operation, timeout};
}

void ControlBlock::start(const std::string& signature, const WaitContext& ctx, bool internal) {
  post(signature, ctx, internal);
  await_posted(ctx, internal);
}

uint64_t ControlBlock::post(const std::string& signature, const WaitContext& ctx, bool internal) {
  const uint64_t n = collectives_ + 1;
  // This collective's signature slot held collective n - kSignatureSlots, which a peer may still
  // compare with its own: so first every peer has compared that one.
  if (n > kSignatureSlots) {
    const uint64_t reused = n - kSignatureSlots;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_) continue;
      const RankSlot& theirs = slot(peer);
      if (theirs.compared.load(std::memory_order_acquire) >= reused) continue;
      await(peer, [&] { return theirs.compared.load(std::memory_order_acquire) >= reused; }, ctx);
    }
  }
  collectives_ = n;
  if (internal) ++internal_;
  RankSlot& mine = slot(rank_);
  char* text = mine.signature[n % kSignatureSlots];
  std::strncpy(text, signature.c_str(), kSignatureBytes - 1);
  text[kSignatureBytes - 1] = '\0';
  mine.started.store(n, std::memory_order_release);
  ring();
  return n;
}

bool ControlBlock::all_posted() const {
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_ && started_by(peer) < collectives_) return false;
  }
  return true;
}

std::string ControlBlock::numbered(const WaitContext& ctx, bool internal) const {
  return internal ? ctx.operation : "collective #" + std::to_string(collectives_ - internal_);
}

void ControlBlock::note_compared(uint64_t n) {
  std::lock_guard<std::mutex> lock(comparing_);
  compared_early_.insert(n);
  uint64_t through = slot(rank_).compared.load(std::memory_order_relaxed);
  while (compared_early_.erase(through + 1)) ++through;
  slot(rank_).compared.store(through, std::memory_order_release);
  ring();
}

void ControlBlock::compare_with(int peer, uint64_t n, const std::string& operation) {
  const char* text = slot(rank_).signature[n % kSignatureSlots];
  const char* theirs = slot(peer).signature[n % kSignatureSlots];
  if (std::strncmp(theirs, text, kSignatureBytes) == 0) return;
  note_compared(n);
  throw Failure(FailureKind::Mismatch, operation, peer,
                kMismatchedCalls + ("rank " + std::to_string(rank_)) + " called " + slot_text(slot(rank_).signature[n % kSignatureSlots]) +
                    " but rank " + std::to_string(peer) + " called " + slot_text(slot(peer).signature[n % kSignatureSlots]));
}

void ControlBlock::await_posted(const WaitContext& ctx, bool internal) {
  const uint64_t n = collectives_;
  const std::string operation = numbered(ctx, internal);
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    const RankSlot& theirs = slot(peer);
    await(peer, [&] { return theirs.started.load(std::memory_order_acquire) >= n; }, ctx);
    compare_with(peer, n, operation);
  }
  note_compared(n);
}

int ControlBlock::census(uint64_t n, const std::string& operation) {
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_ && started_by(peer) < n) return peer;
  }
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_) compare_with(peer, n, operation);
  }
  note_compared(n);
  return -1;
}

void ControlBlock::await_post(int peer, uint64_t n, std::chrono::microseconds at_most) const {
  Doorbell& bell = slot(peer).bell;
  bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t seen = bell.rings.load(std::memory_order_seq_cst);
  if (started_by(peer) < n) futex_wait(bell.rings, seen, at_most);
  bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void ControlBlock::mark_drained_before(uint64_t n) {
  slot(rank_).drained_before.store(n, std::memory_order_release);
  ring();
}

bool ControlBlock::all_drained_before(uint64_t n) const {
  for (int peer = 0; peer < world_; ++peer) {
    const RankSlot& theirs = slot(peer);
    if (theirs.drained_before.load(std::memory_order_acquire) >= n || theirs.failed.load(std::memory_order_acquire) ||
        theirs.left.load(std::memory_order_acquire) || !alive(peer)) {
      continue;
    }
    return false;
  }
  return true;
}

void ControlBlock::monitored_barrier(std::chrono::milliseconds timeout, bool wait_all) {
  const uint64_t n = ++monitored_;
  const WaitContext ctx{deadline_after(timeout), "monitoredBarrier #" + std::to_string(n), timeout};
  const std::string ms = std::to_string(timeout.count()) + " ms";
  RankSlot& mine = slot(rank_);
  // The messages follow gloo's, which tools and torch's tests match.
  if (rank_ != 0) {
    mine.monitored.store(n, std::memory_order_release);
    ring();
    const RankSlot& root = slot(0);
    try {
      await(0, [&] { return root.monitored.load(std::memory_order_acquire) >= n; }, ctx);
    } catch (const Failure& e) {
      throw Failure(e.kind(), ctx.operation, 0,
                    "Rank " + std::to_string(rank_) + " successfully reached monitoredBarrier, but received errors "
                    "while waiting for send/recv from rank 0 (rank 0 releases the barrier): " + e.cause());
    }
    return;
  }
  if (timeout.count() <= 0) {
    throw Failure(FailureKind::Timeout, ctx.operation, 0, "Rank 0 timed out in monitoredBarrier after " + ms);
  }
  std::string missing, gone;  // gone: why waits ended before the deadline (a rank died or left)
  int first = -1, count = 0;
  FailureKind kind = FailureKind::Timeout;
  for (int peer = 1; peer < world_ && (wait_all || first < 0); ++peer) {
    const RankSlot& theirs = slot(peer);
    try {
      await(peer, [&] { return theirs.monitored.load(std::memory_order_acquire) >= n; }, ctx);
    } catch (const Failure& e) {
      missing += (count++ ? ", " : "") + std::to_string(peer);
      if (first < 0) first = peer;
      if (e.kind() != FailureKind::Timeout) {
        gone += "; " + e.cause();
        if (kind == FailureKind::Timeout) kind = e.kind();
      }
    }
  }
  if (first >= 0) {
    throw Failure(kind, ctx.operation, first,
                  (count > 1 ? "Ranks " : "Rank ") + missing + " failed to pass monitoredBarrier" +
                      (gone.empty() ? " in " + ms : gone));
  }
  mine.monitored.store(n, std::memory_order_release);
  ring();
}

void ControlBlock::scribble_for_test(uint64_t seed) {
  std::mt19937_64 rng(seed);
  RankSlot& mine = slot(rank_);
  auto text = [&](auto& to) {
    for (char& c : to) c = static_cast<char>(1 + rng() % 255);
  };
  for (auto& signature : mine.signature) text(signature);
  text(mine.failure);
  if (rng() % 2) mine.started.store(rng() % 2 ? rng() : mine.started.load() + 1 + rng() % 3);
  if (rng() % 2) mine.failed.store(static_cast<uint32_t>(rng()));
  if (rng() % 2) mine.waiting_on.store(static_cast<int32_t>(rng()));
  if (rng() % 2) mine.placement.cpu.store(static_cast<int32_t>(rng()));
  for (auto& line : mine.progress) {
    if (rng() % 2) line.value.store(static_cast<uint32_t>(rng()));
  }
}

void ControlBlock::publish_failure(const Failure& failure) {
  std::lock_guard<std::mutex> lock(publishing_);
  RankSlot& mine = slot(rank_);
  if (mine.failed.load(std::memory_order_relaxed)) return;  // the first cause only
  const std::string& cause = failure.cause();
  std::strncpy(mine.failure, cause.c_str(), kCauseBytes - 1);
  mine.failure[kCauseBytes - 1] = '\0';
  if (cause.size() >= kCauseBytes) std::memcpy(mine.failure + kCauseBytes - 4, "...", 3);  // says it was cut
  mine.failed.store(static_cast<uint32_t>(failure.kind()), std::memory_order_release);
  ring();
}

}  // namespace hca
