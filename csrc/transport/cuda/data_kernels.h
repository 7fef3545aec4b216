// Copies and reductions on a stream, with the host kernels' semantics: fp16/bf16
// are accumulated in float32 and rounded once; AVG divides the rounded sum; bool
// SUM/MAX are OR, PRODUCT/MIN AND. Each does nothing if `released` (a word in
// host memory mapped for the GPU) is non-zero when it starts: once this rank's
// group failed, a dead peer's IPC-mapped staging may be gone, and touching it
// would fault the whole context. So copies are kernels too, not cudaMemcpyAsync.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../../plan/types.h"

namespace hca::cuda {

void copy_async(cudaStream_t stream, const uint32_t* released, void* dst, const void* src, size_t bytes);
void reduce_async(cudaStream_t stream, const uint32_t* released, DType dtype, ReduceOp op, void* dst,
                  const void* first, const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor);
void scale_copy_async(cudaStream_t stream, const uint32_t* released, DType dtype, void* dst, const void* src, size_t n,
                      int divisor);

}  // namespace hca::cuda
