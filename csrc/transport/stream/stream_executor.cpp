#include "stream_executor.h"

#include <condition_variable>
#include <deque>
#include <string>
#include <mutex>
#include <thread>
#include <vector>

#include "../covered_waits.h"
#include "../medium.h"
#include "../round_runner.h"
#include "event_pool.h"

namespace hca {
namespace {

constexpr uint32_t kPoison = 1u << 30;  // added to a word: every pending wait on it passes

// Every operation is issued on the current collective's stream.
class StreamMedium final : public Medium {
 public:
  StreamMedium(StreamDevice& device, int rank, int world, RingLayout ring)
      : device_(device), rank_(rank), ring_(ring), awaited_(world, 0), covered_(world) {}
  // Each collective's operations go on its stream. A wait issued on the same stream by an
  // earlier collective still covers (stream order); on another stream nothing is covered.
  void set_stream(StreamDevice::Stream stream) {
    if (stream != stream_) covered_.reset();
    stream_ = stream;
  }
  // The highest value issued waits expect of each peer's word.
  const std::vector<uint32_t>& awaited() const { return awaited_; }
  // Waits on peers' words issued so far.
  uint64_t peer_waits() const { return covered_.issued(); }

  char* staging(int rank, uint64_t round) const override {
    return device_.staging(rank) + (round % static_cast<uint64_t>(ring_.slots)) * ring_.slot_bytes;
  }
  size_t slot_bytes() const override { return ring_.slot_bytes; }
  int slots() const override { return ring_.slots; }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) device_.copy(stream_, dst, src, bytes);
  }
  void reduce(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t n,
              void* out, int divisor) override {
    device_.reduce(stream_, dtype, op, dst, first, srcs, nsrc, n, out, divisor);
  }
  void wait(int peer, uint32_t at_least, const WaitContext&) override {
    if (!covered_.needed(peer, at_least)) return;
    device_.wait_progress(stream_, peer, at_least);
    awaited_[peer] = at_least;
  }
  void signal(uint32_t value) override { device_.write_progress(stream_, rank_, value); }

 private:
  StreamDevice& device_;
  int rank_;
  RingLayout ring_;
  std::vector<uint32_t> awaited_;
  CoveredWaits covered_;
  StreamDevice::Stream stream_ = nullptr;
};

