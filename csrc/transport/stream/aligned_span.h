// How a device copy is cut so that most of it moves in wide units: a head of
// single bytes up to the first address where both pointers are aligned to
// the widest unit they can share (16, 8, 4 or 2 bytes: equal remainders), the
// bulk in those units, and a tail of single bytes. Tensors at an odd offset
// into their storage would otherwise be copied a byte at a time.
#pragma once
#include <cstddef>
#include <cstdint>

namespace hca {

struct AlignedSpan {
  size_t head;   // bytes before the bulk
  size_t unit;   // bytes per unit of the bulk (1: no wide unit fits)
  size_t units;  // units in the bulk
  size_t tail;   // bytes after it
};

inline AlignedSpan aligned_span(const void* dst, const void* src, size_t bytes) {
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  for (size_t unit = 16; unit > 1; unit /= 2) {
    if (d % unit != s % unit) continue;
    const size_t head = d % unit ? unit - d % unit : 0;
    if (head > bytes) break;
    const size_t units = (bytes - head) / unit;
    if (units == 0) break;
    return {head, unit, units, bytes - head - units * unit};
  }
  return {0, 1, bytes, 0};
}

}  // namespace hca
