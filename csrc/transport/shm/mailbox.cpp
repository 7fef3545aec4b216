#include "mailbox.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <iterator>
#include <random>
#include <stdexcept>

#include <unistd.h>

#include "../control/wait.h"

namespace hca::shm {
namespace {

constexpr uint32_t kFrameMagic = 0x70326870;  // "ph2p"
constexpr auto kCheckEvery = std::chrono::milliseconds(20);
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 40;  // what a frame may claim
// Early messages held by all of this process's groups together, at most: a
// process's memory stays bounded however many groups it has (DeviceMesh makes several).
constexpr size_t kStashBytes = 32u << 20;
std::atomic<size_t> stashed_in_process{0};

// Takes `bytes` of the process's budget if they fit.
bool reserve_stash_bytes(size_t bytes) {
  size_t held = stashed_in_process.load();
  do {
    if (bytes > kStashBytes - std::min(kStashBytes, held)) return false;
  } while (!stashed_in_process.compare_exchange_weak(held, held + bytes));
  return true;
}

struct Frame {
  uint32_t magic;
  int32_t tag;
  uint32_t dtype;
  uint32_t reserved;
  uint64_t bytes;
};

struct alignas(kCacheLine) Counter {
  std::atomic<uint64_t> bytes;
};

std::string describe(const Message& m, bool is_send) {
  std::string peer = m.peer < 0 ? std::string("any rank") : "rank " + std::to_string(m.peer);
  return std::string(is_send ? "send to " : "recv from ") + peer + " (tag " + std::to_string(m.tag) + ", " +
         std::to_string(m.bytes / element_size(m.dtype)) + " x " + dtype_name(m.dtype) + ")";
}

// Whether a receive takes frames from `src` (of some tag).
bool listens_to(const Message& m, int src) { return m.peer < 0 || m.peer == src; }

// Whether a receive takes a frame from `src` with `tag`.
bool wants(const Message& m, int src, int tag) { return listens_to(m, src) && m.tag == tag; }

// Throws Failure naming `src` unless what it wrote into its frame could be ours.
void check_frame(const Frame& frame, int src) {
  const bool known = frame.dtype <= static_cast<uint32_t>(kLastDType);
  const char* wrong = frame.magic != kFrameMagic                               ? "a corrupt message"
                      : !known                                                 ? "a message of an unknown dtype"
                      : frame.bytes > kMaxMessageBytes                         ? "a message larger than 1 TiB"
                      : frame.bytes % element_size(static_cast<DType>(frame.dtype)) ? "a message of a partial element"
                                                                                     : nullptr;
  if (wrong) {
    throw Failure(FailureKind::Mismatch, "recv from rank " + std::to_string(src), src,
                  std::string(wrong) + " arrived from rank " + std::to_string(src) +
                      " (its memory is corrupt, or it runs another torch_hca build)");
  }
}

// Throws Failure naming `peer` if the counters of a channel cannot be right:
// more bytes in flight than the ring holds (a peer wrote a wrong count).
void check_in_flight(uint64_t written, uint64_t read, size_t ring_bytes, int peer, const char* which) {
  if (written - read > ring_bytes) {
    throw Failure(FailureKind::Mismatch, "point-to-point with rank " + std::to_string(peer), peer,
                  std::string("the channel ") + which + " rank " + std::to_string(peer) + " says " +
                      std::to_string(written - read) + " bytes are in flight in a ring of " +
                      std::to_string(ring_bytes) + " (its memory is corrupt)");
  }
}

// Null if the frame fits the receive, else std::invalid_argument saying why not.
std::exception_ptr misfit(const Frame& frame, const Message& m, int src) {
  const auto dtype = static_cast<DType>(frame.dtype);
  if (frame.bytes == m.bytes && dtype == m.dtype) return nullptr;
  return std::make_exception_ptr(std::invalid_argument(
      "rank " + std::to_string(src) + " sent " + std::to_string(frame.bytes / element_size(dtype)) + " x " +
      dtype_name(dtype) + " with tag " + std::to_string(frame.tag) + ", but this recv expects " +
      std::to_string(m.bytes / element_size(m.dtype)) + " x " + dtype_name(m.dtype)));
}

void ring_write(char* ring, size_t ring_bytes, uint64_t at, const char* from, size_t n) {
  const size_t pos = at % ring_bytes, first = std::min(n, ring_bytes - pos);
  std::memcpy(ring + pos, from, first);
  std::memcpy(ring, from + first, n - first);
}

void ring_read(const char* ring, size_t ring_bytes, uint64_t at, char* to, size_t n) {
  if (!to) return;
  const size_t pos = at % ring_bytes, first = std::min(n, ring_bytes - pos);
  std::memcpy(to, ring + pos, first);
  std::memcpy(to + first, ring, n - first);
}

}  // namespace

struct Mailbox::Channel {
  Counter written;  // by the sender
  Counter read;     // by the receiver
};

struct Mailbox::Pending {
  Message message;
  bool is_send;
  std::string operation;
  Clock::time_point deadline;
  Frame frame{};     // a send's frame
  size_t sent = 0;   // a send's frame and payload bytes written so far
};

// A frame's bytes count against the process's budget until its buffer is freed
// (made in place by make_shared only: a moved-from Stash would give them back twice).
struct Mailbox::Stash {
  Stash(int src, const Frame& frame, std::unique_ptr<char[]> data)
      : src(src), frame(frame), data(std::move(data)) {}
  Stash(const Stash&) = delete;
  Stash& operator=(const Stash&) = delete;
  ~Stash() { stashed_in_process.fetch_sub(frame.bytes); }

