#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace hca::shm {
namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE binary16 <-> binary32, round to nearest even.
struct Half {
  uint16_t bits;
  static float load(Half h) {
    const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000) << 16;
    const uint32_t exp = (h.bits >> 10) & 0x1f, mant = h.bits & 0x3ff;
    if (exp == 0x1f) return bits_to_float(sign | 0x7f800000 | (mant << 13));
    if (exp == 0) {
      const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24
      return sign ? -f : f;
    }
    return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  }
  static Half store(float f) {
    uint32_t x = float_to_bits(f);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
    x &= 0x7fffffff;
    if (x >= 0x7f800000) return {static_cast<uint16_t>(sign | 0x7c00 | (x > 0x7f800000 ? 0x200 : 0))};
    if (x >= 0x477ff000) return {static_cast<uint16_t>(sign | 0x7c00)};  // rounds past 65504
    if (x < 0x38800000) {  // half subnormal: count units of 2^-24
      return {static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(bits_to_float(x) * 16777216.0f)))};
    }
    x += 0xc8000fffu + ((x >> 13) & 1);  // rebias the exponent by -112, round to nearest even
    return {static_cast<uint16_t>(sign | (x >> 13))};
  }
};

struct BFloat16 {
  uint16_t bits;
  static float load(BFloat16 h) { return bits_to_float(static_cast<uint32_t>(h.bits) << 16); }
  static BFloat16 store(float f) {
    const uint32_t x = float_to_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return {static_cast<uint16_t>((x >> 16) | 0x40)};  // quiet NaN
    return {static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16)};
  }
};

// Storage type T, accumulated as Acc.
template <class T>
struct Traits {
  using Acc = T;
  static Acc load(T v) { return v; }
  static T store(Acc v) { return v; }
};
template <>
struct Traits<Half> {
  using Acc = float;
  static float load(Half v) { return Half::load(v); }
  static Half store(float v) { return Half::store(v); }
};
template <>
struct Traits<BFloat16> {
  using Acc = float;
  static float load(BFloat16 v) { return BFloat16::load(v); }
  static BFloat16 store(float v) { return BFloat16::store(v); }
};

struct Add { template <class A> static A apply(A a, A b) { return a + b; } };
struct Mul { template <class A> static A apply(A a, A b) { return a * b; } };
// A NaN wins wherever it comes from, as torch.maximum/minimum and gloo have it: a NaN loss
// or gradient on one rank must not vanish from the result (as `a < b ? b : a` lets it).
template <class A>
bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return std::isnan(v);
  return false;
}
struct Min { template <class A> static A apply(A a, A b) { return (b < a || is_nan(b)) ? b : a; } };
struct Max { template <class A> static A apply(A a, A b) { return (a < b || is_nan(b)) ? b : a; } };
struct BitAnd { template <class A> static A apply(A a, A b) { return a & b; } };
struct BitOr { template <class A> static A apply(A a, A b) { return a | b; } };
struct BitXor { template <class A> static A apply(A a, A b) { return a ^ b; } };

// Blocks keep the accumulator in registers/L1 and let the compiler vectorize.
constexpr size_t kBlock = 1024;

struct Operands {
  void* dst;
  const void* first;
  const void* const* srcs;
  size_t nsrc, n;
  void* out;
  int divisor;
};

template <class T, class Op>
void reduce_typed(const Operands& o) {
  using Tr = Traits<T>;
  using Acc = typename Tr::Acc;
  auto dst = static_cast<T*>(o.dst);
  auto first = static_cast<const T*>(o.first);
  auto out = static_cast<T*>(o.out);
  const Acc divisor = static_cast<Acc>(o.divisor);
  Acc acc[kBlock];
  for (size_t base = 0; base < o.n; base += kBlock) {
    const size_t len = std::min(kBlock, o.n - base);
    for (size_t i = 0; i < len; ++i) acc[i] = Tr::load(first[base + i]);
    for (size_t s = 0; s < o.nsrc; ++s) {
      const T* src = static_cast<const T*>(o.srcs[s]) + base;
      for (size_t i = 0; i < len; ++i) acc[i] = Op::apply(acc[i], Tr::load(src[i]));
    }
    // An AVG divides before its one rounding, so that it rounds as the SUM does.
    if (o.divisor != 1) {
      for (size_t i = 0; i < len; ++i) acc[i] /= divisor;
    }
    for (size_t i = 0; i < len; ++i) dst[base + i] = Tr::store(acc[i]);
    if (!out) continue;
    for (size_t i = 0; i < len; ++i) out[base + i] = Tr::store(acc[i]);
  }
}

template <class T>
void reduce_op(ReduceOp op, const Operands& o) {
  switch (op) {
    case ReduceOp::Sum: case ReduceOp::Avg: return reduce_typed<T, Add>(o);
    case ReduceOp::Product: return reduce_typed<T, Mul>(o);
    case ReduceOp::Min: return reduce_typed<T, Min>(o);
    case ReduceOp::Max: return reduce_typed<T, Max>(o);
    case ReduceOp::BitAnd: case ReduceOp::BitOr: case ReduceOp::BitXor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::BitAnd) return reduce_typed<T, BitAnd>(o);
        if (op == ReduceOp::BitOr) return reduce_typed<T, BitOr>(o);
        return reduce_typed<T, BitXor>(o);
      }
      throw std::logic_error("bitwise reduction of a floating dtype");  // the call's checks refuse it first
  }
}

}  // namespace

void reduce_into(DType dtype, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc,
                 size_t n, void* out, int divisor) {
  const Operands o{dst, first, srcs, nsrc, n, out, divisor};
  switch (dtype) {
    case DType::F32: return reduce_op<float>(op, o);
    case DType::F64: return reduce_op<double>(op, o);
    case DType::F16: return reduce_op<Half>(op, o);
    case DType::BF16: return reduce_op<BFloat16>(op, o);
    case DType::I8: return reduce_op<int8_t>(op, o);
    case DType::U8: return reduce_op<uint8_t>(op, o);
    case DType::I32: return reduce_op<int32_t>(op, o);
    case DType::I64: return reduce_op<int64_t>(op, o);
    case DType::Bool: return reduce_op<uint8_t>(bool_op(op), o);
    case DType::I16: return reduce_op<int16_t>(op, o);
    case DType::U16: return reduce_op<uint16_t>(op, o);
    case DType::U32: return reduce_op<uint32_t>(op, o);
    case DType::U64: return reduce_op<uint64_t>(op, o);
  }
}

}  // namespace hca::shm
