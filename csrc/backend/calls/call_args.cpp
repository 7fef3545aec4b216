#include "call_args.hpp"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace hca {
namespace {

// ValueError naming two of `tensors` that share memory, unless `may_alias`
// accepts them. Only tensors addressed as given (contiguous ones) count: the
// others are read into dense copies before the call and written back after it.
void check_own_memory(const char* name, const std::vector<at::Tensor>& tensors, const MayAlias& may_alias) {
  if (tensors.size() < 2) return;  // most calls: nothing to compare, nothing to allocate
  std::vector<size_t> direct;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() > 0 && tensors[i].is_contiguous()) direct.push_back(i);
  }
  auto first = [&](size_t i) { return static_cast<const char*>(tensors[i].data_ptr()); };
  auto end = [&](size_t i) { return first(i) + tensors[i].nbytes(); };
  std::sort(direct.begin(), direct.end(), [&](size_t a, size_t b) { return first(a) < first(b); });
  for (size_t k = 0; k < direct.size(); ++k) {
    for (size_t m = k + 1; m < direct.size() && first(direct[m]) < end(direct[k]); ++m) {
      const size_t i = std::min(direct[k], direct[m]), j = std::max(direct[k], direct[m]);
      if (may_alias && may_alias(tensors, i, j)) continue;
      TORCH_CHECK_VALUE(false, "hca ", name, ": tensors ", i, " and ", j, " of the call share memory (the same tensor "
                        "twice, or overlapping views): each must have memory of its own");
    }
  }
}

}  // namespace

MayAlias inputs_from(size_t first_input) {
  return [first_input](const std::vector<at::Tensor>&, size_t i, size_t) { return i >= first_input; };
}

namespace {

// Whether `part` is exactly chunk `index` of the contiguous `whole`.
bool is_chunk(const at::Tensor& part, const at::Tensor& whole, int index) {
  return part.is_contiguous() && whole.is_contiguous() && part.scalar_type() == whole.scalar_type() &&
         part.data_ptr() == byte_offset(whole, index * part.numel());
}

}  // namespace

std::chrono::milliseconds checked_timeout(std::chrono::milliseconds timeout, const char* where) {
  TORCH_CHECK_VALUE(timeout.count() >= 0, "hca: ", where, ": the timeout is negative (", timeout.count(),
                    " ms); give zero or more");
  return timeout;
}

bool moved_as_bytes(at::ScalarType type) { return c10::isFloat8Type(type) || type == at::kFloat4_e2m1fn_x2; }

namespace {

constexpr const char* kReducedDtypes =
    "float32, float64, float16, bfloat16, int8, uint8, int16, uint16, int32, uint32, int64, uint64, bool; complex for "
    "SUM and AVG";

}  // namespace

DType plan_dtype(at::ScalarType type, const char* op) {
  TORCH_CHECK_TYPE(!moved_as_bytes(type), "hca ", op, ": dtype ", type, " is not supported in reductions (",
                   kReducedDtypes, "); broadcast, all_gather, gather, scatter, all_to_all, send and recv move it");
  switch (type) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kBool: return DType::Bool;
    case at::kShort: return DType::I16;
    case at::kUInt16: return DType::U16;
    case at::kUInt32: return DType::U32;
    case at::kUInt64: return DType::U64;
    default:
      TORCH_CHECK_TYPE(false, "hca ", op, ": dtype ", type, " is not supported (", kReducedDtypes, ")");
  }
}

PlannedElements planned_elements(at::ScalarType type, int64_t numel, const char* op) {
  if (moved_as_bytes(type)) return {DType::U8, static_cast<size_t>(numel)};
  if (c10::isComplexType(type)) return {plan_dtype(c10::toRealValueType(type), op), 2 * static_cast<size_t>(numel)};
  return {plan_dtype(type, op), static_cast<size_t>(numel)};
}

at::Tensor as_real(const at::Tensor& t) { return t.is_complex() ? at::view_as_real(t) : t; }

DType reduced_dtype(at::ScalarType type, const char* op) {
  return plan_dtype(c10::isComplexType(type) ? c10::toRealValueType(type) : type, op);
}

void check_complex_reduction(at::ScalarType type, const c10d::ReduceOp& op, const char* name) {
  if (!c10::isComplexType(type)) return;
  const bool real_parts = op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG ||
                          op.op_ == c10d::ReduceOp::PREMUL_SUM;
  TORCH_CHECK_VALUE(real_parts, "hca ", name, ": ReduceOp.", reduction_text(op), " is not supported for ", type,
                    " (complex tensors: SUM, AVG and PREMUL_SUM, which reduce the real and imaginary parts apart)");
}