  int src;
  Frame frame;
  std::unique_ptr<char[]> data;
  bool complete = false;
  std::shared_ptr<Pending> claimed;  // the receive it belongs to, once posted
};

// Kept by the sends' callbacks, which may run after the mailbox is gone.
struct Mailbox::SendCount {
  std::mutex mutex;
  std::condition_variable none_left;
  size_t count = 0;
};

struct Mailbox::Incoming {
  Frame frame{};
  size_t frame_got = 0, payload_got = 0;
  bool parked = false;  // no receive wants it yet, and it is too big to stash: left in the ring
  char* dest = nullptr;  // where the payload goes; null: discarded
  std::shared_ptr<Pending> target;
  std::shared_ptr<Stash> stash;
};

Mailbox::Mailbox(ControlBlock& control, Rendezvous& rendezvous, size_t ring_bytes, std::chrono::milliseconds timeout)
    : control_(control),
      rank_(control.rank()),
      world_(control.world()),
      ring_bytes_(ring_bytes),
      progress_(Progress::of_process()),
      unsent_(std::make_shared<SendCount>()),
      outgoing_(control.world()),
      incoming_(control.world()) {
  static_assert(sizeof(Channel) == 2 * kCacheLine, "a channel's counters fill two lines");
  const size_t channels = static_cast<size_t>(world_) * static_cast<size_t>(world_);
  // The counters first, on pages of their own, reserved at init; then the rings, each reserved
  // by the first of its two ranks to touch it: a pair that never talks costs no /dev/shm.
  rings_at_ = round_up(channels * sizeof(Channel), static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  ring_reserved_ = std::make_unique<std::atomic<bool>[]>(channels);
  segment_ = std::make_unique<SharedSegment>(
      rendezvous, "hca_p2p", rank_, world_, rings_at_ + channels * ring_bytes_,
      std::to_string(channels) + " channels of " + std::to_string(ring_bytes_) + " bytes, reserved when first used",
      timeout,
      [&](char* base) {
        for (size_t c = 0; c < channels; ++c) new (base + c * sizeof(Channel)) Channel{};
      },
      "every rank must run the same torch_hca build", 0, rings_at_);
}

size_t Mailbox::ring_bytes_for(int world) {
  constexpr size_t kMost = 64u << 10, kLeast = 4u << 10, kAllRings = 16u << 20;
  const size_t channels = static_cast<size_t>(world) * static_cast<size_t>(world);
  const size_t fits = kAllRings / std::max<size_t>(channels, 1) / kLeast * kLeast;  // whole pages
  return std::clamp(fits, kLeast, kMost);
}

size_t stashed_bytes_in_process() { return stashed_in_process.load(); }

Mailbox::~Mailbox() {
  progress_.leave(*this);
  // No pass touches it any more: what is pending fails here, and what was
  // posted since the last pass with it.
  fail_everything(destroyed());
  for (auto& p : inbox_) complete(p, p->message.peer, destroyed());
  std::vector<Completion> failed;
  take_completed(failed);
  for (Completion& completion : failed) completion();
}

std::exception_ptr Mailbox::destroyed() {
  return std::make_exception_ptr(
      Failure(FailureKind::Unusable, "point-to-point", -1, "the process group was destroyed first"));
}

size_t Mailbox::channel_index(int src, int dst) const {
  return static_cast<size_t>(src) * static_cast<size_t>(world_) + static_cast<size_t>(dst);
}

Mailbox::Channel& Mailbox::channel(int src, int dst) const {
  return *reinterpret_cast<Channel*>(segment_->data() + channel_index(src, dst) * sizeof(Channel));
}

char* Mailbox::ring(int src, int dst) {
  const size_t index = channel_index(src, dst), at = rings_at_ + index * ring_bytes_;
  if (!ring_reserved_[index].load(std::memory_order_acquire)) {  // fallocate again is harmless
    segment_->reserve(at, ring_bytes_,
                      "the point-to-point ring from rank " + std::to_string(src) + " to rank " + std::to_string(dst));
    ring_reserved_[index].store(true, std::memory_order_release);
  }
  return segment_->data() + at;
}

size_t Mailbox::reserved_bytes() const { return segment_->reserved_bytes(); }

void Mailbox::scribble_for_test(uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    Channel& out = channel(rank_, peer);
    const uint64_t written = out.written.bytes.load();
    Frame frame{rng() % 4 ? kFrameMagic : static_cast<uint32_t>(rng()), static_cast<int32_t>(rng() % 3),
                static_cast<uint32_t>(rng() % 12), 0, rng() % 3 ? rng() % 4096 : rng()};
    char* ring = this->ring(rank_, peer);
    ring_write(ring, ring_bytes_, written, reinterpret_cast<const char*>(&frame), sizeof(frame));
    for (size_t i = sizeof(frame); i < 256; ++i) ring[(written + i) % ring_bytes_] = static_cast<char>(rng());
    const uint64_t claims[] = {written + sizeof(frame), written + 1 + rng() % 256, rng(), written - 1 - rng() % 64};
    out.written.bytes.store(claims[rng() % 4]);
    Channel& in = channel(peer, rank_);
    if (rng() % 2) in.read.bytes.store(rng() % 2 ? rng() : in.read.bytes.load() + ring_bytes_ + 1 + rng() % 64);
  }
}

void Mailbox::send(Message message) {
  auto p = std::make_shared<Pending>();
  p->is_send = true;
  p->frame = {kFrameMagic, message.tag, static_cast<uint32_t>(message.dtype), 0, message.bytes};
  p->message = std::move(message);
  p->message.done = [unsent = unsent_, done = std::move(p->message.done)](int peer, std::exception_ptr error) {
    if (done) done(peer, std::move(error));
    std::lock_guard<std::mutex> lock(unsent->mutex);
    if (--unsent->count == 0) unsent->none_left.notify_all();
  };
  {
    std::lock_guard<std::mutex> lock(unsent_->mutex);
    ++unsent_->count;
  }
  post(std::move(p));
}

void Mailbox::finish_sends() {
  Progress::before_blocking();
  std::unique_lock<std::mutex> lock(unsent_->mutex);
  unsent_->none_left.wait(lock, [&] { return unsent_->count == 0; });
}

void Mailbox::recv(Message message) {
  auto p = std::make_shared<Pending>();
  p->is_send = false;
  p->message = std::move(message);
  post(std::move(p));
}

void Mailbox::post(std::shared_ptr<Pending> p) {
  p->operation = describe(p->message, p->is_send);
  p->deadline = deadline_after(p->message.timeout);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inbox_.push_back(std::move(p));
  }
  progress_.posted(*this);
}

