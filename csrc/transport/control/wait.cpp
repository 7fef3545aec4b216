#include "wait.h"

namespace hca {

void throw_timeout(const WaitContext& ctx, int peer) {
  throw Failure(FailureKind::Timeout, ctx.operation, peer,
                "Timed out after " + std::to_string(ctx.timeout.count()) + " ms waiting for rank " +
                    std::to_string(peer) + " (it never arrived, is stuck, or called a different collective)");
}

void throw_dead(const WaitContext& ctx, int peer, int pid) {
  throw Failure(FailureKind::PeerDied, ctx.operation, peer,
                "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") died during the collective");
}

}  // namespace hca