std::optional<ReduceOp> plan_op(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::Sum;
    case c10d::ReduceOp::AVG: return ReduceOp::Avg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::Product;
    case c10d::ReduceOp::MIN: return ReduceOp::Min;
    case c10d::ReduceOp::MAX: return ReduceOp::Max;
    case c10d::ReduceOp::BAND: return ReduceOp::BitAnd;
    case c10d::ReduceOp::BOR: return ReduceOp::BitOr;
    case c10d::ReduceOp::BXOR: return ReduceOp::BitXor;
    default: return std::nullopt;
  }
}

void check_reducible(DType dtype, ReduceOp op, const char* name) {
  TORCH_CHECK_VALUE(op != ReduceOp::Avg || is_floating(dtype), "hca ", name, ": ReduceOp.AVG is not supported for ",
                    dtype_name(dtype), " (floating dtypes only)");
  TORCH_CHECK_VALUE(!is_bitwise(op) || !is_floating(dtype), "hca ", name, ": ReduceOp.", op_name(op),
                    " is not supported for ", dtype_name(dtype), " (integer and bool dtypes only)");
}

void check_nonempty(size_t count, const char* what, const char* op) {
  TORCH_CHECK_VALUE(count > 0, "hca ", op, ": ", what, " is empty");
}

void check_rank(int64_t rank, int size, const char* what, const char* op) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, "hca ", op, ": ", what, " ", rank, " is outside the group of ", size,
                    " ranks");
}

std::vector<int64_t> rows_per_rank(const at::Tensor& t, const std::vector<int64_t>& splits, int world,
                                   const char* what) {
  TORCH_CHECK_VALUE(t.dim() > 0, "hca alltoall_base: the ", what, " must have at least one dimension");
  if (splits.empty()) {
    TORCH_CHECK_VALUE(t.size(0) % world == 0, "hca alltoall_base: the ", what, "'s first dimension (", t.size(0),
                      ") does not divide into ", world, " equal splits");
    return std::vector<int64_t>(world, t.size(0) / world);
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == world, "hca alltoall_base: ", splits.size(), " ", what,
                    " splits for ", world, " ranks");
  for (int64_t s : splits) TORCH_CHECK_VALUE(s >= 0, "hca alltoall_base: a negative ", what, " split (", s, ")");
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  TORCH_CHECK_VALUE(total == t.size(0), "hca alltoall_base: the ", what, " splits add up to ", total,
                    " rows, but its first dimension is ", t.size(0));
  return splits;
}

void check_alltoall_lists(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, int world) {
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == world && static_cast<int>(outputs.size()) == world,
                    "hca alltoall: expects one input and one output tensor per rank (", world, "), got ",
                    inputs.size(), " and ", outputs.size());
}

at::Tensor apart_from(const at::Tensor& input, const std::vector<at::Tensor>& outputs) {
  auto dense = [](const at::Tensor& t) { return t.defined() && t.layout() == at::kStrided; };  // others: refused later
  if (!dense(input)) return input;
  for (const auto& out : outputs) {
    if (!dense(out)) continue;
    const auto overlap = at::get_overlap_status(input, out);
    // TooHard: a view that is not dense, which the call reads or writes through a dense copy anyway
    if (overlap == at::MemOverlapStatus::Full || overlap == at::MemOverlapStatus::Partial) return input.clone();
  }
  return input;
}

std::vector<at::Tensor> apart_from(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> apart;
  for (const auto& input : inputs) apart.push_back(apart_from(input, outputs));
  return apart;
}

std::vector<std::vector<at::Tensor>> apart_from(const std::vector<std::vector<at::Tensor>>& lists,
                                                const std::vector<at::Tensor>& outputs) {
  std::vector<std::vector<at::Tensor>> apart;
  for (const auto& list : lists) apart.push_back(apart_from(list, outputs));
  return apart;
}

char* byte_offset(const at::Tensor& t, int64_t elements) {
  return static_cast<char*>(t.data_ptr()) + elements * static_cast<int64_t>(t.element_size());
}

