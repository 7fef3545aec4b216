// The one thread of a process that moves the point-to-point messages of all
// its groups (DeviceMesh makes several): a group's mailbox joins it with its
// first message and leaves it when the group ends, and the thread ends with
// the last mailbox. Messages complete on it, after each pass over the
// mailboxes, so that a completion's callback (a Future's) may post new
// messages or end a group: a callback that posts, or blocks on a message,
// hands the thread's role to a new thread first, or it would wait for itself.
#pragma once
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace hca::shm {

class Mailbox;

// A message's `done` with what it is called with, run once the pass that
// finished the message is over.
struct Completion {
  std::function<void(int peer, std::exception_ptr error)> done;
  int peer;
  std::exception_ptr error;
  void operator()() {
    if (done) done(peer, std::move(error));
  }
};

class Progress {
 public:
  // This process's (a forked child gets its own: the parent's threads are not there).
  static Progress& of_process();
  // Whether the calling thread is one of the progress threads (a completion's callback).
  static bool on_progress_thread();
  // Called before the calling thread blocks until a message completes: if it
  // is the thread moving messages (a callback), a new thread takes over.
  static void before_blocking();

  // A message was posted to `mailbox`: it is moved from now on, and the thread
  // woken (started if none runs, or if the caller is it: a callback that posts).
  void posted(Mailbox& mailbox);
  // Once this returns no thread touches `mailbox`. Called off the progress
  // threads with no mailbox left, it ends and joins them.
  void leave(Mailbox& mailbox);

 private:
  Progress() = default;
  void run(uint64_t me);
  void start_runner();  // mutex_ held

  const pid_t pid_ = getpid();

  std::mutex stepping_;  // held while a pass steps the mailboxes
  std::mutex mutex_;     // guards the rest
  std::condition_variable wake_;
  std::vector<Mailbox*> members_;
  uint64_t posts_ = 0;   // messages posted so far: a change wakes the runner
  uint64_t runner_ = 0;  // the number of the thread moving messages; 0: none
  uint64_t next_number_ = 1;
  std::vector<std::pair<uint64_t, std::thread>> threads_;  // not joined yet, by number
  std::vector<uint64_t> returned_;  // numbers of threads in threads_ that have returned
};

}  // namespace hca::shm
