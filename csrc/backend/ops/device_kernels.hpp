// The kernels a collective's data operations run, called alone, for
// `python -m torch_hca.bench --kernels`: CUDA tensors' on torch's current
// stream (returning at once), CPU tensors' on the caller's thread (the host
// kernels, which the CPU model of the device runs too).
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace hca {

// out = inputs[0] + inputs[1] + ..., summed in that order (fp16/bf16 in float32).
void kernel_sum(const at::Tensor& out, const std::vector<at::Tensor>& inputs);
void kernel_copy(const at::Tensor& dst, const at::Tensor& src);

}  // namespace hca