CallArgs::CallArgs(const char* name, const std::vector<at::Tensor>& tensors, const MayAlias& may_alias)
    : name_(name), original_(tensors) {
  descs_.reserve(tensors.size());
  dense_.reserve(tensors.size());
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(t.defined(), "hca ", name, ": got an undefined tensor");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "hca ", name, ": ", t.layout(),
                      " tensors are not supported (dense tensors only)");
    TORCH_CHECK_VALUE(t.device() == tensors[0].device(), "hca ", name, ": tensors on ", t.device(), " and ",
                      tensors[0].device(), " in one call");
    // float8 and float4 moved, not reduced, as uint8 (NCCL does the same), and reduce_op() refuses
    // them; complex as pairs of its real dtype.
    const PlannedElements elements = planned_elements(t.scalar_type(), t.numel(), name);
    descs_.push_back({elements.dtype, elements.count});
    const size_t i = dense_.size();
    const bool read_only = may_alias && may_alias(tensors, i, i);
    // Refused here, before any data moves: the write-back after the call could not store into it.
    TORCH_CHECK_VALUE(read_only || at::has_internal_overlap(t) != at::MemOverlap::Yes, "hca ", name, ": tensor ", i,
                      " of the call is a view whose elements share memory (expand(), a stride of 0): pass a "
                      "tensor of its own (.contiguous() or .clone())");
    const at::Tensor dense = t.is_contiguous() ? t : t.contiguous();
    written_.push_back(!read_only && !dense.is_same(t));
    dense_.push_back(as_real(dense));
  }
  check_own_memory(name, tensors, may_alias);
  if (!tensors.empty()) device_ = tensors[0].device();
}

std::string CallArgs::text(size_t first, size_t count) const {
  return tensors_text({original_.begin() + first, original_.begin() + first + count});
}

std::string tensors_text(const std::vector<at::Tensor>& tensors) {
  std::string text;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto type = tensors[i].scalar_type();
    if (i == 0 || type != tensors[i - 1].scalar_type()) {
      text += std::string(i > 0 ? "]," : "") + c10::toString(type) + "[";
    } else {
      text += "+";
    }
    text += std::to_string(tensors[i].numel());
  }
  return tensors.empty() ? "[]" : text + "]";
}

std::string reduction_text(const c10d::ReduceOp& op) {
  const auto plan = plan_op(op);
  return plan ? op_name(*plan) : op.op_ == c10d::ReduceOp::PREMUL_SUM ? "PREMUL_SUM" : "UNUSED";
}

std::string fitted_text(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text;
  const std::string hash = "... #" + std::to_string(std::hash<std::string>{}(text));
  return text.substr(0, limit - hash.size()) + hash;
}

void CallArgs::append_key(std::string& key, size_t first, size_t count) const {
  for (size_t i = first; i < first + count; ++i) {
    key.append(reinterpret_cast<const char*>(&descs_[i].dtype), sizeof(descs_[i].dtype));
    key.append(reinterpret_cast<const char*>(&descs_[i].numel), sizeof(descs_[i].numel));
  }
}

ReduceOp CallArgs::reduce_op(const c10d::ReduceOp& op, const Scaled* scaled) {
  static const char* const names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  for (const auto& t : original_) {
    check_complex_reduction(t.scalar_type(), op, name_);
    reduced_dtype(t.scalar_type(), name_);  // dtypes only moved are refused here
  }
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM && scaled) {
    for (const auto& d : descs_) {
      TORCH_CHECK_VALUE(is_floating(d.dtype), "hca ", name_, ": ReduceOp.PREMUL_SUM is not supported for ",
                        dtype_name(d.dtype), " (floating dtypes only)");
    }
    factor_ = PremulFactor::of(op, name_, device_);
    for (size_t i = scaled->first; i < scaled->first + scaled->count; ++i) {
      // Allocated now, so that the plan addresses them; written in the call's turn.
      if (scaled->copies) {
        dense_[i] = at::empty_like(dense_[i], at::MemoryFormat::Contiguous);
        written_[i] = false;  // the input stays the caller's
      }
    }
    scaled_ = *scaled;
    return ReduceOp::Sum;
  }
  const auto plan = plan_op(op);
  const auto index = static_cast<size_t>(op.op_);
  TORCH_CHECK_VALUE(plan, "hca ", name_, ": ReduceOp.", index < 9 ? names[index] : "?",
                    " is not supported (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR; PREMUL_SUM in all_reduce, "
                    "reduce and reduce_scatter)");
  for (const auto& d : descs_) check_reducible(d.dtype, *plan, name_);
  return *plan;
}

