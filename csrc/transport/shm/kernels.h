// Host reduction kernels over raw bytes: fp16/bf16 are accumulated in float32.
#pragma once
#include <cstddef>

#include "../../plan/types.h"

namespace hca::shm {

// dst[i] = first[i] ⊕ srcs[0][i] ⊕ ... ⊕ srcs[nsrc-1][i] for n elements (first
// may be dst), with one rounding per element for fp16/bf16; if `out` is given,
// out[i] = that result / divisor too, in the same pass. AVG reduces as SUM (the
// divide happens once, into `out` or by scale_copy). Bool: SUM/MAX are OR,
// PRODUCT/MIN AND.
void reduce_into(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc,
                 size_t n, void* out = nullptr, int divisor = 1);

// dst[i] = src[i] / divisor (a plain copy for divisor 1); dst may equal src.
void scale_copy(DType dtype, void* dst, const void* src, size_t n, int divisor);

}  // namespace hca::shm
