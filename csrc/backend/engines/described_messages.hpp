// Messages through gloo, each after a description of its tensor. gloo trusts a
// receive to expect what was sent: a smaller receiving tensor aborts the
// process from gloo's own thread, a larger one or another dtype is filled in
// part without an error. So the sender first sends the tensor's dtype, element
// count and the message's number among its messages to that peer with that
// tag, then the bytes; the receiver posts the bytes' receive only once the
// description has come: into the caller's tensor where it fits, else into a
// scratch tensor of what was sent (the sender completes), and the receive then
// raises ValueError naming both, as hca's own mailbox does. Descriptions travel on
// tags of their own (the tag plus 2^30), so any number of receives may be posted
// from one sender and tag (a tag gloo carries lies in [0, 2^30)). The bytes' receives
// from one sender and tag are posted in the order of its messages (their
// numbers), whatever order their descriptions' waiters wake in.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <map>
#include <memory>
#include <mutex>

namespace hca {

class DescribedMessages {
 public:
  // `rank`: this rank in the engines' group (the Works' rank).
  explicit DescribedMessages(int rank);
  // Sends `tensor` (a dense CPU tensor) through `engine` to `peer`.
  c10::intrusive_ptr<c10d::Work> send(c10d::Backend& engine, const at::Tensor& tensor, int peer, int tag);
  // Receives into `tensor` (a dense CPU tensor) from `peer` (-1: any source). A thread of
  // its own waits for the description: a receive waits apart from the group's queue and
  // from the other receives, whose senders may wait for this one.
  c10::intrusive_ptr<c10d::Work> recv(c10d::Backend& engine, const at::Tensor& tensor, int peer, int tag);

 private:
  struct Order;  // what each (peer, tag) pair has sent, and which received bytes are posted
  int rank_;
  std::shared_ptr<Order> order_;
};

}  // namespace hca
