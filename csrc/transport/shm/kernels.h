// Host reduction kernels over raw bytes: fp16/bf16 are accumulated in float32.
#pragma once
#include <cstddef>

#include "../../plan/types.h"

namespace hca::shm {

// dst[i] = (first[i] ⊕ srcs[0][i] ⊕ ... ⊕ srcs[nsrc-1][i]) / divisor for n
// elements (first may be dst), accumulated and divided before one rounding per
// element for fp16/bf16; if `out` is given, out[i] = the same, in the same pass.
// AVG reduces as SUM; the caller passes its divisor to the last reduction only.
// Bool: as bool_op (types.h) says; BAND, BOR, BXOR of integer dtypes only.
void reduce_into(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc,
                 size_t n, void* out = nullptr, int divisor = 1);

}  // namespace hca::shm
