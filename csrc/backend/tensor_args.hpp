// Argument checks and conversions between torch's vocabulary and the plan's.
// Errors become Python exceptions: TypeError for dtypes, ValueError for values,
// NotImplementedError for devices this build cannot serve.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "../plan/types.h"

namespace hca {

// Checks one tensor argument of `op`: dense, a supported dtype.
DType plan_dtype(const at::Tensor& tensor, const char* op);
// The same, on the CPU (the only device of the shared-memory transport).
DType checked_dtype(const at::Tensor& tensor, const char* op);
// The plan's op for a torch ReduceOp on `dtype`, or a ValueError.
ReduceOp checked_reduce_op(const c10d::ReduceOp& op, DType dtype, const char* name);
void check_nonempty(size_t count, const char* what, const char* op);
void check_same_layout(const at::Tensor& tensor, const at::Tensor& like, int64_t numel, const char* what,
                       const char* op);

// Tensors the transport can address: contiguous ones as they are, others
// through a dense copy written back once the collective is done.
class DenseTensors {
 public:
  explicit DenseTensors(const std::vector<at::Tensor>& tensors);
  const std::vector<at::Tensor>& dense() const { return dense_; }
  void write_back() const;

 private:
  std::vector<at::Tensor> original_, dense_;
};

// "Float[12]"-style text; "Float[3+4],Long[5]" for a list.
std::string describe_tensors(const std::vector<at::Tensor>& tensors);

}  // namespace hca