void Mailbox::complete(const std::shared_ptr<Pending>& p, int peer, std::exception_ptr error) {
  completed_.push_back({std::move(p->message.done), peer, std::move(error)});
}

void Mailbox::take_completed(std::vector<Completion>& into) {
  std::move(completed_.begin(), completed_.end(), std::back_inserter(into));
  completed_.clear();
}

void Mailbox::accept(std::shared_ptr<Pending> p) {
  if (broken_) return complete(p, p->message.peer, broken_);
  if (p->is_send) return outgoing_[p->message.peer].push_back(std::move(p));
  for (auto it = stashed_.begin(); it != stashed_.end(); ++it) {
    if (!wants(p->message, (*it)->src, (*it)->frame.tag)) continue;
    auto found = std::move(*it);
    stashed_.erase(it);
    if (found->complete) return deliver(*found, p);
    found->claimed = std::move(p);  // delivered when its last byte arrives
    return;
  }
  if (!take_parked(p)) posted_.push_back(std::move(p));
}

bool Mailbox::take_parked(const std::shared_ptr<Pending>& p) {
  for (int src = 0; src < world_; ++src) {
    Incoming& in = incoming_[src];
    if (!in.parked || !listens_to(p->message, src)) continue;
    in.parked = false;
    if (!wants(p->message, src, in.frame.tag)) {
      stash(src, false);  // whatever its size: a frame behind it may be the one this receive wants
      continue;
    }
    if (auto error = misfit(in.frame, p->message, src)) {
      complete(p, src, error);  // the payload is drained and dropped
    } else {
      in.dest = static_cast<char*>(p->message.data);
      in.target = p;
    }
    return true;
  }
  return false;
}

