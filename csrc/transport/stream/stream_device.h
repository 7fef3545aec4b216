// What a stream executor needs from a device: every rank's staging ring, and
// operations issued on a stream that run later, in issue order. CUDA streams
// are one implementation (cuda/cuda_executor); the CPU model of the device, a
// host thread per stream, is the other (host_streams), which runs the same
// executor in CI. Streams are independent: nothing orders two of them but the
// progress words and events, and the host learns what a stream did only
// through events (the runtime's).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "../../plan/types.h"
#include "../control/control_block.h"
#include "device_runtime.h"
#include "staging_place.h"

namespace hca {

class StreamDevice {
 public:
  using Stream = DeviceRuntime::Stream;  // cudaStream_t, or a HostStream of the model

  virtual ~StreamDevice() = default;

  // The runtime its streams and events belong to.
  virtual DeviceRuntime& runtime() = 0;
  // The first byte of `rank`'s ring of staging slots, as this rank addresses it.
  virtual char* staging(int rank) const = 0;
  // Where that ring lives, in words.
  virtual std::string staging_kind() const = 0;
  // Its slots (the same on every rank; chosen when the device opened).
  virtual RingLayout ring() const = 0;

  // Issued on `stream` (a stream of the device, which is current); each runs
  // after everything issued on it before. The data operations (copy, reduce)
  // do nothing if any rank of the group has published a failure
  // (ControlBlock::failure_word) when they run: a failing rank releases every
  // rank's waits, and a peer's staging (mapped from its process) may be gone
  // with it.
  virtual void copy(Stream stream, void* dst, const void* src, size_t bytes) = 0;
  // As Medium::reduce (`srcs` is read at issue time).
  virtual void reduce(Stream stream, DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs,
                      size_t nsrc, size_t n, void* out, int divisor) = 0;
  // Until `rank`'s progress word `word` (w) satisfies (int32_t)(w - value) >= 0.
  virtual void wait_progress(Stream stream, int rank, uint32_t value, ProgressWord word = ProgressWord::Stream) = 0;
  // This rank's stream progress word becomes `value`, made visible to peers.
  virtual void write_progress(Stream stream, int rank, uint32_t value) = 0;
};

}  // namespace hca
