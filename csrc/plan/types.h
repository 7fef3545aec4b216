// Vocabulary shared by the plan and every transport: element types, reduce
// operations and the algorithms. Pure C++ (no torch), so the plan can be
// unit-tested and reused by any medium.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace hca {

// Values are part of the point-to-point frame format: new dtypes go at the end (kLastDType).
enum class DType : uint8_t { F32, F64, F16, BF16, I8, U8, I32, I64, Bool, I16, U16, U32, U64 };
constexpr DType kLastDType = DType::U64;
// BitAnd, BitOr, BitXor (c10d's BAND, BOR, BXOR): integer and bool dtypes only.
enum class ReduceOp : uint8_t { Sum, Avg, Product, Min, Max, BitAnd, BitOr, BitXor };
// The schedules the plan knows (`nccl` is a wrapper backend, not a schedule).
// Direct: every rank reads what it needs from every peer in one step (an
// all-reduce in which each rank sums all staged inputs; a reduce into the
// root): one synchronization, but every rank reduces the whole message: for
// small messages.
enum class Algorithm : uint8_t { HierarchicalCopy, ReduceToOneDevice, Direct };

size_t element_size(DType dtype);
bool is_floating(DType dtype);
const char* dtype_name(DType dtype);
const char* op_name(ReduceOp op);
bool is_bitwise(ReduceOp op);  // BAND, BOR, BXOR
// The op on bool's 0/1 bytes that gives `op` of bools: SUM, AVG, MAX and BOR
// are OR (MAX), PRODUCT, MIN and BAND are AND (MIN), BXOR stays.
ReduceOp bool_op(ReduceOp op);
const char* algorithm_name(Algorithm algorithm);
// Throws std::invalid_argument naming the option for an unknown name.
Algorithm parse_algorithm(const std::string& name);

// `n` rounded up to a multiple of `to` (layouts of staging pieces and segments).
inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace hca
