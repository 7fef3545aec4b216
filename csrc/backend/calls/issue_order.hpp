// The order in which the calls of all of a process's groups put their work on
// a device: the order the calls were made in. A GPU runs streams on a few
// hardware queues, each in issue order (CUDA_DEVICE_MAX_CONNECTIONS, 8 by
// default; Megatron-LM sets 1), and a stream executor's collective waits there
// for its peers' progress. Each group issues on a worker thread of its own: had
// two groups' calls reached the device as their workers got to them, ranks
// could queue them in different orders, each rank's first call then held up
// behind a call that waits for the other rank's. A call takes a ticket when it
// is made and issues once every earlier ticket of its device has.
#pragma once
#include <cstdint>

namespace hca {

class IssueTicket {
 public:
  // The next ticket of `device` of `runtime` (any pointer that names the runtime);
  // on a thread inside a turn of that device (Held), a share of that turn instead.
  IssueTicket(const void* runtime, int device);
  // Passes the ticket if it was not: a call dropped before it issued holds no one up.
  ~IssueTicket();
  IssueTicket(const IssueTicket&) = delete;
  IssueTicket& operator=(const IssueTicket&) = delete;

  // Until every earlier ticket of the device has passed.
  void await() const;
  // This call has issued (or will not). The turn ends once every share of it
  // has passed: the next ticket may go.
  void pass();

  // While it lives, the calls this thread makes on the ticket's device issue in
  // the ticket's turn, which lasts until they have: the stages a call runs as
  // calls of its own (a group across nodes: its node's group, the engines among
  // leaders), which would otherwise take tickets after calls made since, when
  // the worker gets to them. From after await() until pass().
  class Held {
   public:
    explicit Held(const IssueTicket* ticket);  // null: holds nothing
    ~Held();
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;

   private:
    const IssueTicket* outer_;
  };

 private:
  const void* runtime_;
  int device_;
  uint64_t number_;
  bool passed_ = false;
};

}  // namespace hca
