// Executes plans over POSIX shared memory between the ranks of one node.
// Each rank stages its data in its own buffer; a Reduce or Copy edge src->dst
// is carried out by dst, which reads src's buffer once src has published that
// the data is ready. Nothing else moves: the edges are the data path.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "../../plan/plan.h"
#include "../rendezvous.h"
#include "control.h"
#include "segment.h"
#include "wait.h"

namespace hca::shm {

// Where tensor t of a plan's segments is read from (in) and written to (out).
struct TensorSpan {
  const void* in;
  void* out;
};

struct Collective {
  const std::vector<PackPlan>* plan;
  std::vector<TensorSpan> tensors;
  ReduceOp op = ReduceOp::Sum;
  // Every rank must pass the same text: a mismatch is reported, not executed.
  std::string signature;
  std::chrono::milliseconds timeout{0};
};

class Transport {
 public:
  Transport(Rendezvous& rendezvous, int rank, int world, size_t chunk_bytes, std::chrono::milliseconds timeout);

  // Runs one collective to completion. Throws std::runtime_error (timeout, dead
  // peer, mismatched call); once it has thrown, every later call throws too.
  void run(const Collective& collective);

  int rank() const { return rank_; }
  int world() const { return world_; }

  // A slice [begin, begin + count) of one pack, staged at `offset` of each
  // rank's buffer half during one round.
  struct Piece {
    size_t pack, begin, count, offset;
  };
  // What this rank does for one pack, derived from the pack's schedule.
  struct Role {
    bool stages = false;   // copies its input into its buffer before step 0
    int fused_step = -1;   // instead, its first Reduce reads the input directly
    bool result = false;   // its output must end with the result
    int last_in = -1;      // the step of its last incoming edge: it writes its output then
    bool direct = false;   // that last edge is a Copy that lands straight in the output
  };

 private:
  void start(const Collective& collective, const WaitContext& ctx);
  void run_round(const Collective& collective, const std::vector<Piece>& round, const std::vector<Role>& roles,
                 const WaitContext& ctx);
  void wait_progress(int peer, uint64_t at_least, const WaitContext& ctx);
  // Waits until ready() or the peer reports a failure (then throws its reason).
  template <class Ready>
  void await(int peer, Ready ready, const WaitContext& ctx);
  char* buffer(int rank, uint64_t round) const;
  RankSlot& slot(int rank) const;

  int rank_, world_;
  Layout layout_;
  std::unique_ptr<SharedSegment> segment_;
  uint64_t collectives_ = 0;  // collectives started by this rank
  uint64_t rounds_ = 0;       // data rounds run by this rank, over all collectives
  std::string broken_;        // first error; non-empty means unusable
};

}  // namespace hca::shm
