#include "wait.h"

#include <signal.h>

#include <cerrno>
#include <fstream>

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

bool process_alive(int pid) {
  if (pid <= 0) return true;  // not attached yet: only the deadline applies
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child stays a zombie until its parent reaps it.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || (line[paren + 2] != 'Z' && line[paren + 2] != 'X');
}

}  // namespace hca