class StreamExecutor final : public Executor {
 public:
  StreamExecutor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous, OpenStreamDevice open)
      : control_(control), rendezvous_(std::move(rendezvous)), open_(std::move(open)) {}

  ~StreamExecutor() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    census_wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (census_thread_.joinable()) census_thread_.join();
    if (!device_) return;
    DeviceGuard guard(device_->runtime(), device_index_);
    drain();
    runner_.reset();
    medium_.reset();
    device_.reset();
  }

  // Posts the collective and issues it without waiting for the peers: the last rank to post it
  // compares the calls here; a rank that posted before a peer issues it behind a gate (its stream
  // waits for its own Agreed word), which its watchdog opens once every peer has posted the same.
  void run(const Collective& collective) override {
    const WaitContext ctx = control_.begin(collective.signature, collective.timeout, collective.internal);
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    try {
      refuse_after_mismatch(ctx);
      make_room(ctx);
      const uint64_t n = control_.post(collective.signature, ctx, collective.internal);
      bool agreed = false;
      {
        std::lock_guard<std::mutex> census(mutex_);
        census_.push_back({n, control_.numbered(ctx, collective.internal), ctx});
        advance_census();
        if (mismatch_) throw *mismatch_;  // found here: this call issued nothing
        agreed = census_.empty();
      }
      if (!agreed) census_wake_.notify_one();
      if (!device_) {
        // The first collective opens the device with the peers: agreed first, on the host.
        await_census(n, ctx);
        agreed = true;
        set_up(collective.device, ctx);
      }
      if (collective.device != device_index_) {
        throw Failure(FailureKind::Setup, ctx.operation, -1,
                      "this group's stream executor serves device " + std::to_string(device_index_) +
                          ", not device " + std::to_string(collective.device) + " (one device per rank and group)");
      }
      DeviceGuard guard(device_->runtime(), device_index_);
      if (device_->runtime().capturing(collective.stream)) {
        throw Failure(FailureKind::Setup, ctx.operation, -1, "CUDA graph capture is not supported by hca yet");
      }
      medium_->set_stream(collective.stream);
      const DeviceRuntime::Event began = recorded(collective.stream);
      try {
        if (!agreed) device_->wait_progress(collective.stream, control_.rank(), static_cast<uint32_t>(n), ProgressWord::Agreed);
        runner_->run(collective, ctx);
      } catch (...) {
        track(lock, collective.stream, ctx, collective.issued, collective.keep, medium_->awaited(), began, n);
        throw;
      }
      track(lock, collective.stream, ctx, collective.issued, collective.keep, medium_->awaited(), began, n);
    } catch (const Failure& failure) {
      if (lock.owns_lock()) lock.unlock();
      // A mismatch found before anything was issued on the device leaves the group usable (the
      // first collective's); later ones end it once the streams drained (watch()).
      if (failure.kind() == FailureKind::Mismatch) {
        lock.lock();
        if (!device_) forget_mismatch();
        throw;
      }
      lock.lock();
      if (!mismatch_ || failure.kind() != FailureKind::Unusable) fail(failure);
      throw;
    }
  }

  std::string staging() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return staging_;
  }

  size_t staging_slot_bytes() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return staging_slot_bytes_;
  }

  uint64_t peer_waits() const override {
    std::lock_guard<std::mutex> lock(mutex_);  // medium_ is made at set-up, under it
    return medium_ ? medium_->peer_waits() : 0;
  }

  void end_call(void* stream, std::shared_ptr<Issued> issued, std::shared_ptr<const void> keep) override {
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (!device_) {  // nothing was issued: every collective of the call failed before
      if (issued) issued->release("no collective of the call was issued");
      return;
    }
    DeviceGuard guard(device_->runtime(), device_index_);
    WaitContext end{Clock::time_point::max(), "the end of a call", std::chrono::milliseconds(0)};
    try {
      track(lock, stream, end, std::move(issued), std::move(keep), {}, nullptr, control_.posted());
    } catch (const Failure&) {
      // Already failed: the Work reports it through `issued`.
    }
  }

 private:
  struct Pending {
    DeviceRuntime::Event done;
    WaitContext ctx;  // the end of a call: no deadline
    std::shared_ptr<Issued> issued;
    std::shared_ptr<const void> keep;
    std::vector<uint32_t> awaited;  // what its waits expect of each peer's word; empty for a call's end
    DeviceRuntime::Event began = nullptr;  // where the stream begins the collective; null for a call's end
    uint64_t number = 0;  // the collective's number (a call's end: its last collective's)
  };

  // A collective posted, not yet compared with every peer's.
  struct Undecided {
    uint64_t number;
    std::string operation;  // what a mismatch names it
    WaitContext ctx;
  };

  EventPool& events() { return EventPool::of(device_->runtime()); }

  // An event recorded on `stream` now.
  DeviceRuntime::Event recorded(void* stream) {
    DeviceRuntime::Event event = events().take(device_index_);
    try {
      device_->runtime().record(event, stream);
    } catch (...) {
      events().give_back(device_index_, event);
      throw;
    }
    return event;
  }

  // Watches what was issued on `stream` so far, keeping `keep` alive until the
  // stream has passed it. After a failure it is released at once: the streams
  // pass their poisoned waits, and nothing confirms that it finished.
  // `began` (owned from here on): where the stream begins a collective, null for a call's end.
  void track(std::unique_lock<std::mutex>& lock, void* stream, const WaitContext& ctx, std::shared_ptr<Issued> issued,
             std::shared_ptr<const void> keep, std::vector<uint32_t> awaited, DeviceRuntime::Event began,
             uint64_t number) {
    DeviceRuntime::Event done;
    try {
      done = recorded(stream);
    } catch (...) {
      if (began) events().give_back(device_index_, began);
      throw;
    }
    lock.lock();
    pending_.push_back({done, ctx, issued, std::move(keep), std::move(awaited), began, number});
    if (failed_) {
      if (issued) issued->release(failure_->what());
      throw *failure_;
    }
  }

  // The census, in order, as far as the peers have posted (mutex_ held). Each collective every
  // peer called alike opens its gate (this rank's Agreed word); the first that differs ends it.
  void advance_census() {
    while (!census_.empty() && !mismatch_) {
      const Undecided& next = census_.front();
      try {
        if (control_.census(next.number, next.operation) >= 0) return;
      } catch (const Failure& failure) {
        mismatch_ = std::make_unique<Failure>(failure);
        mismatch_at_ = next.number;
        mismatch_operation_ = next.operation;
        mismatch_deadline_ = deadline_after(next.ctx.timeout);
        census_.clear();
        return;
      }
      control_.progress(control_.rank(), ProgressWord::Agreed).store(static_cast<uint32_t>(next.number),
                                                                       std::memory_order_release);
      census_.pop_front();
    }
  }

  // The first peer that has not posted the oldest undecided collective (-1: none undecided).
  int awaited_poster() const {
    if (census_.empty()) return -1;
    for (int peer = 0; peer < control_.world(); ++peer) {
      if (peer != control_.rank() && control_.started_by(peer) < census_.front().number) return peer;
    }
    return -1;
  }

  // Until collective `n` is compared with every peer's, on this thread (throws its mismatch,
  // a dead peer, or the timeout).
  void await_census(uint64_t n, const WaitContext& ctx) {
    while (true) {
      int peer = -1;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        advance_census();
        if (mismatch_) throw *mismatch_;
        if (census_.empty() || census_.front().number > n) return;
        peer = awaited_poster();
      }
      if (peer < 0) continue;
      control_.check_peer(peer, ctx);
      control_.await_post(peer, n, std::chrono::milliseconds(2));
    }
  }

  // Before posting: the host waits only where the census is a whole ring of signatures behind.
  void make_room(const WaitContext& ctx) {
    uint64_t oldest = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (census_.size() + 1 < kSignatureSlots) return;
      oldest = census_.front().number;
    }
    await_census(oldest, ctx);
  }

  void refuse_after_mismatch(const WaitContext& ctx) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!mismatch_) return;
    throw Failure(FailureKind::Unusable, ctx.operation, -1,
                  "this process group ends at an earlier mismatch: " + std::string(mismatch_->what()));
  }

  // A mismatch found before any rank issued on its device (the group's first collective).
  void forget_mismatch() {
    mismatch_.reset();
    census_.clear();
  }

  // After a mismatch: once this rank's stream has passed everything issued before the mismatched
  // collective, it says so; once every peer has (or the group's timeout passed), it fails the group
  // with the mismatch, releasing the calls from there on. Their peers' earlier calls may read this
  // rank's staging until they drained: only then may the kernels stop. (mutex_ held.)
  void drain_after_mismatch() {
    if (!drained_said_ && (pending_.empty() || (pending_.front().number >= mismatch_at_ &&
                                                 (!pending_.front().began || query_passed(pending_.front().began))))) {
      control_.mark_drained_before(mismatch_at_);
      drained_said_ = true;
    }
    // The deadline holds whether or not this rank drained: a stream stuck before the mismatch
    // (its peer gone, say) is released by the failure.
    if ((drained_said_ && control_.all_drained_before(mismatch_at_)) || Clock::now() > mismatch_deadline_) {
      fail(Failure(FailureKind::Mismatch, mismatch_operation_, mismatch_->peer(),
                   mismatch_->cause() + "; ranks issue ahead of each other on device streams, so the group ends at " +
                       mismatch_operation_));
    }
  }

  bool query_passed(DeviceRuntime::Event event) {
    try {
      return device_->runtime().query(event);
    } catch (const Failure&) {
      return true;  // a faulted device passes nothing more: oldest_passed() fails the group
    }
  }

  void set_up(int device_index, const WaitContext& ctx) {
    try {
      device_ = open_(*rendezvous_, device_index, ctx.timeout);
    } catch (const std::exception& e) {
      publish_setup_failure(*rendezvous_, control_.rank(), e.what());
      throw Failure(FailureKind::Setup, ctx.operation, -1, std::string("setting up its executor: ") + e.what());
    }
    device_index_ = device_index;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const RingLayout ring = device_->ring();
      staging_ = device_->staging_kind() + "; " + std::to_string(ring.slots) + " slots of " +
                 std::to_string(ring.slot_bytes) + " bytes per rank";
      staging_slot_bytes_ = ring.slot_bytes;
      medium_ = std::make_unique<StreamMedium>(*device_, control_.rank(), control_.world(), ring);
    }
    runner_ = std::make_unique<RoundRunner>(*medium_, control_.rank(), control_.world());
    watchdog_ = std::thread([this] { watch(); });
    census_thread_ = std::thread([this] { take_census(); });
  }

  // A collective that passed may have been released by a failing peer's poison
  // (published before it poisons) rather than finished: then it counts as failed.
  void confirm_finished(const Pending& p) {
    try {
      for (int peer = 0; peer < control_.world(); ++peer) {
        if (peer != control_.rank()) control_.check_peer_failed(peer, p.ctx);
      }
    } catch (const Failure& failure) {
      fail(failure);
    }
  }

  // Publishes the cause and releases every stream that waits on a progress word.
  // Callers hold mutex_. Every unfinished call is released: its Work says so in wait().
  void fail(const Failure& failure) {
    control_.publish_failure(failure);
    if (!failure_) failure_ = std::make_unique<Failure>(failure);
    failed_ = true;
    for (auto& p : pending_) {
      if (p.issued) p.issued->release(failure.what());
    }
    poison();
  }

  void poison() {
    for (int r = 0; r < control_.world(); ++r) {
      auto& word = control_.progress(r, ProgressWord::Stream);
      word.store(word.load(std::memory_order_relaxed) + kPoison, std::memory_order_release);
    }
    auto& gate = control_.progress(control_.rank(), ProgressWord::Agreed);  // a gate that never opens
    gate.store(gate.load(std::memory_order_relaxed) + kPoison, std::memory_order_release);
  }

  // Whether the stream passed the oldest pending mark. A faulted device fails
  // the group, and counts as passed: its streams run nothing more.
  bool oldest_passed() {
    try {
      return device_->runtime().query(pending_.front().done);
    } catch (const Failure& fault) {
      if (!failed_) fail(Failure(FailureKind::DeviceFault, pending_.front().ctx.operation, -1, fault.cause()));
      return true;
    }
  }

  // Pops what the stream has passed (settling the calls that end there); for
  // the oldest unfinished collective, checks peers and its deadline.
  void watch() {
    DeviceGuard guard(device_->runtime(), device_index_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(2));
      std::vector<std::shared_ptr<const void>> finished;
      while (!pending_.empty() && oldest_passed()) finished.push_back(pop_finished());
      if (!finished.empty()) {
        // A tensor's last reference may run Python (a hook, a storage's deleter)
        // that waits for the GIL: never under the lock every call issues through.
        lock.unlock();
        finished.clear();
        lock.lock();
      }
      if (stop_) continue;
      if (failed_) {
        poison();  // a live peer may have overwritten a poisoned word with a smaller value
        continue;
      }
      if (mismatch_) {
        drain_after_mismatch();
        continue;
      }
      if (pending_.empty()) continue;
      const Pending& oldest = pending_.front();
      if (oldest.awaited.empty()) continue;  // a call's end waits on this rank's own stream only
      try {
        check_peers(oldest);
      } catch (const Failure& failure) {
        fail(failure);
      }
    }
  }

  // The census of collectives this rank ran ahead into, on a thread of its own: the watchdog may
  // wait for Python (a tensor's finalizer) that waits for a later call of the group.
  void take_census() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      advance_census();
      if (census_.empty() || mismatch_) {
        census_wake_.wait(lock);
        continue;
      }
      // -1: the last poster came after advance_census() looked; it looks again at once.
      const int poster = awaited_poster();
      if (poster < 0) continue;
      // Asleep on the doorbell of the peer the census waits for: it rings when it posts.
      const uint64_t n = census_.front().number;
      lock.unlock();
      control_.await_post(poster, n, std::chrono::milliseconds(2));
      lock.lock();
    }
  }

  // Pops the oldest pending mark; returns what it kept alive, for the caller to
  // let go of outside the lock.
  std::shared_ptr<const void> pop_finished() {
    Pending& p = pending_.front();
    if (!failed_) {
      if (!p.awaited.empty()) confirm_finished(p);
      if (!failed_ && p.awaited.empty() && p.issued) p.issued->settle();
    }
    events().give_back(device_index_, p.done);
    if (p.began) events().give_back(device_index_, p.began);
    std::shared_ptr<const void> kept = std::move(p.keep);
    pending_.pop_front();
    return kept;
  }

  // Throws what keeps `oldest` from finishing: a dead or failed peer, or its
  // deadline. Then it blames this rank if its stream never began the collective
  // (its peers then wait for it), else, of the peers whose words are behind what its waits
  // expect, the one furthest behind: peers blocked by a stuck rank get as far as
  // they can without it, so the stuck rank is the one that progressed least.
  void check_peers(const Pending& oldest) const {
    control_.check_usable(oldest.ctx.operation);  // failed elsewhere, e.g. aborted
    WaitContext no_deadline = oldest.ctx;
    no_deadline.deadline = Clock::time_point::max();
    for (int peer = 0; peer < control_.world(); ++peer) {
      if (peer == control_.rank()) continue;
      // A peer that gave all this collective waits for may leave (or exit) meanwhile.
      const uint32_t word = control_.progress(peer, ProgressWord::Stream).load(std::memory_order_acquire);
      if (reached(word, oldest.awaited[peer])) {
        control_.check_peer_failed(peer, no_deadline);
      } else {
        control_.check_peer(peer, no_deadline);
      }
    }
    if (Clock::now() <= oldest.ctx.deadline) return;
    if (oldest.began && !device_->runtime().query(oldest.began)) {
      throw Failure(FailureKind::Timeout, oldest.ctx.operation, -1,
                    "Timed out after " + std::to_string(oldest.ctx.timeout.count()) + " ms: rank " +
                        std::to_string(control_.rank()) +
                        "'s stream had not begun the collective, which waits for the caller's current stream to "
                        "reach the call (a kernel still running there, or another group's call waited for on it, "
                        "as when threads that drive groups of their own share the default stream)");
    }
    // A peer that never posted a collective up to this one (never called it): its peers wait at the gate.
    if (!census_.empty() && census_.front().number <= oldest.number) {
      const int poster = awaited_poster();
      if (poster >= 0) throw_timeout(oldest.ctx, poster);
    }
    int behind = -1;
    uint32_t least = 0;
    for (int peer = 0; peer < control_.world(); ++peer) {
      const uint32_t word = control_.progress(peer, ProgressWord::Stream).load(std::memory_order_acquire);
      if (peer == control_.rank() || reached(word, oldest.awaited[peer])) continue;
      if (behind < 0 || !reached(word, least)) {
        behind = peer;
        least = word;
      }
    }
    if (behind >= 0) throw_timeout(oldest.ctx, behind);
    throw Failure(FailureKind::Timeout, oldest.ctx.operation, -1,
                  "Timed out after " + std::to_string(oldest.ctx.timeout.count()) +
                      " ms: this rank's stream did not finish the collective, though every peer got as far as "
                      "it waits for (work queued before it on the stream?)");
  }

  // Waits until the streams have passed everything issued (failing the group
  // after the timeout, which releases them), then lets go of what it kept alive.
  void drain() {
    const auto give_up = Clock::now() + std::chrono::seconds(30);
    while (!pending_.empty()) {
      if (oldest_passed()) {
        pop_finished();
        continue;
      }
      // A rank that failed (aborted) releases its streams at once; else they get 30 s.
      const bool failed_before = control_.failure_word(control_.rank()).load(std::memory_order_acquire) != 0;
      if (failed_before || Clock::now() > give_up) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!failed_) {
          const std::string& operation = pending_.front().ctx.operation;
          Failure cause(FailureKind::Timeout, operation, -1,
                        "the group was destroyed with collectives still running 30 s later");
          try {
            control_.check_usable(operation);
          } catch (const Failure& own) {
            cause = own;  // the rank failed (aborted): its calls are released with that cause
          }
          fail(cause);
        }
        poison();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  ControlBlock& control_;
  std::shared_ptr<Rendezvous> rendezvous_;
  OpenStreamDevice open_;
  int device_index_ = -1;
  std::unique_ptr<StreamDevice> device_;
  std::unique_ptr<StreamMedium> medium_;
  std::unique_ptr<RoundRunner> runner_;
  mutable std::mutex mutex_;
  std::string staging_;  // set once the device is open
  size_t staging_slot_bytes_ = 0;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::deque<Undecided> census_;
  // The first mismatch the census found (it ends the group once the streams drained), at which collective.
  std::unique_ptr<Failure> mismatch_;
  uint64_t mismatch_at_ = 0;
  std::string mismatch_operation_;
  Clock::time_point mismatch_deadline_;
  bool drained_said_ = false;
  bool stop_ = false;
  bool failed_ = false;
  std::unique_ptr<Failure> failure_;
  std::thread watchdog_;
  std::condition_variable census_wake_;  // a collective became undecided, or stop_
  std::thread census_thread_;
};

}  // namespace

std::unique_ptr<Executor> make_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                               OpenStreamDevice open) {
  return std::make_unique<StreamExecutor>(control, std::move(rendezvous), std::move(open));
}

}  // namespace hca
