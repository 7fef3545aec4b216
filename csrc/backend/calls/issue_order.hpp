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
  // The next ticket of `device` of `runtime` (any pointer that names the runtime).
  IssueTicket(const void* runtime, int device);
  // Passes the ticket if it was not: a call dropped before it issued holds no one up.
  ~IssueTicket();
  IssueTicket(const IssueTicket&) = delete;
  IssueTicket& operator=(const IssueTicket&) = delete;

  // Until every earlier ticket of the device has passed.
  void await() const;
  // This call has issued (or will not): the next ticket may go.
  void pass();

 private:
  const void* runtime_;
  int device_;
  uint64_t number_;
  bool passed_ = false;
};

}  // namespace hca
