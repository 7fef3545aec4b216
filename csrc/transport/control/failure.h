// Why a collective failed, as a type: waiters read a peer's kind and cause from
// the control block instead of parsing message text.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace hca {

// How a Mismatch failure's cause begins; the rest names the ranks and what each called.
inline constexpr char kMismatchedCalls[] = "mismatched calls: ";

enum class FailureKind : uint32_t {
  None = 0,
  Timeout,     // a peer did not arrive or progress before the deadline
  PeerDied,    // a peer's process is gone
  PeerFailed,  // a peer gave up and published its cause
  Mismatch,    // ranks called different collectives
  Unusable,    // an earlier failure broke this group
  Setup,       // a medium could not be set up (e.g. CUDA IPC)
  BetweenNodes,  // the stage between nodes (an engine among node leaders) failed
  DeviceFault,   // the device faulted while running the collective (e.g. a CUDA error)
  Aborted,       // the rank aborted its group
};

class Failure : public std::runtime_error {
 public:
  // what() is "hca <operation>: <cause>"; `cause` alone is what peers are told.
  Failure(FailureKind kind, const std::string& operation, int peer, std::string cause)
      : std::runtime_error("hca " + operation + ": " + cause), kind_(kind), peer_(peer), cause_(std::move(cause)) {}
  FailureKind kind() const { return kind_; }
  int peer() const { return peer_; }  // the rank blamed, -1 if none
  const std::string& cause() const { return cause_; }

 private:
  FailureKind kind_;
  int peer_;
  std::string cause_;
};

}  // namespace hca
