#include "types.h"

#include <stdexcept>

namespace hca {

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::F64: case DType::I64: case DType::U64: return 8;
    case DType::F32: case DType::I32: case DType::U32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: case DType::U16: return 2;
    case DType::I8: case DType::U8: case DType::Bool: return 1;
  }
  throw std::logic_error("unknown dtype");
}

bool is_floating(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::F16 || dtype == DType::BF16;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::I8: return "int8";
    case DType::U8: return "uint8";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::Bool: return "bool";
    case DType::I16: return "int16";
    case DType::U16: return "uint16";
    case DType::U32: return "uint32";
    case DType::U64: return "uint64";
  }
  return "?";
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "SUM";
    case ReduceOp::Avg: return "AVG";
    case ReduceOp::Product: return "PRODUCT";
    case ReduceOp::Min: return "MIN";
    case ReduceOp::Max: return "MAX";
    case ReduceOp::BitAnd: return "BAND";
    case ReduceOp::BitOr: return "BOR";
    case ReduceOp::BitXor: return "BXOR";
  }
  return "?";
}

bool is_bitwise(ReduceOp op) { return op == ReduceOp::BitAnd || op == ReduceOp::BitOr || op == ReduceOp::BitXor; }

ReduceOp bool_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: case ReduceOp::Avg: case ReduceOp::Max: case ReduceOp::BitOr: return ReduceOp::Max;
    case ReduceOp::Product: case ReduceOp::Min: case ReduceOp::BitAnd: return ReduceOp::Min;
    case ReduceOp::BitXor: return ReduceOp::BitXor;
  }
  throw std::logic_error("unknown reduce op");
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::HierarchicalCopy: return "hierarchical_copy";
    case Algorithm::ReduceToOneDevice: return "reduce_to_one_device";
    case Algorithm::Direct: return "direct";
  }
  return "?";
}

Algorithm parse_algorithm(const std::string& name) {
  for (Algorithm a : {Algorithm::HierarchicalCopy, Algorithm::ReduceToOneDevice, Algorithm::Direct}) {
    if (name == algorithm_name(a)) return a;
  }
  throw std::invalid_argument("algorithm: unknown algorithm '" + name +
                              "' (expected hierarchical_copy, reduce_to_one_device or direct)");
}

}  // namespace hca
