// Reductions on a stream, with the host kernels' semantics: fp16/bf16 are
// accumulated in float32 and rounded once; AVG divides the rounded sum; bool
// SUM/MAX are OR, PRODUCT/MIN AND.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

#include "../../plan/types.h"

namespace hca::cuda {

void reduce_async(cudaStream_t stream, DType dtype, ReduceOp op, void* dst, const void* first,
                  const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor);
void scale_copy_async(cudaStream_t stream, DType dtype, void* dst, const void* src, size_t n, int divisor);

}  // namespace hca::cuda