PremulFactor PremulFactor::of(const c10d::ReduceOp& op, const char* name, const at::Device& device) {
  // torch makes PREMUL_SUM only with this supplement (c10d::makeNCCLPreMulSum), as ProcessGroupNCCL reads it.
  const auto* supplement = static_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(supplement, "hca ", name, ": ReduceOp.PREMUL_SUM without a factor (make it with "
                    "torch.distributed._make_nccl_premul_sum(factor))");
  PremulFactor factor{supplement->double_factor, {}};
  if (supplement->tensor_factor.defined()) factor.tensor = supplement->tensor_factor.to(device);
  return factor;
}

void PremulFactor::multiply(const at::Tensor& target, const at::Tensor& source) const {
  at::NoGradGuard no_grad;  // the backend's own arithmetic: never recorded, whatever the thread's mode
  at::Tensor out = target;
  if (tensor.defined()) {
    at::mul_out(out, source, tensor);
  } else {
    at::mul_out(out, source, number);
  }
}

void CallArgs::premultiply() const {
  if (!scaled_) return;
  for (size_t i = scaled_->first; i < scaled_->first + scaled_->count; ++i) {
    factor_.multiply(dense_[i], scaled_->copies ? as_real(original_[i]) : dense_[i]);
  }
}

std::vector<TensorSpan> CallArgs::in_place(size_t first, size_t count) const {
  std::vector<TensorSpan> spans;
  spans.reserve(count);
  for (size_t i = first; i < first + count; ++i) spans.push_back({dense_[i].data_ptr(), dense_[i].data_ptr()});
  return spans;
}

void check_like(const at::Tensor& t, const at::Tensor& like, int64_t numel, const char* what, const char* op,
                const char* like_what) {
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), "hca ", op, ": ", what, " has dtype ", t.scalar_type(),
                   " but ", like_what, " has ", like.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == numel, "hca ", op, ": ", what, " has ", t.numel(), " elements, expected ", numel);
}

void check_root_list(const std::vector<std::vector<at::Tensor>>& lists, bool is_root, const at::Tensor& like,
                     const char* like_what, int size, const char* op, const char* list, const char* root) {
  if (!is_root) {
    TORCH_CHECK_VALUE(lists.empty() || lists[0].empty(), "hca ", op, ": only the ", root, " rank passes a ", list);
    return;
  }
  TORCH_CHECK_VALUE(lists.size() == 1 && static_cast<int>(lists[0].size()) == size, "hca ", op, ": the ", root,
                    " rank needs a ", list, " of one tensor per rank (", size, ")");
  const std::string slot = std::string("a ") + list + " tensor";
  for (const auto& t : lists[0]) check_like(t, like, like.numel(), slot.c_str(), op, like_what);
}

std::vector<std::vector<at::Tensor>> gather_single_slots(const at::Tensor& output, const at::Tensor& input, int size,
                                                         bool is_root) {
  if (!is_root) return {};
  const int64_t part = input.numel();
  check_like(output, input, part * size, "the output", "gather_single");
  TORCH_CHECK_VALUE(output.is_contiguous(), "hca gather_single: the output must be contiguous");
  const at::Tensor flat = output.view(-1);
  std::vector<at::Tensor> slots;
  for (int r = 0; r < size; ++r) slots.push_back(flat.narrow(0, r * part, part));
  return {slots};
}

void check_tensor_form(const std::vector<at::Tensor>& wholes, const std::vector<at::Tensor>& parts, int size,
                       const char* whole, const char* part, const char* op) {
  TORCH_CHECK_VALUE(wholes.size() == parts.size(), "hca ", op, ": ", wholes.size(), " ", whole, "s for ",
                    parts.size(), " ", part, "s");
  const std::string the_whole = std::string("the ") + whole, the_part = std::string("the ") + part;
  for (size_t i = 0; i < wholes.size(); ++i) {
    check_like(wholes[i], parts[i], parts[i].numel() * size, the_whole.c_str(), op, the_part.c_str());
  }
}

void CallArgs::check_like(size_t i, size_t like, int64_t numel, const char* what) const {
  hca::check_like(original_[i], original_[like], numel, what, name_);
}

void CallArgs::write_back() const {
  at::NoGradGuard no_grad;  // leaves that require grad (pipelining's receive buffers) take it too
  for (size_t i = 0; i < original_.size(); ++i) {
    if (written_[i]) original_[i].copy_(original_[i].is_complex() ? at::view_as_complex(dense_[i]) : dense_[i]);
  }
}

bool CallArgs::copies() const { return std::find(written_.begin(), written_.end(), true) != written_.end(); }

