// The node's control block: one shared segment per process group, holding a
// slot per rank that every executor of the node uses (shared memory and CUDA
// alike): progress words, the signature of each collective, the pid, and the
// cause of a failure. Waits on it have a deadline and notice dead peers: each
// rank holds a lock on its byte of the segment while it lives (pids are not
// comparable across pid namespaces, e.g. containers sharing /dev/shm).
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "../rendezvous.h"
#include "failure.h"
#include "outside_load.h"
#include "shared_cpu.h"
#include "segment.h"
#include "wait.h"

namespace hca {

constexpr size_t kSignatureBytes = 240;  // a collective's signature, NUL included
// A failure's cause, NUL included: room for the longest hca writes (a full /dev/shm's, with
// the numbers and the fix), so that peers report it whole.
constexpr size_t kCauseBytes = 1024;
constexpr size_t kCacheLine = 128;       // covers adjacent-line prefetch too
// Signatures a rank keeps posted: how far a rank issuing on a stream runs ahead of its
// slowest peer's census (StreamExecutor) before its host waits.
constexpr uint64_t kSignatureSlots = 32;

// One progress word per kind of executor: a shared-memory collective must not
// see the words a stream (CUDA's) is still writing for an earlier collective.
// `Agreed`: the number of the last collective whose census this rank completed with every
// peer's call the same; its own stream waits on it before a collective it ran ahead into.
enum class ProgressWord : int { Host = 0, Stream = 1, Agreed = 2 };
constexpr int kProgressWords = 3;

// Progress values are 32-bit counters compared cyclically, as CUDA stream
// memory operations compare them (wait until (int32_t)(value - at_least) >= 0).
inline bool reached(uint32_t value, uint32_t at_least) { return static_cast<int32_t>(value - at_least) >= 0; }

struct alignas(kCacheLine) ProgressLine {
  std::atomic<uint32_t> value;
};

// Rung by its rank after every change a peer may wait for (progress, a
// collective started, a barrier passed, a failure, leaving); a peer that has
// waited a while sleeps on it (a futex) instead of polling, so that it runs
// again as soon as the rank rings, not when the scheduler next looks at it:
// beside other busy processes, a poller gave its core away for a whole time slice.
struct alignas(kCacheLine) Doorbell {
  std::atomic<uint32_t> rings{0};
  std::atomic<uint32_t> sleepers{0};  // peers' threads asleep on `rings`
  std::atomic<int64_t> rung_at{0};    // steady_clock count of the last ring (one clock per machine)
};

// One writer per slot (its rank); everyone else only reads it.
struct alignas(kCacheLine) RankSlot {
  ProgressLine progress[kProgressWords];
  Doorbell bell;
  // Collectives started; the description of collective n sits in signature[n % kSignatureSlots].
  std::atomic<uint64_t> started;
  // Collectives this rank has compared with every peer's (it reads their signatures no more).
  std::atomic<uint64_t> compared;
  // After a mismatch at collective n that ends the group: n, once this rank's stream has
  // passed everything issued before it (peers may still read its staging until then).
  std::atomic<uint64_t> drained_before;
  int32_t pid;
  uint64_t pid_started;  // the process's start time (ticks since boot): tells its pid from another's
  // Set when the rank shut its group down (kLeftDestroyed, kLeftUnasked): once its lock is gone,
  // it left, not died.
  std::atomic<uint32_t> left;
  // Set once the rank has let go of its mappings of the peers' device staging.
  std::atomic<uint32_t> staging_closed;
  // The rank this one waits for now (-1: none), so that a rank timing out behind
  // a chain of waiters names the rank at its end, the one that is stuck.
  std::atomic<int32_t> waiting_on{-1};
  // Counts this rank's waits, and every 50 ms of a long one: a rank whose count
  // stands still is not running (stopped, or stuck outside any wait).
  std::atomic<uint64_t> waits{0};
  // The CPU this rank's last wait began or ended on (-1: none yet). A peer that
  // waits for this rank on the same CPU skips its spin: the rank cannot run
  // until the peer gives the CPU up (ranks outnumbering the cores, or placed
  // on one core beside busy processes). A line of its own, written only when
  // the rank moved: peers read it at every wait, and a line the rank writes
  // at every wait (`waits`) would cost each of those reads a miss.
  struct alignas(kCacheLine) {
    std::atomic<int32_t> cpu{-1};
  } placement;
  char signature[kSignatureSlots][kSignatureBytes];
  // The FailureKind of this rank's first failure (0 while healthy) and its cause.
  std::atomic<uint32_t> failed;
  char failure[kCauseBytes];
  // Monitored barriers this rank passed (rank 0: released).
  std::atomic<uint64_t> monitored;
};

struct alignas(kCacheLine) ControlHeader {
  uint64_t magic;
  uint32_t version;
  int32_t world;
  uint64_t slot_bytes;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the control block's words are shared between processes: they must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "progress words are 32-bit: CUDA stream operations address them");
static_assert(sizeof(RankSlot) % kCacheLine == 0 && alignof(RankSlot) == kCacheLine, "slots must not share lines");
static_assert(sizeof(ControlHeader) == kCacheLine, "the header fills one line");

class ControlBlock {
 public:
  // Rank 0 creates the segment and writes the header; the others attach and
  // check it (magic, layout version, world, slot size).
  ControlBlock(Rendezvous& rendezvous, int rank, int world, std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int world() const { return world_; }

  // The wait context of this rank's next collective (its number, signature and
  // deadline); throws Failure(Unusable) once this rank has failed before.
  // `internal`: one of hca's own (the self-test, a count exchange), named by its signature alone,
  // not numbered among the user's.
  WaitContext begin(const std::string& signature, std::chrono::milliseconds timeout, bool internal = false) const;
  // Posts this rank's next collective and waits until every peer has posted
  // the same: throws Failure(Mismatch) naming both calls otherwise (every rank finds
  // it at this collective, and the group can go on: post waits for late peers).
  // Every wait here also ends, with check_usable's Failure, once this rank has failed.
  void start(const std::string& signature, const WaitContext& ctx, bool internal = false);
  // start() in two halves, so that a rank can stage its own data while it waits for
  // late peers: post() says which collective this rank calls (its number, returned), once every
  // rank has compared the one that used its signature slot last (within `ctx`); await_posted()
  // waits until every peer has posted the same.
  uint64_t post(const std::string& signature, const WaitContext& ctx, bool internal = false);
  void await_posted(const WaitContext& ctx, bool internal = false);
  // The number of this rank's last posted collective.
  uint64_t posted() const { return collectives_; }
  // Whether every peer has posted this rank's last posted collective (or a later one), now.
  bool all_posted() const;
  // The census of this rank's posted collective `n`, without waiting: the first peer that has
  // not posted it yet, or -1 once every peer has posted the same (then n counts as compared);
  // throws Failure(Mismatch) naming `operation` and both calls at the first peer whose call
  // differs (n counts as compared too).
  int census(uint64_t n, const std::string& operation);
  // The name a mismatch of this rank's last posted collective gives it ("collective #k").
  std::string numbered(const WaitContext& ctx, bool internal) const;
  // Until `peer` has posted collective `n`, something else rang its doorbell, or `at_most` passed.
  void await_post(int peer, uint64_t n, std::chrono::microseconds at_most) const;
  // This rank's stream passed everything issued before collective `n` (a mismatch there ends the
  // group); and whether every peer has said so for `n` (or failed, left or died: nothing to wait for).
  void mark_drained_before(uint64_t n);
  bool all_drained_before(uint64_t n) const;

  std::atomic<uint32_t>& progress(int rank, ProgressWord word) const {
    return slot(rank).progress[static_cast<int>(word)].value;
  }
  // Sets this rank's host progress word and wakes the peers asleep on it.
  void signal_progress(uint32_t value) const;
  // Non-zero once `rank` has published a failure. A rank's streams skip their
  // data operations once its own is set (the GPU reads it in the registered block).
  const std::atomic<uint32_t>& failure_word(int rank) const { return slot(rank).failed; }
  // Until `peer`'s word reaches `at_least` (cyclically); throws Failure on
  // timeout, a dead peer, or a peer that published a failure.
  void wait_progress(int peer, ProgressWord word, uint32_t at_least, const WaitContext& ctx) const;
  // Throws the Failure a wait on `peer` would give now (dead, failed), else returns.
  void check_peer(int peer, const WaitContext& ctx) const;
  // Throws if `peer` has published a failure (only that: no liveness check).
  void check_peer_failed(int peer, const WaitContext& ctx) const;
  // How many collectives `peer` has started, and the signature of its last (for messages).
  uint64_t started_by(int peer) const;
  std::string last_started_signature(int peer) const;
  // Why memory `peer` shares from its process may be gone now ("died", "left
  // its group", "failed": about to exit), empty while it is there. For the CPU
  // model of the device, which faults where a GPU would touching such memory.
  std::string why_memory_gone(int peer) const;
  // Throws Failure(Unusable) with this rank's own cause once it has failed
  // (e.g. aborted from another thread).
  void check_usable(const std::string& operation) const;
  // torch's monitored barrier: rank 0 waits for every rank's arrival and
  // throws Failure(Timeout) naming the first rank (all, with `wait_all`) that
  // did not arrive in time; the others wait for rank 0 to release them. The
  // group stays usable: it is a diagnosis, not a collective.
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all);
  // Records this rank's first failure, so that ranks waiting on it report the cause.
  void publish_failure(const Failure& failure);
  // Says that this rank shut the group down (not a failure: what it finished
  // stays good for its peers); a peer still waiting on it is told it left, and how:
  // `destroyed` through destroy_process_group, else the group ended unasked (its process
  // exiting on an exception or Ctrl-C, or dropping the group).
  void mark_left(bool destroyed = true);
  // Device staging is freed only once no peer maps it, which the ranks say
  // here, never through the store (rank 0's store may be gone by then): this
  // rank has let go of its mappings of its peers' staging.
  void mark_staging_closed();
  // Until every peer has said so, or is gone; false if one has not within 5 s
  // (it hangs), or at once if this rank has failed (a peer may never say so).
  bool await_peers_closed_staging() const;

