// Before gloo gets a collective, its ranks agree on what they call. gloo trusts
// every rank to call the same thing: where sizes or dtypes differ it aborts the
// process from its own thread (a message longer than the receiver expects), or
// writes a broadcast short without an error, or waits for a partner that never
// comes until its timeout, and the timeout closes its connections for good.
// hca's own algorithms check each call through their control block; calls that
// reach gloo (algorithm="nccl" on CPU tensors, the exchanges between nodes'
// leaders) are checked here, through the same engine, by a collective that is
// the same whatever each rank called, before the call itself. Where the ranks
// disagree every rank raises the same DistBackendError, before gloo sees the
// call, and the engine stays usable.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <string>
#include <vector>

namespace hca {

// What a collective's ranks must say alike: `text` (the op, dtypes, sizes, root,
// reduction: "broadcast(Float[10], root 0)"), and for an all-to-all the elements
// this rank sends to and receives from each rank, which must pair up.
struct CallTerms {
  std::string text;
  std::vector<int64_t> sends = {}, receives = {};
};

// An agreement on `terms` with `engine`'s other ranks, through `engine` itself
// (in the same order as the engine's other collectives, so from the thread that
// issues them): started at construction, so that it runs while the caller does
// other work; settle() waits for it, once, and raises DistBackendError naming `op`
// and the calls where the ranks disagree. `member(r)` names the engine's rank r
// in the message ("rank 1").
class PendingAgreement {
 public:
  PendingAgreement(c10d::Backend& engine, CallTerms terms, const char* op, std::function<std::string(int)> member);
  void settle();

 private:
  c10d::Backend* engine_;
  CallTerms terms_;
  const char* op_;
  std::function<std::string(int)> member_;
  uint64_t digest_ = 0;
  std::vector<at::Tensor> sum_;
  c10::intrusive_ptr<c10d::Work> work_;  // null once settled (or with one rank)
};

// Agrees on `terms` at once.
void agree_on_call(c10d::Backend& engine, CallTerms terms, const char* op, std::function<std::string(int)> member);

}  // namespace hca
