// A call's tensors read once: each checked (dense layout, supported dtype, one
// device, memory of its own), described for the plan, made addressable (contiguous copies of
// non-contiguous tensors, written back afterwards), and summarised as text.
// Errors become Python exceptions: TypeError for dtypes, ValueError for values.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <functional>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "../../plan/packing.h"
#include "../../transport/executor.h"

namespace hca {

// Whether tensors i < j of a call may share memory: the collective's in-place form. Asked
// with i == j: whether the call only reads tensor i, whose elements may then share memory
// (an expand()ed input) and which is never written back.
using MayAlias = std::function<bool(const std::vector<at::Tensor>& tensors, size_t i, size_t j)>;

// Tensors from `first_input` on are read-only inputs: reading memory twice is harmless.
MayAlias inputs_from(size_t first_input);

// The tensors [first, first + count) of a call that PREMUL_SUM multiplies: in
// place (an all-reduce's, which take the result), or into new dense tensors
// (`copies`: inputs that stay the caller's).
struct Scaled {
  size_t first, count;
  bool copies;
};

// PREMUL_SUM's factor (dist._make_nccl_premul_sum): a number, or a one-element tensor.
struct PremulFactor {
  double number = 1.0;
  at::Tensor tensor;  // defined where the factor is a tensor, on the call's device
  // The factor of `op`, a PREMUL_SUM of call `name` on `device`, or a ValueError
  // where torch's supplement that carries it is missing.
  static PremulFactor of(const c10d::ReduceOp& op, const char* name, const at::Device& device);
  // target = source * factor (target may be source), never recorded by autograd.
  void multiply(const at::Tensor& target, const at::Tensor& source) const;
};

class CallArgs {
 public:
  // `tensors` are every tensor the call touches (outputs, then inputs). Two
  // contiguous ones sharing memory is a ValueError unless `may_alias` accepts
  // the pair: a step could read what an earlier step of the call wrote (the same
  // tensor twice in allreduce_coalesced would be summed twice).
  CallArgs(const char* name, const std::vector<at::Tensor>& tensors, const MayAlias& may_alias = nullptr);

  const char* name() const { return name_; }
  // The tensors' device (CPU for a call without tensors).
  at::Device device() const { return device_; }
  const std::vector<TensorDesc>& descs() const { return descs_; }
  // The tensors the executor addresses: contiguous ones as given, others dense copies; complex
  // ones as their real views, so that they count elements as descs() does.
  const std::vector<at::Tensor>& dense() const { return dense_; }
  // "Float[3+4],Long[5]" for tensors [first, first + count).
  std::string text(size_t first, size_t count) const;
  // What identifies tensors [first, first + count) for the plan cache: dtypes and sizes, as bytes.
  void append_key(std::string& key, size_t first, size_t count) const;
  // The plan's op for `op` on every tensor's dtype, or a ValueError (a TypeError for a
  // dtype that is moved only). With `scaled`
  // (the tensors it multiplies), PREMUL_SUM (dist._make_nccl_premul_sum) is SUM
  // over those tensors multiplied by its factor in the call's turn (premultiply()).
  ReduceOp reduce_op(const c10d::ReduceOp& op, const Scaled* scaled = nullptr);
  // PREMUL_SUM's multiplication, where reduce_op asked for one: run in the call's
  // turn (on its stream), after the calls before it, before its collectives.
  void premultiply() const;
  bool premultiplies() const { return scaled_.has_value(); }
  // Each of [first, first + count) read and written in place.
  std::vector<TensorSpan> in_place(size_t first, size_t count) const;
  // Checks tensor i against tensor `like`: same dtype, `numel` elements.
  void check_like(size_t i, size_t like, int64_t numel, const char* what) const;
  // Copies the dense results back into non-contiguous originals (not into read-only inputs).
  void write_back() const;
  // Whether write_back writes some tensor.
  bool copies() const;

