#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "check.h"
#include "data_kernels.h"

namespace hca::cuda {
namespace {

constexpr int kMaxSources = 15;  // per launch; more sources take more launches
constexpr int kThreads = 512;

// Read once per block, by one thread, at system scope: the host writes it.
__device__ bool released_now(const uint32_t* released) {
  __shared__ uint32_t value;
  if (threadIdx.x == 0) {
    value = ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*const_cast<uint32_t*>(released))
                .load(::cuda::memory_order_relaxed);
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
struct Min { template <class A> __device__ static A apply(A a, A b) { return b < a ? b : a; } };
struct Max { template <class A> __device__ static A apply(A a, A b) { return a < b ? b : a; } };

// Unit is uint4 where both pointers are 16-byte aligned (the staging and torch's
// allocations are), else char.
template <class Unit>
__global__ void copy_kernel(const uint32_t* released, Unit* dst, const Unit* src, size_t n) {
  if (released_now(released)) return;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

template <class T, class Op>
__global__ void reduce_kernel(const uint32_t* released, T* dst, const T* first, Sources srcs, int nsrc, size_t n,
                              T* out, int divisor) {
  if (released_now(released)) return;
  using Tr = Traits<T>;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    auto acc = Tr::load(first[i]);
    for (int s = 0; s < nsrc; ++s) acc = Op::apply(acc, Tr::load(static_cast<const T*>(srcs.p[s])[i]));
    const T v = Tr::store(acc);
    dst[i] = v;
    if (out) out[i] = divisor == 1 ? v : Tr::store(Tr::load(v) / static_cast<typename Tr::Acc>(divisor));
  }
}

template <class T>
__global__ void scale_kernel(const uint32_t* released, T* dst, const T* src, size_t n, int divisor) {
  if (released_now(released)) return;
  using Tr = Traits<T>;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = Tr::store(Tr::load(src[i]) / static_cast<typename Tr::Acc>(divisor));
  }
}

unsigned blocks_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 1024)); }

template <class T, class Op>
void launch_reduce(cudaStream_t stream, const uint32_t* released, void* dst, const void* first,
                   const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor) {
  // Sources beyond one launch fold into dst first; the last launch writes `out`.
  size_t done = 0;
  do {
    Sources batch{};
    const size_t count = std::min<size_t>(kMaxSources, nsrc - done);
    for (size_t s = 0; s < count; ++s) batch.p[s] = srcs[done + s];
    const bool last = done + count == nsrc;
    reduce_kernel<T, Op><<<blocks_for(n), kThreads, 0, stream>>>(
        released, static_cast<T*>(dst), static_cast<const T*>(done ? dst : first), batch, static_cast<int>(count), n,
        last ? static_cast<T*>(out) : nullptr, divisor);
    done += count;
  } while (done < nsrc);
  check(cudaGetLastError(), "reduce kernel launch");
}

template <class T>
void reduce_typed(cudaStream_t stream, const uint32_t* released, ReduceOp op, void* dst, const void* first,
                  const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return launch_reduce<T, Add>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Product: return launch_reduce<T, Mul>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Min: return launch_reduce<T, Min>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Max: return launch_reduce<T, Max>(stream, released, dst, first, srcs, nsrc, n, out, divisor);
  }
}

template <class T>
void scale_typed(cudaStream_t stream, const uint32_t* released, void* dst, const void* src, size_t n, int divisor) {
  scale_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(released, static_cast<T*>(dst), static_cast<const T*>(src), n,
                                                          divisor);
  check(cudaGetLastError(), "scale kernel launch");
}

}  // namespace

void copy_async(cudaStream_t stream, const uint32_t* released, void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const bool wide = ((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s)) % sizeof(uint4)) == 0;
  const size_t units = wide ? bytes / sizeof(uint4) : 0;
  if (units) {
    copy_kernel<uint4><<<blocks_for(units), kThreads, 0, stream>>>(released, reinterpret_cast<uint4*>(d),
                                                                     reinterpret_cast<const uint4*>(s), units);
  }
  const size_t done = units * sizeof(uint4);
  if (done < bytes) {
    copy_kernel<char><<<blocks_for(bytes - done), kThreads, 0, stream>>>(released, d + done, s + done, bytes - done);
  }
  check(cudaGetLastError(), "copy kernel launch");
}

void reduce_async(cudaStream_t stream, const uint32_t* released, DType dtype, ReduceOp op, void* dst,
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
    case DType::Bool: {
      const bool any = op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Max;
      return reduce_typed<uint8_t>(stream, released, any ? ReduceOp::Max : ReduceOp::Min, dst, first, srcs, nsrc, n,
                                   out, divisor);
    }
  }
}

void scale_copy_async(cudaStream_t stream, const uint32_t* released, DType dtype, void* dst, const void* src, size_t n,
                      int divisor) {
  if (n == 0) return;
  if (divisor == 1) return copy_async(stream, released, dst, src, n * element_size(dtype));
  switch (dtype) {
    case DType::F32: return scale_typed<float>(stream, released, dst, src, n, divisor);
    case DType::F64: return scale_typed<double>(stream, released, dst, src, n, divisor);
    case DType::F16: return scale_typed<__half>(stream, released, dst, src, n, divisor);
    case DType::BF16: return scale_typed<__nv_bfloat16>(stream, released, dst, src, n, divisor);
    default: throw std::invalid_argument(std::string("AVG is not supported for ") + dtype_name(dtype));
  }
}

}  // namespace hca::cuda
