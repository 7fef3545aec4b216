#include "device_kernels.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "../../transport/shm/kernels.h"
#include "../calls/call_args.hpp"
#ifdef HCA_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../transport/cuda/data_kernels.h"
#endif

namespace hca {
namespace {

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous() && t.device() == like.device() && t.scalar_type() == like.scalar_type() &&
                        t.numel() == like.numel(),
                    "hca kernels: ", name, " must be contiguous, of the output's device, dtype and size, got ",
                    t.sizes(), " ", t.scalar_type(), " on ", t.device());
}

#ifdef HCA_WITH_CUDA
cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

}  // namespace

void kernel_sum(const at::Tensor& out, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK_VALUE(inputs.size() >= 2, "hca kernels: sum needs two inputs or more, got ", inputs.size());
  check_like(out, out, "the output");
  std::vector<const void*> rest;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_like(inputs[i], out, "every input");
    if (i > 0) rest.push_back(inputs[i].data_ptr());
  }
  TORCH_CHECK_VALUE(!out.is_complex(), "hca kernels: sum takes real dtypes, got ", out.scalar_type());
  const DType dtype = reduced_dtype(out.scalar_type(), "kernels");
  const size_t n = static_cast<size_t>(out.numel());
#ifdef HCA_WITH_CUDA
  if (out.is_cuda()) {
    c10::cuda::CUDAGuard guard(out.device());
    cuda::reduce_async(current_stream(out), {nullptr, 0, 0}, dtype, ReduceOp::Sum, out.data_ptr(),
                       inputs[0].data_ptr(), rest.data(), rest.size(), n, nullptr, 1);
    return;
  }
#endif
  TORCH_CHECK_VALUE(out.is_cpu(), "hca kernels: tensors on ", out.device(), " are not supported by this build");
  shm::reduce_into(dtype, ReduceOp::Sum, out.data_ptr(), inputs[0].data_ptr(), rest.data(), rest.size(), n);
}

void kernel_copy(const at::Tensor& dst, const at::Tensor& src) {
  check_like(dst, dst, "the output");
  check_like(src, dst, "the input");
  const size_t bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
#ifdef HCA_WITH_CUDA
  if (dst.is_cuda()) {
    c10::cuda::CUDAGuard guard(dst.device());
    cuda::copy_async(current_stream(dst), {nullptr, 0, 0}, dst.data_ptr(), src.data_ptr(), bytes);
    return;
  }
#endif
  TORCH_CHECK_VALUE(dst.is_cpu(), "hca kernels: tensors on ", dst.device(), " are not supported by this build");
  std::memcpy(dst.data_ptr(), src.data_ptr(), bytes);
}

}  // namespace hca
