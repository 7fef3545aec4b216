// The operations a medium offers the round runner: staging slots, data
// movement and reduction, and progress words to wait on and to signal. The
// shared-memory medium does each at once on the host; the CUDA medium issues
// each on a stream, in order, so that no host thread waits for the GPU.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../plan/types.h"
#include "control/wait.h"

namespace hca {

class Medium {
 public:
  virtual ~Medium() = default;
  // Rank `rank`'s staging slot for `round` (a ring of slots() slots of slot_bytes()).
  virtual char* staging(int rank, uint64_t round) const = 0;
  virtual size_t slot_bytes() const = 0;
  virtual int slots() const = 0;

  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // dst[i] = (first[i] ⊕ srcs[0][i] ⊕ ...) / divisor for n elements (first may
  // be dst), one rounding per element for fp16/bf16, after the divide; if `out`
  // is given, out[i] = the same.
  virtual void reduce(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc,
                      size_t n, void* out, int divisor) = 0;

  // Until `peer`'s progress word reaches `at_least` (cyclic compare); `ctx`
  // bounds host waits (a stream's waits are bounded by its executor's watchdog).
  virtual void wait(int peer, uint32_t at_least, const WaitContext& ctx) = 0;
  // Whether `peer`'s progress word has reached `at_least`, known now without
  // waiting (false where the medium cannot tell: a stream's words live on its device).
  virtual bool reached_now(int peer, uint32_t at_least) const { return false; }
  // This rank's progress word becomes `value`, after everything issued before.
  virtual void signal(uint32_t value) = 0;
};

}  // namespace hca
