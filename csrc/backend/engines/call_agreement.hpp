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
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
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

class ControlBlock;

// Agreements through a control block in shared memory, for a group whose ranks share a node:
// each rank posts its call's text there and waits until every peer has posted the same. That
// takes microseconds where gloo's sum takes a round of its messages (about half a millisecond
// on a 2-vCPU VM, as long as gloo's own call of a few elements), and a peer that died is named
// at once. Texts are compared whole: one too long for the block's slot as its start and a digest.
// An all-to-all's split sizes, which must pair up rather than be alike, are left to gloo.
class SharedAgreements {
 public:
  SharedAgreements(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout);
  ~SharedAgreements();
  // Raises DistBackendError naming `op` and the calls where the ranks disagree, as
  // PendingAgreement does (the group goes on), or why a peer did not agree within `timeout`
  // (late, dead, failed): the group is unusable then, and peers waiting on this rank are told.
  void agree(const std::string& text, const char* op, std::chrono::milliseconds timeout);
  // Tells peers waiting on this rank that it aborted (they raise at once), or that it left.
  void abort(int rank);
  void leave();
  // This rank's first published failure (a FailureKind; 0 while healthy).
  uint32_t failure_word(int rank) const;
  // In a process forked from the group's: the parent's block, left as it is.
  void leave_in_child();

 private:
  std::unique_ptr<ControlBlock> control_;
};

}  // namespace hca