  // Tests: random words and text (no NUL) in this rank's slot, as a broken or
  // hostile peer would leave them; the ranks reading them must not crash.
  void scribble_for_test(uint64_t seed);
  // Tests: the CPU `rank` said last that it runs on (-1: none yet).
  int cpu_said_by(int rank) const { return slot(rank).placement.cpu.load(std::memory_order_relaxed); }

  // The mapping, for registering it with a device.
  char* data() const { return segment_->data(); }
  size_t size() const { return segment_->size(); }

 private:
  RankSlot& slot(int rank) const;
  // Whether `peer` lives: it is this rank, holds its lock, or has not attached yet.
  bool alive(int peer) const;
  // Throws that `peer` left (shut its group down) or died.
  [[noreturn]] void throw_gone(int peer, const WaitContext& ctx) const;
  // Throws the timeout of a wait on `peer`, blaming the end of the chain of
  // ranks waiting on one another that starts at `peer`.
  [[noreturn]] void throw_timeout_behind(int peer, const WaitContext& ctx) const;
  // Throws the timeout of a wait for a message to oneself, which no other rank can end.
  [[noreturn]] void throw_timeout_on_oneself(const WaitContext& ctx) const;
  // The first rank of `chain` that shows no sign of running over a short look
  // (its wait count stands still and it has not failed), or -1.
  int first_not_running(const std::vector<int>& chain) const;
  template <class Ready>
  void await(int peer, Ready ready, const WaitContext& ctx) const;
  // Wakes the peers' threads asleep on this rank's doorbell (after a change they may wait for).
  void ring() const;
  // Puts the CPU this thread runs on in this rank's slot (if it moved) and returns it.
  int say_where_this_rank_runs() const;
  // The group's ranks' processes, as their slots say.
  std::vector<ProcessId> processes() const;
  [[noreturn]] void throw_peer_failed(int peer, const WaitContext& ctx) const;
  // Collective n counts as compared: once every one before it does too, peers may reuse its slot.
  void note_compared(uint64_t n);
  // Throws Failure(Mismatch) if `peer`'s collective n differs from this rank's (noting n compared).
  void compare_with(int peer, uint64_t n, const std::string& operation);

  int rank_, world_;
  size_t slots_offset_;
  std::unique_ptr<SharedSegment> segment_;
  uint64_t collectives_ = 0;  // collectives started by this rank
  uint64_t internal_ = 0;     // of which hca's own
  uint64_t monitored_ = 0;    // monitored barriers entered by this rank
  std::mutex publishing_;     // collectives and point-to-point fail on different threads
  std::mutex comparing_;      // a census runs on the caller's thread or the executor's watchdog
  std::set<uint64_t> compared_early_;  // compared while an earlier collective was not
  mutable OutsideLoad outside_load_;  // asked after a wait's late yield
  mutable SharedCpuEscape shared_cpu_escape_;  // told of waits for a peer on the waiter's CPU
};

}  // namespace hca
