// Point-to-point messages between the ranks of one node over shared memory.
// Every ordered pair of ranks has a channel: a byte ring written by the sender
// and drained by the receiver, each side publishing a running byte count. A
// rank's channel to itself carries its messages to itself (NCCL takes those,
// e.g. an all-to-all's own block in a batch_isend_irecv). A
// message is a frame (tag, dtype, size) followed by its bytes, streamed through
// the ring, so a message may be larger than the ring.
//
// The process's progress thread (progress.h), one for all its groups, moves
// every send and receive at once (isend/irecv and batch_isend_irecv in any
// order the two sides agree on).
// Frames are matched to receives by (source, tag) in arrival order; a frame
// nobody waits for yet is drained into a private buffer while those hold less
// than kStashBytes (32 MiB, for all of a process's groups together), so small
// sends need not wait for the receiver to post; a
// larger one stays in the ring (its sender waits, as with gloo's rendezvous)
// until a receive from that rank is posted: if that receive (or one posted
// before the frame came) wants a later frame, the big one is stashed after all
// (the program's order needs it).
// Sends and receives are independent of the
// collective queue, as in gloo.
#pragma once
#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../control/control_block.h"
#include "../control/segment.h"
#include "../rendezvous.h"
#include "progress.h"
#include "../../plan/types.h"

namespace hca::shm {

struct Message {
  int peer;  // destination of a send; source of a receive, -1 for any source
  int tag;
  DType dtype;
  void* data;  // read by a send, written by a receive
  size_t bytes;
  std::chrono::milliseconds timeout;
  // Called once, on a progress thread, with the peer that sent or received it
  // and the error if any: std::invalid_argument for a frame that does not fit
  // the receive (the channel stays usable), hca::Failure otherwise (the group
  // is unusable afterwards, as after a failed collective).
  std::function<void(int peer, std::exception_ptr error)> done;
  // A send's bytes may be read once this answers true (asked by the progress
  // thread; null: at once), e.g. once a device has copied them to `data`. The
  // sends behind it to the same rank wait too, so a pair's order holds. A
  // hca::Failure it throws fails the group, as the channel's own failures do.
  std::function<bool()> ready;
};

// Bytes of early messages this process holds now, over all its groups (tests).
size_t stashed_bytes_in_process();

class Mailbox {
 public:
  // A channel's ring for a group of `world` ranks: 64 KiB up to 16 ranks, then
  // smaller (down to 4 KiB), so that the world² rings together take at most
  // 16 MiB of /dev/shm; messages larger than a ring stream through it.
  static size_t ring_bytes_for(int world);
  // Every rank of the group constructs it at init (the channels are one segment,
  // whose rings take /dev/shm only once their pair of ranks talks).
  Mailbox(ControlBlock& control, Rendezvous& rendezvous, size_t ring_bytes, std::chrono::milliseconds timeout);
  // Fails what is still pending ("the process group was destroyed"), on the
  // calling thread; a progress thread's callback may destroy it.
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  void send(Message message);
  void recv(Message message);
  // Returns once every send posted so far has finished: sent, or failed (its
  // deadline and the peers' liveness bound the wait). A group that shuts down
  // gracefully delivers what it was asked to send, even if nobody waited on it
  // (even from a completion's callback: another thread moves them meanwhile).
  void finish_sends();

  // Tests: what a broken or hostile peer could write into its side of every
  // channel (counters, frames, bytes); the peers reading them must not crash.
  void scribble_for_test(uint64_t seed);

  // Bytes of /dev/shm the group's channels hold now (tests).
  size_t reserved_bytes() const;

 private:
  friend class Progress;
  struct Channel;
  struct Pending;
  struct Stash;
  struct Incoming;
  struct SendCount;

  // The progress thread's pass: takes what was posted, moves bytes, checks
  // deadlines; whether anything moved. What finished waits in completed_.
  bool step(Clock::time_point now);
  void take_completed(std::vector<Completion>& into);

  void post(std::shared_ptr<Pending> pending);
  void accept(std::shared_ptr<Pending> pending);
  bool pump_send(int dst);
  bool pump_recv(int src);
  void on_frame(int src);
  void finish_frame(int src);
  // Gives a frame parked in the ring to receive `pending` if it wants it (else
  // stashes the parked frames it could take from, to reach those behind them).
  bool take_parked(const std::shared_ptr<Pending>& pending);
  // Keeps the incoming frame from `src` in a buffer of its own until a receive
  // takes it; its bytes count against the process's budget (`reserved`: already).
  void stash(int src, bool reserved);
  // Completes receive `pending` with a stashed frame that has fully arrived.
  void deliver(const Stash& stash, const std::shared_ptr<Pending>& pending);
  void check_deadlines();
  bool busy() const;  // anything of ours, or a frame, in flight
  // Queues the message's `done` for after the pass.
  void complete(const std::shared_ptr<Pending>& pending, int peer, std::exception_ptr error);
  void fail_everything(const std::exception_ptr& error);
  static std::exception_ptr destroyed();  // what pending messages get at destruction
  size_t channel_index(int src, int dst) const;
  Channel& channel(int src, int dst) const;
  // The ring of channel src -> dst, reserved in /dev/shm by the first use in this
  // process (the progress thread's, or a test's scribbling before it starts).
  char* ring(int src, int dst);

  ControlBlock& control_;
  int rank_, world_;
  size_t ring_bytes_;
  size_t rings_at_;  // the rings' offset in the segment, past the counters' pages
  std::unique_ptr<std::atomic<bool>[]> ring_reserved_;  // per channel, by this process
  std::unique_ptr<SharedSegment> segment_;

  Progress& progress_;
  std::shared_ptr<SendCount> unsent_;  // sends posted and not finished (their callbacks count down)
  std::mutex mutex_;  // guards inbox_; the rest belongs to the progress thread's pass
  std::vector<std::shared_ptr<Pending>> inbox_;
  Clock::time_point next_check_{};  // of deadlines and peers' liveness
  std::vector<Completion> completed_;

  std::vector<std::deque<std::shared_ptr<Pending>>> outgoing_;  // sends in order, per destination
  std::vector<Incoming> incoming_;  // per source
  std::vector<std::shared_ptr<Pending>> posted_;  // receives not matched yet, in posting order
  std::vector<std::shared_ptr<Stash>> stashed_;   // frames nobody waited for, in arrival order
  std::exception_ptr broken_;  // once set, every message fails with it
};

}  // namespace hca::shm
