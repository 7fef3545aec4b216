#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "check.h"
#include "reduce_kernels.h"

namespace hca::cuda {
namespace {

constexpr int kMaxSources = 15;  // per launch; more sources take more launches
constexpr int kThreads = 512;

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

template <class T, class Op>
__global__ void reduce_kernel(T* dst, const T* first, Sources srcs, int nsrc, size_t n, T* out, int divisor) {
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
__global__ void scale_kernel(T* dst, const T* src, size_t n, int divisor) {
  using Tr = Traits<T>;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = Tr::store(Tr::load(src[i]) / static_cast<typename Tr::Acc>(divisor));
  }
}

unsigned blocks_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 1024)); }

template <class T, class Op>
void launch_reduce(cudaStream_t stream, void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t n,
                   void* out, int divisor) {
  // Sources beyond one launch fold into dst first; the last launch writes `out`.
  size_t done = 0;
  do {
    Sources batch{};
    const size_t count = std::min<size_t>(kMaxSources, nsrc - done);
    for (size_t s = 0; s < count; ++s) batch.p[s] = srcs[done + s];
    const bool last = done + count == nsrc;
    reduce_kernel<T, Op><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<T*>(dst), static_cast<const T*>(done ? dst : first), batch, static_cast<int>(count), n,
        last ? static_cast<T*>(out) : nullptr, divisor);
    done += count;
  } while (done < nsrc);
  check(cudaGetLastError(), "reduce kernel launch");
}

template <class T>
void reduce_typed(cudaStream_t stream, ReduceOp op, void* dst, const void* first, const void* const* srcs, size_t nsrc,
                  size_t n, void* out, int divisor) {
  switch (op) {
    case ReduceOp::Sum: case ReduceOp::Avg: return launch_reduce<T, Add>(stream, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Product: return launch_reduce<T, Mul>(stream, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Min: return launch_reduce<T, Min>(stream, dst, first, srcs, nsrc, n, out, divisor);
    case ReduceOp::Max: return launch_reduce<T, Max>(stream, dst, first, srcs, nsrc, n, out, divisor);
  }
}

template <class T>
void scale_typed(cudaStream_t stream, void* dst, const void* src, size_t n, int divisor) {
  scale_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<T*>(dst), static_cast<const T*>(src), n, divisor);
  check(cudaGetLastError(), "scale kernel launch");
}

}  // namespace

void reduce_async(cudaStream_t stream, DType dtype, ReduceOp op, void* dst, const void* first,
                  const void* const* srcs, size_t nsrc, size_t n, void* out, int divisor) {
  if (n == 0) return;
  switch (dtype) {
    case DType::F32: return reduce_typed<float>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::F64: return reduce_typed<double>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::F16: return reduce_typed<__half>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::BF16: return reduce_typed<__nv_bfloat16>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::I8: return reduce_typed<int8_t>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::U8: return reduce_typed<uint8_t>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::I32: return reduce_typed<int32_t>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::I64: return reduce_typed<int64_t>(stream, op, dst, first, srcs, nsrc, n, out, divisor);
    case DType::Bool: {
      const bool any = op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Max;
      return reduce_typed<uint8_t>(stream, any ? ReduceOp::Max : ReduceOp::Min, dst, first, srcs, nsrc, n, out, divisor);
    }
  }
}

void scale_copy_async(cudaStream_t stream, DType dtype, void* dst, const void* src, size_t n, int divisor) {
  if (n == 0) return;
  if (divisor == 1) {
    if (dst != src) check(cudaMemcpyAsync(dst, src, n * element_size(dtype), cudaMemcpyDefault, stream), "cudaMemcpyAsync");
    return;
  }
  switch (dtype) {
    case DType::F32: return scale_typed<float>(stream, dst, src, n, divisor);
    case DType::F64: return scale_typed<double>(stream, dst, src, n, divisor);
    case DType::F16: return scale_typed<__half>(stream, dst, src, n, divisor);
    case DType::BF16: return scale_typed<__nv_bfloat16>(stream, dst, src, n, divisor);
    default: throw std::invalid_argument(std::string("AVG is not supported for ") + dtype_name(dtype));
  }
}

}  // namespace hca::cuda
