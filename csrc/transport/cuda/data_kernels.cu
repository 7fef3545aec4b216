#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
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

// Whether any rank of the group failed, as the block starts: its threads read
// the words side by side at system scope (the host writes them), so a block
// waits one read across the bus, not one per rank.
__device__ bool released_now(ReleaseWords released) {
  uint32_t value = 0;
  for (int r = threadIdx.x; r < released.count; r += blockDim.x) {
    auto* word = const_cast<uint32_t*>(released.first + static_cast<size_t>(r) * released.stride);
    value |= ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*word).load(::cuda::memory_order_relaxed);
  }
  return __syncthreads_or(value != 0) != 0;
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

// One element: `first`'s, then every source's in order, AVG's division, one
// rounding; the same order in the vector and the scalar loops, so every rank
// (and the host kernel) gets the same bits wherever its pieces are aligned.
template <class T, class Op>
__device__ T reduced(const T* first, const Sources& srcs, int nsrc, size_t i, int divisor) {
  using Tr = Traits<T>;
  auto acc = Tr::load(first[i]);
  for (int s = 0; s < nsrc; ++s) acc = Op::apply(acc, Tr::load(static_cast<const T*>(srcs.p[s])[i]));
  if (divisor != 1) acc = acc / static_cast<typename Tr::Acc>(divisor);  // before the one rounding, as SUM rounds
  return Tr::store(acc);
}

// 16 bytes of T, loaded and stored whole.
template <class T>
union Vec {
  static constexpr int kCount = 16 / sizeof(T);
  uint4 raw;
  T v[kCount];
};

// Elements [0, head) and [head + vectors * Vec<T>::kCount, n) one by one; those
// between in 16-byte vectors, where every pointer is 16-byte aligned (launch_reduce
// passes vectors = 0 where they are not).
template <class T, class Op>
__global__ void reduce_kernel(ReleaseWords released, T* dst, const T* first, Sources srcs, int nsrc, size_t n,
                              size_t head, size_t vectors, T* out, int divisor) {
  if (released_now(released)) return;
  constexpr int kCount = Vec<T>::kCount;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t thread = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (size_t k = thread; k < vectors; k += stride) {
    const size_t at = head + k * kCount;
    Vec<T> acc, in;
    acc.raw = *reinterpret_cast<const uint4*>(first + at);
    using Tr = Traits<T>;
    typename Tr::Acc sum[kCount];
    for (int j = 0; j < kCount; ++j) sum[j] = Tr::load(acc.v[j]);
    for (int s = 0; s < nsrc; ++s) {
      in.raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(srcs.p[s]) + at);
      for (int j = 0; j < kCount; ++j) sum[j] = Op::apply(sum[j], Tr::load(in.v[j]));
    }
    for (int j = 0; j < kCount; ++j) {
      if (divisor != 1) sum[j] = sum[j] / static_cast<typename Tr::Acc>(divisor);
      acc.v[j] = Tr::store(sum[j]);
    }
    *reinterpret_cast<uint4*>(dst + at) = acc.raw;
    if (out) *reinterpret_cast<uint4*>(out + at) = acc.raw;
  }
  const size_t body_end = head + vectors * kCount, scattered = head + (n - body_end);
  for (size_t k = thread; k < scattered; k += stride) {
    const size_t i = k < head ? k : body_end + (k - head);
    const T v = reduced<T, Op>(first, srcs, nsrc, i, divisor);
    dst[i] = v;
    if (out) out[i] = v;
  }
}

// Enough blocks for `items` threads' worth, at most 4 per SM of the current
// device: a grid-stride loop keeps them all busy at memory speed.
unsigned blocks_for(size_t items) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms[kMaxDevices] = {};  // per device, asked once (two threads may both ask)
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int count = 64;  // a device beyond the table: 4 x 64 blocks
  if (device < kMaxDevices) {
    count = sms[device].load(std::memory_order_relaxed);
    if (count == 0) {
      check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
      sms[device].store(count, std::memory_order_relaxed);
    }
  }
  const size_t most = 4 * static_cast<size_t>(std::max(count, 1));
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>((items + kThreads - 1) / kThreads, most)));
}

// Elements before the first 16-byte boundary of all `pointers` (null ones left
// out) where all are as far from one, a multiple of `size`; else SIZE_MAX: no vectors.
size_t head_before_alignment(std::initializer_list<const void*> pointers, size_t size) {
  size_t offset = SIZE_MAX;
  for (const void* p : pointers) {
    if (!p) continue;
    const size_t at = reinterpret_cast<uintptr_t>(p) % 16;
    if (offset != SIZE_MAX && at != offset) return SIZE_MAX;
    offset = at;
  }
  if (offset == SIZE_MAX || offset % size) return SIZE_MAX;
  return (16 - offset) % 16 / size;
}

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
    const void* from = done ? dst : first;
    T* into = last ? static_cast<T*>(out) : nullptr;
    size_t head = head_before_alignment({dst, from, into}, sizeof(T));
    for (size_t s = 0; s < count && head != SIZE_MAX; ++s) {
      if (head_before_alignment({dst, batch.p[s]}, sizeof(T)) != head) head = SIZE_MAX;
    }
    if (head == SIZE_MAX || head > n) head = n;  // all one by one
    const size_t vectors = (n - head) / Vec<T>::kCount;
    reduce_kernel<T, Op><<<blocks_for(vectors + (n - vectors * Vec<T>::kCount)), kThreads, 0, stream>>>(
        released, static_cast<T*>(dst), static_cast<const T*>(from), batch, static_cast<int>(count), n, head, vectors,
        into, last ? divisor : 1);
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
