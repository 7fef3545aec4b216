// Copies and reductions on a stream, with the host kernels' semantics: fp16/bf16
// are accumulated in float32 and rounded once; AVG divides before that rounding;
// bools as bool_op (types.h) says; BAND, BOR, BXOR of integer dtypes only. Each
// does nothing if any of the group's failure words (host memory mapped for the
// GPU) is non-zero when it starts: a failing rank releases every rank's waits,
// and a dead peer's IPC-mapped staging may be gone, which touching would fault
// the whole context. So copies are kernels too, not cudaMemcpyAsync.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../../plan/types.h"
#include "../stream/aligned_span.h"

namespace hca::cuda {

// The failure word of rank r is first[r * stride], for r < count.
struct ReleaseWords {
  const uint32_t* first;
  uint32_t stride;
  int count;
};

void copy_async(cudaStream_t stream, ReleaseWords released, void* dst, const void* src, size_t bytes);
void reduce_async(cudaStream_t stream, ReleaseWords released, DType dtype, ReduceOp op, void* dst, const void* first,
                  const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor);

}  // namespace hca::cuda
