// Host reduction kernels over raw bytes: fp16/bf16 are accumulated in float32.
#pragma once
#include <cstddef>

#include "../../plan/types.h"

namespace hca::shm {

// dst[i] = dst[i] ⊕ srcs[0][i] ⊕ ... ⊕ srcs[nsrc-1][i] for n elements, with one
// rounding per element for fp16/bf16. AVG reduces as SUM (the divide is
// done once, at the end, by scale_copy). Bool: SUM/MAX are OR, PRODUCT/MIN AND.
void reduce_into(DType dtype, ReduceOp op, void* dst, const void* const* srcs, size_t nsrc, size_t n);

// dst[i] = src[i] / divisor (a plain copy for divisor 1); dst may equal src.
void scale_copy(DType dtype, void* dst, const void* src, size_t n, int divisor);

}  // namespace hca::shm
