#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "check.h"
#include "data_kernels.h"

namespace hca::cuda {
namespace {

// Sources per launch. A call with more takes more launches and rounds its partial result to the
// dtype between them; up to 128 ranks one launch folds them all and rounds once, as the host
// kernel (and so the CPU model) always does. The pointers take about 1 KiB of the 4 KiB of
// parameters a launch may pass; nvcc reads an array this long from the parameters by index,
// where it copied 15 of them to each thread's stack first (ptxas: 0 against 120 bytes).
constexpr int kMaxSources = 127;
constexpr int kThreads = 512;

// Read once per block, by one thread, at system scope: the host writes them.
__device__ bool released_now(ReleaseWords released) {
  __shared__ uint32_t value;
  if (threadIdx.x == 0) {
    value = 0;
    for (int r = 0; r < released.count && !value; ++r) {
      auto* word = const_cast<uint32_t*>(released.first + static_cast<size_t>(r) * released.stride);
      value = ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*word).load(::cuda::memory_order_relaxed);
    }
  }
  __syncthreads();
  return value != 0;
}

struct Sources {
  const void* p[kMaxSources];
};

template <class T>
struct Traits {
  using Acc = T;
  __device__ static Acc load(T v) { return v; }
  __device__ static T store(Acc v) { return v; }
};
template <>
struct Traits<__half> {
  using Acc = float;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Traits<__nv_bfloat16> {
  using Acc = float;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

struct Add { template <class A> __device__ static A apply(A a, A b) { return a + b; } };
struct Mul { template <class A> __device__ static A apply(A a, A b) { return a * b; } };
// A NaN wins wherever it comes from, as torch.maximum/minimum and gloo have it: a NaN loss
// or gradient on one rank must not vanish from the result (as `a < b ? b : a` lets it).
template <class A>
__device__ bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return isnan(v);
  return false;
}
struct Min { template <class A> __device__ static A apply(A a, A b) { return (b < a || is_nan(b)) ? b : a; } };
struct Max { template <class A> __device__ static A apply(A a, A b) { return (a < b || is_nan(b)) ? b : a; } };
struct BitAnd { template <class A> __device__ static A apply(A a, A b) { return a & b; } };
struct BitOr { template <class A> __device__ static A apply(A a, A b) { return a | b; } };
struct BitXor { template <class A> __device__ static A apply(A a, A b) { return a ^ b; } };

// Unit: the widest both pointers share (aligned_span.h).
template <class Unit>
__global__ void copy_kernel(ReleaseWords released, Unit* dst, const Unit* src, size_t n) {
  if (released_now(released)) return;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

template <class T, class Op>
__global__ void reduce_kernel(ReleaseWords released, T* dst, const T* first, Sources srcs, int nsrc, size_t n,
                              T* out, int divisor) {
  if (released_now(released)) return;
  using Tr = Traits<T>;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    auto acc = Tr::load(first[i]);
    for (int s = 0; s < nsrc; ++s) acc = Op::apply(acc, Tr::load(static_cast<const T*>(srcs.p[s])[i]));
    // An AVG divides before its one rounding, so that it rounds as the SUM does.
    if (divisor != 1) acc = acc / static_cast<typename Tr::Acc>(divisor);
    const T v = Tr::store(acc);
    dst[i] = v;
    if (out) out[i] = v;
  }
}

unsigned blocks_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 1024)); }

template <class T, class Op>
void launch_reduce(cudaStream_t stream, ReleaseWords released, void* dst, const void* first,
                   const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor) {
  // Sources beyond one launch fold into dst first; the last launch divides and writes `out`.
  size_t done = 0;
  do {
    Sources batch{};
    const size_t count = std::min<size_t>(kMaxSources, nsrc - done);
    for (size_t s = 0; s < count; ++s) batch.p[s] = srcs[done + s];
    const bool last = done + count == nsrc;
    reduce_kernel<T, Op><<<blocks_for(n), kThreads, 0, stream>>>(
        released, static_cast<T*>(dst), static_cast<const T*>(done ? dst : first), batch, static_cast<int>(count), n,
        last ? static_cast<T*>(out) : nullptr, last ? divisor : 1);
    done += count;
  } while (done < nsrc);
  check(cudaGetLastError(), "reduce kernel launch");
}

template <class T>
void reduce_typed(cudaStream_t stream, ReleaseWords released, ReduceOp op, void* dst, const void* first,
                  const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return launch_reduce<T, Add>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Product: return launch_reduce<T, Mul>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Min: return launch_reduce<T, Min>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Max: return launch_reduce<T, Max>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::BitAnd: case ReduceOp::BitOr: case ReduceOp::BitXor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::BitAnd) return launch_reduce<T, BitAnd>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
        if (op == ReduceOp::BitOr) return launch_reduce<T, BitOr>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
        return launch_reduce<T, BitXor>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
      }
      throw std::logic_error("bitwise reduction of a floating dtype");  // the call's checks refuse it first
  }
}

}  // namespace

template <class Unit>
void launch_copy(cudaStream_t stream, ReleaseWords released, char* d, const char* s, size_t units) {
  if (units == 0) return;
  copy_kernel<Unit><<<blocks_for(units), kThreads, 0, stream>>>(released, reinterpret_cast<Unit*>(d),
                                                                  reinterpret_cast<const Unit*>(s), units);
}

void copy_async(cudaStream_t stream, ReleaseWords released, void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const AlignedSpan span = aligned_span(d, s, bytes);
  launch_copy<char>(stream, released, d, s, span.head);
  char* bulk_d = d + span.head;
  const char* bulk_s = s + span.head;
  switch (span.unit) {
    case 16: launch_copy<uint4>(stream, released, bulk_d, bulk_s, span.units); break;
    case 8: launch_copy<uint2>(stream, released, bulk_d, bulk_s, span.units); break;
    case 4: launch_copy<uint32_t>(stream, released, bulk_d, bulk_s, span.units); break;
    case 2: launch_copy<uint16_t>(stream, released, bulk_d, bulk_s, span.units); break;
    default: launch_copy<char>(stream, released, bulk_d, bulk_s, span.units); break;
  }
  const size_t tail_at = span.head + span.unit * span.units;
  launch_copy<char>(stream, released, d + tail_at, s + tail_at, span.tail);
  check(cudaGetLastError(), "copy kernel launch");
}

void reduce_async(cudaStream_t stream, ReleaseWords released, DType dtype, ReduceOp op, void* dst,
                  const void* first, const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor) {
  if (n == 0) return;
  switch (dtype) {
    case DType::F32: return reduce_typed<float>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::F64: return reduce_typed<double>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::F16: return reduce_typed<__half>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::BF16: return reduce_typed<__nv_bfloat16>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::I8: return reduce_typed<int8_t>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::U8: return reduce_typed<uint8_t>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::I32: return reduce_typed<int32_t>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::I64: return reduce_typed<int64_t>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::Bool:
      return reduce_typed<uint8_t>(stream, released, bool_op(op), dst, first, srcs, nsrc, n, out, divisor);
    case DType::I16: return reduce_typed<int16_t>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::U16: return reduce_typed<uint16_t>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::U32: return reduce_typed<uint32_t>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::U64:
      return reduce_typed<unsigned long long>(stream, released, op, dst, first, srcs, nsrc, n, out, divisor);
  }
}

}  // namespace hca::cuda
