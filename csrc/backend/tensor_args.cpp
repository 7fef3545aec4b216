#include "tensor_args.hpp"

#include <c10/util/Exception.h>

namespace hca {

DType checked_dtype(const at::Tensor& tensor, const char* op) {
  const DType dtype = plan_dtype(tensor, op);
  TORCH_CHECK_NOT_IMPLEMENTED(tensor.device().is_cpu(), "hca ", op, ": tensors on ", tensor.device(),
                              " are not supported by this build (CPU tensors only)");
  return dtype;
}

DType plan_dtype(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK_VALUE(tensor.defined(), "hca ", op, ": got an undefined tensor");
  TORCH_CHECK_VALUE(tensor.layout() == at::kStrided, "hca ", op, ": ", tensor.layout(),
                    " tensors are not supported (dense tensors only)");
  switch (tensor.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kBool: return DType::Bool;
    default:
      TORCH_CHECK_TYPE(false, "hca ", op, ": dtype ", tensor.scalar_type(),
                       " is not supported (float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool)");
  }
}

ReduceOp checked_reduce_op(const c10d::ReduceOp& op, DType dtype, const char* name) {
  const bool floating = dtype == DType::F32 || dtype == DType::F64 || dtype == DType::F16 || dtype == DType::BF16;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::Sum;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::Product;
    case c10d::ReduceOp::MIN: return ReduceOp::Min;
    case c10d::ReduceOp::MAX: return ReduceOp::Max;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_VALUE(floating, "hca ", name, ": ReduceOp.AVG is not supported for ", dtype_name(dtype),
                        " (floating dtypes only)");
      return ReduceOp::Avg;
    default: {
      static const char* const names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
      const auto index = static_cast<size_t>(op.op_);
      TORCH_CHECK_VALUE(false, "hca ", name, ": ReduceOp.", index < 9 ? names[index] : "?",
                        " is not supported (SUM, AVG, PRODUCT, MIN, MAX)");
    }
  }
}

void check_nonempty(size_t count, const char* what, const char* op) {
  TORCH_CHECK_VALUE(count > 0, "hca ", op, ": ", what, " is empty");
}

void check_same_layout(const at::Tensor& tensor, const at::Tensor& like, int64_t numel, const char* what,
                       const char* op) {
  TORCH_CHECK_TYPE(tensor.scalar_type() == like.scalar_type(), "hca ", op, ": ", what, " has dtype ",
                   tensor.scalar_type(), " but the input has ", like.scalar_type());
  TORCH_CHECK_VALUE(tensor.numel() == numel, "hca ", op, ": ", what, " has ", tensor.numel(),
                    " elements, expected ", numel);
}

DenseTensors::DenseTensors(const std::vector<at::Tensor>& tensors) : original_(tensors) {
  dense_.reserve(tensors.size());
  for (const auto& t : tensors) dense_.push_back(t.is_contiguous() ? t : t.contiguous());
}

void DenseTensors::write_back() const {
  for (size_t i = 0; i < original_.size(); ++i) {
    if (!dense_[i].is_same(original_[i])) original_[i].copy_(dense_[i]);
  }
}

std::string describe_tensors(const std::vector<at::Tensor>& tensors) {
  std::string text;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const bool new_dtype = i == 0 || tensors[i].scalar_type() != tensors[i - 1].scalar_type();
    if (new_dtype) text += std::string(i ? "]," : "") + c10::toString(tensors[i].scalar_type()) + "[";
    else text += "+";
    text += std::to_string(tensors[i].numel());
  }
  return text + "]";
}

}  // namespace hca