namespace {

// `in_place(output, input)`: whether that pair is the collective's in-place form.
CallArgs paired_args(const char* name, const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                     const std::function<bool(const at::Tensor&, const at::Tensor&)>& in_place) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "hca ", name, ": ", outputs.size(), " outputs for ", inputs.size(),
                    " inputs");
  check_nonempty(inputs.size(), "the input list", name);
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  const size_t n = outputs.size();
  return CallArgs(name, all, [n, &in_place](const std::vector<at::Tensor>& t, size_t i, size_t j) {
    return i >= n || (j == i + n && in_place(t[i], t[j]));
  });
}

}  // namespace

CallArgs allgather_tensor_args(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, int rank,
                               int size) {
  CallArgs args = paired_args("allgather_into_tensor", outputs, inputs,
                              [rank](const at::Tensor& out, const at::Tensor& in) { return is_chunk(in, out, rank); });
  check_tensor_form(outputs, inputs, size, "output", "input", "allgather_into_tensor");
  return args;
}

CallArgs reduce_scatter_tensor_args(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                    int rank, int size, const char* name) {
  CallArgs args = paired_args(name, outputs, inputs,
                              [rank](const at::Tensor& out, const at::Tensor& in) { return is_chunk(out, in, rank); });
  check_tensor_form(inputs, outputs, size, "input", "output", name);
  return args;
}

bool is_sparse_call(const std::vector<at::Tensor>& tensors) {
  return tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() != at::kStrided;
}

void check_list_form(const std::vector<at::Tensor>& ones, const std::vector<std::vector<at::Tensor>>& lists, int rank,
                     int size, const char* one, const char* slot, const char* op) {
  TORCH_CHECK_VALUE(ones.size() == 1 && lists.size() == 1, "hca ", op, ": expects one ", one, " tensor and one ", slot,
                    " list, got ", ones.size(), " and ", lists.size());
  const auto& list = lists[0];
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == size, "hca ", op, ": the ", slot, " list has ", list.size(),
                    " tensors, expected one per rank (", size, ")");
  const std::string like = std::string("the ") + one;
  for (int j = 0; j < size; ++j) {
    const bool own = j == rank;  // the others may differ in size, as NCCL takes them
    const std::string what = std::string(own ? "this rank's " : "an ") + slot + " tensor";
    TORCH_CHECK_VALUE(list[j].defined(), "hca ", op, ": ", what, " ", j, " is undefined");
    check_like(list[j], ones[0], own ? ones[0].numel() : list[j].numel(), what.c_str(), op, like.c_str());
  }
}

CallArgs allgather_list_args(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs, int rank,
                             int size) {
  check_list_form(inputs, outputs, rank, size, "input", "output", "allgather");
  auto& list = outputs[0];
  // In place where the input is this rank's own output; elsewhere an input that shares memory
  // with an output is read from a copy.
  const at::Tensor& own = list[rank];
  const bool in_place = own.defined() && inputs[0].defined() && is_chunk(inputs[0], own, 0) &&
                        own.numel() == inputs[0].numel();
  std::vector<at::Tensor> all = list;
  all.push_back(in_place ? inputs[0] : apart_from(inputs[0], list));
  const size_t input = list.size();
  return CallArgs("allgather", all, [input, rank, in_place](const std::vector<at::Tensor>&, size_t i, size_t j) {
    return i == input || (in_place && j == input && i == static_cast<size_t>(rank));
  });
}

std::vector<size_t> numels(const CallArgs& args, size_t first, size_t count) {
  std::vector<size_t> counts;
  for (size_t i = first; i < first + count; ++i) counts.push_back(args.descs()[i].numel);
  return counts;
}

StackedInputs stacked_reduce_scatter_inputs(std::vector<at::Tensor>& outputs,
                                            std::vector<std::vector<at::Tensor>>& inputs, int rank, int size) {
  check_list_form(outputs, inputs, rank, size, "output", "input", "reduce_scatter");
  std::vector<at::Tensor> all{outputs[0]};
  all.insert(all.end(), inputs[0].begin(), inputs[0].end());
  // The inputs are copied before anything is written: they may share memory with anything.
  const CallArgs checked("reduce_scatter", all,
                         [](const std::vector<at::Tensor>&, size_t i, size_t j) { return i > 0 || j > 0; });
  // Stacked so that one plan addresses every input; the copy costs one pass.
  return {at::cat(inputs[0]).reshape({-1}), numels(checked, 1, inputs[0].size()), checked.text(1, inputs[0].size())};
}

}  // namespace hca