void Mailbox::stash(int src, bool reserved) {
  Incoming& in = incoming_[src];
  if (!reserved) stashed_in_process.fetch_add(in.frame.bytes);
  in.stash = std::make_shared<Stash>(src, in.frame, std::unique_ptr<char[]>(new char[in.frame.bytes]));
  in.dest = in.stash->data.get();
  stashed_.push_back(in.stash);
}

bool Mailbox::pump_send(int dst) {
  auto& queue = outgoing_[dst];
  if (queue.empty()) return false;
  Channel& ch = channel(rank_, dst);
  uint64_t written = ch.written.bytes.load(std::memory_order_relaxed);
  bool moved = false;
  while (!queue.empty()) {
    Pending& p = *queue.front();
    if (p.sent == 0 && p.message.ready && !p.message.ready()) return moved;
    const size_t total = sizeof(Frame) + p.message.bytes;
    while (p.sent < total) {
      const uint64_t read = ch.read.bytes.load(std::memory_order_acquire);
      check_in_flight(written, read, ring_bytes_, dst, "to");
      const size_t space = ring_bytes_ - static_cast<size_t>(written - read);
      if (space == 0) return moved;
      const bool in_frame = p.sent < sizeof(Frame);
      const char* from = in_frame ? reinterpret_cast<const char*>(&p.frame) + p.sent
                                  : static_cast<const char*>(p.message.data) + (p.sent - sizeof(Frame));
      const size_t n = std::min(space, in_frame ? sizeof(Frame) - p.sent : total - p.sent);
      ring_write(ring(rank_, dst), ring_bytes_, written, from, n);
      written += n;
      p.sent += n;
      ch.written.bytes.store(written, std::memory_order_release);
      moved = true;
    }
    complete(queue.front(), dst, nullptr);
    queue.pop_front();
  }
  return moved;
}

bool Mailbox::pump_recv(int src) {
  Channel& ch = channel(src, rank_);
  uint64_t read = ch.read.bytes.load(std::memory_order_relaxed);
  bool moved = false;
  for (uint64_t written = ch.written.bytes.load(std::memory_order_acquire); written != read;
       written = ch.written.bytes.load(std::memory_order_acquire)) {
    Incoming& in = incoming_[src];
    if (in.parked) break;
    check_in_flight(written, read, ring_bytes_, src, "from");
    const size_t available = static_cast<size_t>(written - read);
    if (in.frame_got < sizeof(Frame)) {
      const size_t n = std::min(available, sizeof(Frame) - in.frame_got);
      ring_read(ring(src, rank_), ring_bytes_, read, reinterpret_cast<char*>(&in.frame) + in.frame_got, n);
      in.frame_got += n;
      read += n;
      if (in.frame_got == sizeof(Frame)) on_frame(src);
    } else {
      const size_t n = std::min<size_t>(available, in.frame.bytes - in.payload_got);
      ring_read(ring(src, rank_), ring_bytes_, read, in.dest ? in.dest + in.payload_got : nullptr, n);
      in.payload_got += n;
      read += n;
    }
    if (in.frame_got == sizeof(Frame) && in.payload_got == in.frame.bytes) finish_frame(src);
    ch.read.bytes.store(read, std::memory_order_release);
    moved = true;
  }
  return moved;
}