 private:
  const char* name_;
  at::Device device_{at::kCPU};
  std::vector<at::Tensor> original_, dense_;
  std::vector<bool> written_;  // whether write_back writes each tensor: a copy the call may write
  std::vector<TensorDesc> descs_;
  // PREMUL_SUM's factor and the tensors it scales.
  c10::optional<Scaled> scaled_;
  PremulFactor factor_;
};

// "Float[3+4],Long[5]": the tensors' dtypes and element counts, in order.
std::string tensors_text(const std::vector<at::Tensor>& tensors);
// A reduction's name ("SUM", "PREMUL_SUM").
std::string reduction_text(const c10d::ReduceOp& op);
// `text`, or where it is longer than `limit`, its start and a hash of the whole (which keeps
// texts that differ apart): for fixed-size slots that compare calls.
std::string fitted_text(const std::string& text, size_t limit);

// `timeout`, or a ValueError naming `where` it was given when it is negative (gloo refuses those
// too; zero, as gloo's, times out at once wherever a peer is late).
std::chrono::milliseconds checked_timeout(std::chrono::milliseconds timeout, const char* where);

// The 1-byte dtypes hca moves, as uint8, but does not reduce: float8 and float4.
bool moved_as_bytes(at::ScalarType type);
// The plan's element type for a dtype hca reduces, or a TypeError naming it.
DType plan_dtype(at::ScalarType type, const char* op);
// How the plan sees `numel` elements of `type`: float8 and float4 as bytes, complex as twice as many
// of its real dtype, the rest as plan_dtype; a TypeError for a dtype hca does not carry.
struct PlannedElements {
  DType dtype;
  size_t count;
};
PlannedElements planned_elements(at::ScalarType type, int64_t numel, const char* op);
// A complex tensor as its real view (one more dimension, of 2), any other as it is.
at::Tensor as_real(const at::Tensor& t);
// The element type a reduction of `type` works in (complex: its real dtype); a TypeError for
// a dtype hca does not reduce (float8, float4).
DType reduced_dtype(at::ScalarType type, const char* op);
// A ValueError where `op` does not reduce complex tensors of `type` (only SUM, AVG and PREMUL_SUM
// do, part by part, as torch's all_reduce has it); nothing for other dtypes.
void check_complex_reduction(at::ScalarType type, const c10d::ReduceOp& op, const char* name);
// The plan's op for c10d's SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR and BXOR; none
// for the others (PREMUL_SUM, which callers handle, and UNUSED).
std::optional<ReduceOp> plan_op(const c10d::ReduceOp& op);
// ValueError where `op` does not reduce `dtype`: AVG needs a floating dtype,
// BAND, BOR and BXOR an integer or bool one (as gloo has them).
void check_reducible(DType dtype, ReduceOp op, const char* name);
void check_nonempty(size_t count, const char* what, const char* op);
// TypeError where `t` (`what` of call `op`: "the output") has not `like`'s dtype (`like`:
// `like_what`), ValueError where it has not `numel` elements.
void check_like(const at::Tensor& t, const at::Tensor& like, int64_t numel, const char* what, const char* op,
                const char* like_what = "the input");
// A gather's or scatter's list (`list`: "gather_list"), which the root (`root`: "dst") passes and
// no other rank does: one tensor per rank of the group (`size`), each like `like` (this rank's
// own tensor, `like_what`: dtype, elements). ValueError, TypeError naming call `op`.
void check_root_list(const std::vector<std::vector<at::Tensor>>& lists, bool is_root, const at::Tensor& like,
                     const char* like_what, int size, const char* op, const char* list, const char* root);
// gather_single's `output` as the gather_list of a gather: on the root (`is_root`), `size` slots
// of `input`'s elements, views into `output`, which must be contiguous and hold them all (a
// ValueError, TypeError naming gather_single otherwise); on the others, no list.
std::vector<std::vector<at::Tensor>> gather_single_slots(const at::Tensor& output, const at::Tensor& input, int size,
                                                         bool is_root);
// The tensor forms of all-gather and reduce-scatter: as many wholes (an all-gather's outputs,
// a reduce-scatter's inputs: `whole`, "output") as parts (`part`), each whole of its part's
// dtype and `size` times its elements. TypeError, ValueError naming call `op`.
void check_tensor_form(const std::vector<at::Tensor>& wholes, const std::vector<at::Tensor>& parts, int size,
                       const char* whole, const char* part, const char* op);
// A call's input where it shares memory with one of the call's `outputs`: a copy, taken before
// anything is written; else the input itself. Where gloo carries the call it reads inputs
// while it writes outputs: all_to_all_single(t, t), a scatter into a tensor of its own list,
// a list reduce_scatter into one of its inputs came out wrong, silently (NCCL's would race).
at::Tensor apart_from(const at::Tensor& input, const std::vector<at::Tensor>& outputs);
std::vector<at::Tensor> apart_from(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);
std::vector<std::vector<at::Tensor>> apart_from(const std::vector<std::vector<at::Tensor>>& lists,
                                                const std::vector<at::Tensor>& outputs);
// ValueError unless 0 <= rank < size, naming `what` (e.g. "src").
void check_rank(int64_t rank, int size, const char* what, const char* op);
// The paired forms, output i for input i: as many outputs as inputs, at least
// one, each of the input's dtype; the call's arguments, the outputs first.
// allgather_into_tensor: each output holds `size` inputs (in place: the input
// is the output's chunk `rank`).
CallArgs allgather_tensor_args(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, int rank,
                               int size);
// reduce_scatter_tensor: each input holds `size` outputs (in place: the output
// is the input's chunk `rank`). `name`: the call's, in errors.
CallArgs reduce_scatter_tensor_args(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                    int rank, int size, const char* name = "reduce_scatter_tensor");
// A call of one sparse tensor (allreduce's sparse form).
bool is_sparse_call(const std::vector<at::Tensor>& tensors);
// all_to_all_single's rows of `t` (its `what`: "input", "output") per rank: the splits as
// given, or equal ones (which must divide); a ValueError where they do not fit `t` or `world`.
std::vector<int64_t> rows_per_rank(const at::Tensor& t, const std::vector<int64_t>& splits, int world,
                                   const char* what);
// all_to_all's lists: one input and one output tensor per rank, else a ValueError.
void check_alltoall_lists(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, int world);
// The list forms' shape, for call `op`: one tensor (`ones`: "input" of all_gather, "output"
// of reduce_scatter) and one list (`lists`) of a tensor per rank, each of the one's dtype,
// tensor `rank` of its size too (the others may differ in size, as NCCL takes them).
// ValueError or TypeError naming what differs.
void check_list_form(const std::vector<at::Tensor>& ones, const std::vector<std::vector<at::Tensor>>& lists, int rank,
                     int size, const char* one, const char* slot, const char* op);
// allgather's list form checked (check_list_form; in place: the input is output
// `rank`): the call's arguments, the list first, the input last.
CallArgs allgather_list_args(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs, int rank,
                             int size);
// The element counts of tensors [first, first + count) of a call.
std::vector<size_t> numels(const CallArgs& args, size_t first, size_t count);

// reduce_scatter's list form: its inputs stacked into one tensor (a copy), each
// input's element count, and the list as text ("Float[2+3+2]").
struct StackedInputs {
  at::Tensor tensor;
  std::vector<size_t> counts;
  std::string text;
};
// Checks the list form (check_list_form) and stacks its inputs.
StackedInputs stacked_reduce_scatter_inputs(std::vector<at::Tensor>& outputs,
                                            std::vector<std::vector<at::Tensor>>& inputs, int rank, int size);
// The address `elements` elements into a dense tensor.
char* byte_offset(const at::Tensor& t, int64_t elements);

}  // namespace hca
