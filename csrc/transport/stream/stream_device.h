// What a stream executor needs from a device: every rank's staging ring, and
// operations issued on a stream that run later, in issue order. CUDA streams
// are one implementation (cuda/cuda_executor); the CPU model of the device, a
// host thread per stream, is the other (host_streams), which runs the same
// executor in CI. Streams are independent: nothing orders two of them but the
// progress words, and the host learns what a stream did only through events.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "../../plan/types.h"

namespace hca {

class StreamDevice {
 public:
  using Stream = void*;  // cudaStream_t, or a HostStream of the model
  using Event = void*;

  // Ends when destroyed (e.g. restores the thread's current CUDA device).
  struct Scope {
    virtual ~Scope() = default;
  };

  virtual ~StreamDevice() = default;

  // The first byte of `rank`'s ring of staging slots, as this rank addresses it.
  virtual char* staging(int rank) const = 0;

  // Issued on `stream`; each runs after everything issued on it before. The
  // data operations (copy, reduce, scale_copy) do nothing if this rank's failure
  // word (ControlBlock::failure_word) is set when they run: the group was
  // released, and a dead peer's staging may be gone with its process.
  virtual void copy(Stream stream, void* dst, const void* src, size_t bytes) = 0;
  // As Medium::reduce (`srcs` is read at issue time).
  virtual void reduce(Stream stream, DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs,
                      size_t nsrc, size_t n, void* out, int divisor) = 0;
  virtual void scale_copy(Stream stream, DType dtype, void* dst, const void* src, size_t n, int divisor) = 0;
  // Until `rank`'s stream progress word w satisfies (int32_t)(w - value) >= 0.
  virtual void wait_progress(Stream stream, int rank, uint32_t value) = 0;
  // This rank's stream progress word becomes `value`, made visible to peers.
  virtual void write_progress(Stream stream, int rank, uint32_t value) = 0;
  // A mark after everything issued on `stream` so far.
  virtual Event record(Stream stream) = 0;
  // Whether the stream has passed `event`; throws hca::Failure once the device
  // faulted (a faulted stream never passes it, and its outputs are undefined).
  virtual bool finished(Event event) = 0;
  virtual void destroy(Event event) = 0;

  // Throws hca::Failure if `stream` cannot take a collective now (CUDA graph capture).
  virtual void check_issuable(Stream stream) = 0;
  // Makes this device current on the calling thread while the scope lives.
  virtual std::unique_ptr<Scope> make_current() = 0;
};

}  // namespace hca