void Mailbox::on_frame(int src) {
  Incoming& in = incoming_[src];
  check_frame(in.frame, src);
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (!wants((*it)->message, src, in.frame.tag)) continue;
    auto p = std::move(*it);
    posted_.erase(it);
    if (auto error = misfit(in.frame, p->message, src)) return complete(p, src, error);
    in.dest = static_cast<char*>(p->message.data);
    in.target = std::move(p);
    return;
  }
  // Nobody waits for it yet: kept aside if it fits what early messages may
  // hold, else left in the ring, unless a posted receive listens to `src` for
  // another tag: its frame may come behind this one.
  if (reserve_stash_bytes(in.frame.bytes)) return stash(src, true);
  const bool listened = std::any_of(posted_.begin(), posted_.end(),
                                    [src](const std::shared_ptr<Pending>& p) { return listens_to(p->message, src); });
  if (listened) return stash(src, false);
  in.parked = true;
}

void Mailbox::finish_frame(int src) {
  Incoming in = std::move(incoming_[src]);
  incoming_[src] = Incoming{};
  if (in.target) complete(in.target, src, nullptr);
  if (!in.stash) return;
  in.stash->complete = true;
  if (auto p = std::move(in.stash->claimed)) deliver(*in.stash, p);
}

void Mailbox::deliver(const Stash& stash, const std::shared_ptr<Pending>& p) {
  if (auto error = misfit(stash.frame, p->message, stash.src)) return complete(p, stash.src, error);
  std::memcpy(p->message.data, stash.data.get(), stash.frame.bytes);
  complete(p, stash.src, nullptr);
}

void Mailbox::check_deadlines() {
  const auto now = Clock::now();
  auto check = [&](const Pending& p, int peer) {
    const WaitContext ctx{p.deadline, p.operation, p.message.timeout};
    if (peer >= 0) return control_.check_peer(peer, ctx);
    const WaitContext liveness{Clock::time_point::max(), p.operation, p.message.timeout};
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) control_.check_peer(r, liveness);
    }
    if (now > p.deadline) {
      throw Failure(FailureKind::Timeout, p.operation, -1,
                    "Timed out after " + std::to_string(p.message.timeout.count()) +
                        " ms: no rank sent a message with this tag");
    }
  };
  for (int r = 0; r < world_; ++r) {
    for (const auto& p : outgoing_[r]) check(*p, r);
    if (incoming_[r].target) check(*incoming_[r].target, r);
    if (incoming_[r].stash && incoming_[r].stash->claimed) check(*incoming_[r].stash->claimed, r);
  }
  for (const auto& p : posted_) check(*p, p->message.peer);
}

bool Mailbox::busy() const {
  if (!posted_.empty()) return true;
  for (int r = 0; r < world_; ++r) {
    if (!outgoing_[r].empty() || incoming_[r].frame_got > 0) return true;
  }
  return false;
}

void Mailbox::fail_everything(const std::exception_ptr& error) {
  broken_ = error;
  for (int r = 0; r < world_; ++r) {
    for (auto& p : outgoing_[r]) complete(p, r, error);
    outgoing_[r].clear();
    if (incoming_[r].target) complete(incoming_[r].target, r, error);
    if (incoming_[r].stash && incoming_[r].stash->claimed) complete(incoming_[r].stash->claimed, r, error);
    incoming_[r] = Incoming{};
  }
  for (auto& p : posted_) complete(p, p->message.peer, error);
  posted_.clear();
  stashed_.clear();
}

bool Mailbox::step(Clock::time_point now) {
  std::vector<std::shared_ptr<Pending>> arrived;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    arrived.swap(inbox_);
  }
  const bool accepted = !arrived.empty();
  for (auto& p : arrived) accept(std::move(p));
  if (broken_) return accepted;
  bool moved = false;
  try {
    for (int peer = 0; peer < world_; ++peer) {  // this rank too: its channel to itself
      moved = pump_send(peer) || moved;
      moved = pump_recv(peer) || moved;
    }
    if (now > next_check_) {
      check_deadlines();
      next_check_ = now + kCheckEvery;
    }
  } catch (const Failure& failure) {
    control_.publish_failure(failure);
    fail_everything(std::current_exception());
  } catch (const std::exception& e) {  // e.g. no memory to keep an early message in
    const Failure failure(FailureKind::Unusable, "point-to-point", -1,
                          std::string("the point-to-point progress thread failed: ") + e.what());
    control_.publish_failure(failure);
    fail_everything(std::make_exception_ptr(failure));
  }
  return accepted || moved;
}

}  // namespace hca::shm
