#include "engine_backend.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "../calls/call_args.hpp"

namespace hca {
namespace {

// `fn` of each tensor, in a list or a list of lists.
template <class Fn>
std::vector<at::Tensor> each_of(const std::vector<at::Tensor>& tensors, Fn&& fn) {
  std::vector<at::Tensor> mapped;
  for (const auto& t : tensors) mapped.push_back(fn(t));
  return mapped;
}

template <class Fn>
std::vector<std::vector<at::Tensor>> each_of(const std::vector<std::vector<at::Tensor>>& lists, Fn&& fn) {
  std::vector<std::vector<at::Tensor>> mapped;
  for (const auto& list : lists) mapped.push_back(each_of(list, fn));
  return mapped;
}

}  // namespace

at::Tensor flat_for_gloo(const at::Tensor& tensor) { return tensor.is_cpu() ? tensor.view(-1) : tensor; }

std::vector<at::Tensor> flat_for_gloo(const std::vector<at::Tensor>& tensors) {
  return each_of(tensors, [](const at::Tensor& t) { return flat_for_gloo(t); });
}

std::vector<std::vector<at::Tensor>> flat_for_gloo(const std::vector<std::vector<at::Tensor>>& lists) {
  return each_of(lists, [](const at::Tensor& t) { return flat_for_gloo(t); });
}

namespace {

// A dtype of the same width that the engines move, for the integer dtypes they lack.
std::optional<at::ScalarType> engine_carrier(at::ScalarType type) {
  switch (type) {
    case at::kShort: case at::kUInt16: return at::kHalf;
    case at::kUInt32: return at::kInt;
    case at::kUInt64: return at::kLong;
    default: return std::nullopt;
  }
}

}  // namespace

at::Tensor engine_bytes(const at::Tensor& tensor, const char* op) {
  if (!tensor.defined()) return tensor;
  const auto type = tensor.scalar_type();
  if (moved_as_bytes(type)) return tensor.view(at::kByte);
  if (const auto carrier = engine_carrier(type)) return tensor.view(*carrier);
  if (tensor.is_complex()) return as_real(tensor);  // gloo's gather and scatter have no complex
  if (tensor.is_cpu()) plan_dtype(type, op);  // gloo moves what hca's plans do
  return tensor;
}

std::vector<at::Tensor> engine_bytes(const std::vector<at::Tensor>& tensors, const char* op) {
  return each_of(tensors, [op](const at::Tensor& t) { return engine_bytes(t, op); });
}

std::vector<std::vector<at::Tensor>> engine_bytes(const std::vector<std::vector<at::Tensor>>& lists, const char* op) {
  return each_of(lists, [op](const at::Tensor& t) { return engine_bytes(t, op); });
}

at::Tensor EngineTensors::input(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == at::kStrided ? t.contiguous() : t;
}

std::vector<at::Tensor> EngineTensors::inputs(const std::vector<at::Tensor>& ts) { return each_of(ts, input); }

std::vector<std::vector<at::Tensor>> EngineTensors::inputs(const std::vector<std::vector<at::Tensor>>& lists) {
  return each_of(lists, input);
}

at::Tensor EngineTensors::output(const at::Tensor& t) {
  const at::Tensor given = input(t);
  if (!given.is_same(t)) back_.emplace_back(t, given);
  return given;
}

std::vector<at::Tensor> EngineTensors::outputs(const std::vector<at::Tensor>& ts) {
  return each_of(ts, [this](const at::Tensor& t) { return output(t); });
}

std::vector<std::vector<at::Tensor>> EngineTensors::outputs(const std::vector<std::vector<at::Tensor>>& lists) {
  return each_of(lists, [this](const at::Tensor& t) { return output(t); });
}

void EngineTensors::write_back() const {
  at::NoGradGuard no_grad;  // into leaves that require grad, as hca's own write-backs
  for (const auto& [callers, engines] : back_) callers.copy_(engines);
}

void EngineBackend::check_received_into_contiguous(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(!t.defined() || !t.is_cpu() || t.is_contiguous(), "hca recv: a non-contiguous CPU tensor (sizes ",
                      t.sizes(), ", strides ", t.strides(), ") to receive into, where gloo carries this group's CPU "
                      "messages (algorithm=\"nccl\", or across nodes) and receives into contiguous memory only; "
                      "receive into a contiguous tensor and copy it");
  }
}

c10::intrusive_ptr<c10d::Work> EngineBackend::then(c10::intrusive_ptr<c10d::Work> engine_work, c10d::OpType type,
                                                   std::vector<at::Tensor> results, std::function<void()> step,
                                                   bool async_op) {
  if (!step) return engine_work;
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(results),
                                           [engine_work, step = std::move(step)] {
                                             engine_work->wait();
                                             step();
                                           });
  post_step(work);
  queue().submit(work, !async_op);
  return work;
}

EngineBackend::EngineCall EngineBackend::written_back(c10::intrusive_ptr<c10d::Work> work, EngineTensors written) {
  if (!written.copies()) return {std::move(work)};
  return {std::move(work), [written = std::move(written)] { written.write_back(); }};
}

c10::intrusive_ptr<c10d::Work> EngineBackend::agreed_on_queue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                              CallTerms terms, const char* op, bool async_op,
                                                              std::function<void()> run) {
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(outputs),
                                           [this, terms = std::move(terms), op, run = std::move(run)] {
                                             agree(terms, op);
                                             run();
                                           });
  queue().submit(work, !async_op);
  return work;
}

void EngineBackend::agree(const CallTerms& terms, const char* op) {
  agree_on_call(cpu_engine(op), terms, op, [](int r) { return "rank " + std::to_string(r); });
}

void EngineBackend::refuse_by_agreement(const char* op, const std::vector<at::Tensor>& tensors,
                                        const std::string& why) noexcept {
  if (std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.defined() && !t.is_cpu(); })) {
    return;
  }
  try {
    agreed_on_queue(c10d::OpType::UNKNOWN, {}, {std::string(op) + " " + refusal_text(why)}, op, true, [] {});
  } catch (...) {
    // The group has ended: its peers' calls fail on its engines.
  }
}

void EngineBackend::check_engine_dtypes(const CommsCall& call, const char* op) {
  for (const auto* tensors : {&call.inputs, &call.outputs}) {
    for (const auto& t : *tensors) {
      if (t.defined() && t.is_cpu()) engine_bytes(t, op);
    }
  }
}

bool nans_go_round(c10d::ReduceOp::RedOpType op, const std::vector<at::Tensor>& tensors) {
  if (op != c10d::ReduceOp::MIN && op != c10d::ReduceOp::MAX) return false;
  return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
    return t.defined() && t.is_cpu() && at::isFloatingType(t.scalar_type());
  });
}

at::Tensor nan_mask(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> nans;
  for (const auto& t : tensors) nans.push_back(at::isnan(t).reshape(-1));
  const at::Tensor nan = nans.empty() ? at::empty({0}, at::kBool) : at::cat(nans);
  return (op == c10d::ReduceOp::MAX ? nan : at::logical_not(nan)).to(at::kByte);
}

void put_nans_back(const std::vector<at::Tensor>& results, const at::Tensor& mask, c10d::ReduceOp::RedOpType op) {
  const at::Tensor nan = op == c10d::ReduceOp::MAX ? mask.ne(0) : mask.eq(0);
  int64_t at = 0;
  for (const auto& t : results) {
    if (at::isFloatingType(t.scalar_type())) {  // (an integer tensor's mask marks no NaN)
      t.masked_fill_(nan.narrow(0, at, t.numel()).view(t.sizes()), std::numeric_limits<double>::quiet_NaN());
    }
    at += t.numel();
  }
}

void check_engine_reduction(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& reduce_op, const char* op,
                            bool widened) {
  const auto plan = plan_op(reduce_op);
  const bool bitwise = plan && is_bitwise(*plan);
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    TORCH_CHECK_TYPE(widened || !engine_carrier(t.scalar_type()), "hca ", op, ": dtype ", t.scalar_type(), " is not reduced "
                     "where a stock engine carries the reduction (algorithm=\"nccl\", or between nodes): gloo has no "
                     "arithmetic for it, NCCL none for 16-bit integers; hca's own algorithms on one node reduce it");
    check_complex_reduction(t.scalar_type(), reduce_op, op);
    if (t.is_cuda()) {
      TORCH_CHECK_VALUE(!bitwise, "hca ", op, ": ReduceOp.", op_name(*plan), " of CUDA tensors is not supported with "
                        "algorithm=\"nccl\" or between nodes, where NCCL (which has no bitwise reductions) may "
                        "carry them; hca's own algorithms on one node take them");
      continue;
    }
    const DType dtype = reduced_dtype(t.scalar_type(), op);  // gloo reduces what hca's plans do
    if (plan) check_reducible(dtype, *plan, op);
  }
}

namespace {

constexpr int64_t kTopBit = std::numeric_limits<int64_t>::min();

std::optional<at::ScalarType> wider(at::ScalarType type) {
  switch (type) {
    case at::kShort: case at::kUInt16: return at::kInt;
    case at::kUInt32: case at::kUInt64: return at::kLong;
    default: return std::nullopt;
  }
}

}  // namespace

WidenedForEngine::WidenedForEngine(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op)
    : given_(tensors), flipped_(op == c10d::ReduceOp::MIN || op == c10d::ReduceOp::MAX) {
  at::NoGradGuard no_grad;
  if (given_.empty() || !given_[0].defined() || !wider(given_[0].scalar_type())) return;
  for (const auto& t : given_) {
    if (t.scalar_type() != at::kUInt64) {
      wide_.push_back(t.to(*wider(t.scalar_type())));
    } else {
      // SUM, PRODUCT and bitwise ops: the engine reduces straight into the int64 view
      wide_.push_back(flipped_ ? at::bitwise_xor(t.view(at::kLong), kTopBit) : t.view(at::kLong));
    }
  }
}

void WidenedForEngine::narrow() const {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < wide_.size(); ++i) {
    if (given_[i].scalar_type() != at::kUInt64) {
      given_[i].copy_(wide_[i]);  // cut back to the dtype's width, as its own arithmetic wraps
    } else if (flipped_) {
      given_[i].view(at::kLong).copy_(at::bitwise_xor(wide_[i], kTopBit));
    }
  }
}

EngineBackend::EngineBackend(int rank, int size, std::chrono::milliseconds timeout, Engines engines)
    : c10d::Backend(rank, size), engines_(engines), described_(rank) {
  TORCH_CHECK_VALUE(engines_.cpu, "hca: a stock engine for CPU tensors is needed");
  calls_.set_timeout(timeout);
}

EngineBackend::~EngineBackend() {
  if (!in_forked_child()) return;
  leave_in_child(engines_);  // stock engines would join the parent's threads
  leave_in_child(cuda_call_streams_);
  leave_in_child(model_call_streams_);
}

std::unique_ptr<IssueTicket> EngineBackend::engine_turn(const std::vector<at::Tensor>& tensors) const {
  if (tensors.empty() || !tensors[0].defined()) return nullptr;
  if (tensors[0].is_cpu() && model_call_streams_) model_call_streams_->synchronize_caller(tensors[0].device());
  if (!tensors[0].is_cuda() || !cuda_call_streams_) return nullptr;
  auto ticket = std::make_unique<IssueTicket>(&cuda_call_streams_->runtime(),
                                              cuda_call_streams_->index_of(tensors[0].device()));
  ticket->await();
  return ticket;
}

void end_engines(Engines& engines, bool abort) {
  for (auto* engine : {engines.cpu.get(), engines.cuda.get()}) {
    if (!engine) continue;
    if (abort) {
      engine->abort();
    } else {
      engine->shutdown();
    }
  }
}

void EngineBackend::end(bool abort) {
  life_.end(
      abort, [&] { end_parts(true); }, [&] { stop_queue(); },
      [&] {
        if (!abort) end_parts(false);  // an abort ended them first
      });
}

void EngineBackend::end_parts(bool abort) { end_engines(engines_, abort); }

void set_engines_timeout(Engines& engines, std::chrono::milliseconds timeout) {
  for (auto* engine : {engines.cpu.get(), engines.cuda.get()}) {
    if (engine) engine->setTimeout(timeout);
  }
}

void EngineBackend::setTimeout(std::chrono::milliseconds timeout) {
  set_engines_timeout(engines_, checked_timeout(timeout, "setTimeout"));
  calls_.set_timeout(timeout);
}

void EngineBackend::setSequenceNumberForGroup() {
  calls_.reset();
  for (auto* engine : {engines_.cpu.get(), engines_.cuda.get()}) {
    if (engine) engine->setSequenceNumberForGroup();
  }
}

c10d::Backend& EngineBackend::engine(const at::Tensor& tensor, const char* op) const {
  life_.owner().check(op);
  const auto& chosen = tensor.device().is_cuda() ? engines_.cuda : tensor.device().is_cpu() ? engines_.cpu : nullptr;
  TORCH_CHECK_NOT_IMPLEMENTED(chosen, "hca ", op, ": no stock engine for tensors on ", tensor.device(),
                              " (for CUDA tensors: ProcessGroupNCCL, which needs torch with NCCL and a GPU when the "
                              "group is created)");
  return *chosen;
}

EngineBackend::MessageRoute EngineBackend::message_route(const at::Tensor& tensor, int peer, const char* op) const {
  if (peer != getRank() || !tensor.is_cpu()) return {engine(tensor, op), peer};
  life_.owner().check(op);
  const auto own = own_messages();
  TORCH_CHECK_NOT_IMPLEMENTED(own, "hca ", op, ": a message of CPU tensors from rank ", peer, " to itself: gloo, "
                              "which carries this group's CPU messages (algorithm=\"nccl\"), takes none; hca's own "
                              "algorithms do");
  return *own;
}

void EngineBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const auto inside = life_.enter("monitoredBarrier");
  // gloo numbers its collectives in the order they reach it, and its monitored barrier takes
  // numbers too: so it goes from the group's queue, after the CPU calls before it, as those do
  // (from the caller's thread, it took numbers before a queued call on one rank and after it on
  // another, and both waited until the timeout). Not agreed on first: a barrier that names the
  // ranks that do not come must not wait for them elsewhere.
  auto work = c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::BARRIER, std::vector<at::Tensor>{},
                                           [this, opts, wait_all_ranks] {
                                             cpu_engine("monitoredBarrier").monitoredBarrier(opts, wait_all_ranks);
                                           });
  queue().submit(work, true);
  work->wait(kNoTimeout);
}

c10::intrusive_ptr<c10d::Work> EngineBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return refusing("gather", inputs, [&] {
    check_nonempty(inputs.size(), "the input list", "gather");
    check_rank(opts.rootRank, getSize(), "dst", "gather");
    const bool root = opts.rootRank == getRank();
    check_root_list(outputs, root, inputs[0], "the input", getSize(), "gather", "gather_list", "dst");
    CallTerms terms{"gather(" + tensors_text(inputs) + ", dst=" + std::to_string(opts.rootRank) + ")"};
    return issue("gather", {"gather", inputs, flattened(outputs)}, c10d::OpType::GATHER, std::move(terms), opts.asyncOp,
                 [this, outputs, inputs, opts] {
                   EngineTensors written;
                   auto outs = flat_for_gloo(engine_bytes(written.outputs(outputs), "gather"));
                   auto ins = flat_for_gloo(engine_bytes(EngineTensors::inputs(apart_from(inputs, flattened(outputs))),
                                                         "gather"));
                   return written_back(engine(inputs[0], "gather").gather(outs, ins, opts), std::move(written));
                 });
  });
}

#if HCA_HAS_GATHER_SINGLE
c10::intrusive_ptr<c10d::Work> EngineBackend::gather_single(at::Tensor& output, at::Tensor& input,
                                                            const c10d::GatherOptions& opts) {
  return refusing("gather_single", {input}, [&] {
    auto lists = gather_single_slots(output, input, getSize(), opts.rootRank == getRank());
    std::vector<at::Tensor> inputs{input};
    return gather(lists, inputs, opts);
  });
}
#endif

c10::intrusive_ptr<c10d::Work> EngineBackend::scatter(std::vector<at::Tensor>& outputs,
                                                      std::vector<std::vector<at::Tensor>>& inputs,
                                                      const c10d::ScatterOptions& opts) {
  return refusing("scatter", outputs, [&] {
    check_nonempty(outputs.size(), "the output list", "scatter");
    check_rank(opts.rootRank, getSize(), "src", "scatter");
    const bool root = opts.rootRank == getRank();
    check_root_list(inputs, root, outputs[0], "the output", getSize(), "scatter", "scatter_list", "src");
    CallTerms terms{"scatter(" + tensors_text(outputs) + ", src=" + std::to_string(opts.rootRank) + ")"};
    return issue("scatter", {"scatter", flattened(inputs), outputs}, c10d::OpType::SCATTER, std::move(terms),
                 opts.asyncOp, [this, outputs, inputs, opts] {
                   EngineTensors written;
                   auto outs = flat_for_gloo(engine_bytes(written.outputs(outputs), "scatter"));
                   auto ins =
                       flat_for_gloo(engine_bytes(EngineTensors::inputs(apart_from(inputs, outputs)), "scatter"));
                   return written_back(engine(outputs[0], "scatter").scatter(outs, ins, opts), std::move(written));
                 });
  });
}

namespace {

// The elements of each of `size` blocks of `t` along its first dimension: as `splits` gives
// them (rows), or equal blocks, checked as hca's own all_to_all_single checks them.
std::vector<int64_t> block_elements(const at::Tensor& t, const std::vector<int64_t>& splits, int size,
                                    const char* what) {
  const std::vector<int64_t> rows = rows_per_rank(t, splits, size, what);  // checks first: t has a dimension
  const int64_t per_row = t.size(0) > 0 ? t.numel() / t.size(0) : 0;
  std::vector<int64_t> elements;
  for (int64_t r : rows) elements.push_back(r * per_row);
  return elements;
}

std::vector<int64_t> elements_of(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> elements;
  for (const auto& t : tensors) elements.push_back(t.numel());
  return elements;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> EngineBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& output_splits,
                                                            std::vector<int64_t>& input_splits,
                                                            const c10d::AllToAllOptions& opts) {
  return refusing("alltoall_base", {input}, [&] {
    CallTerms terms{"all_to_all_single(" + std::string(c10::toString(input.scalar_type())) + ")",
                    block_elements(input, input_splits, getSize(), "input"),
                    block_elements(output, output_splits, getSize(), "output")};
    return issue("alltoall_base", {"all_to_all", {input}, {output}, input_splits, output_splits},
                 c10d::OpType::ALLTOALL_BASE, std::move(terms), opts.asyncOp,
                 [this, output, input, output_splits, input_splits, opts]() mutable {
                   EngineTensors written;
                   auto out = engine_bytes(written.output(output), "alltoall_base");
                   auto in = engine_bytes(EngineTensors::input(apart_from(input, {output})), "alltoall_base");
                   return written_back(
                       engine(input, "alltoall_base").alltoall_base(out, in, output_splits, input_splits, opts),
                       std::move(written));
                 });
  });
}

c10::intrusive_ptr<c10d::Work> EngineBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllToAllOptions& opts) {
  return refusing("alltoall", inputs, [&] {
    check_alltoall_lists(outputs, inputs, getSize());
    CallTerms terms{"all_to_all(" + std::string(c10::toString(inputs[0].scalar_type())) + ")", elements_of(inputs),
                    elements_of(outputs)};
    for (const auto* list : {&inputs, &outputs}) {
      for (const auto& t : *list) {
        check_like(t, inputs[0], t.numel(), list == &inputs ? "an input tensor" : "an output tensor", "alltoall",
                   "the first input");
      }
    }
    return issue("alltoall", {"all_to_all", inputs, outputs}, c10d::OpType::ALLTOALL, std::move(terms), opts.asyncOp,
                 [this, outputs, inputs, opts] {
                   if (inputs[0].is_cpu()) return alltoall_in_one(outputs, inputs, opts);  // reads a copy
                   EngineTensors written;
                   auto outs = engine_bytes(written.outputs(outputs), "alltoall");
                   auto ins = engine_bytes(EngineTensors::inputs(apart_from(inputs, outputs)), "alltoall");
                   return written_back(engine(inputs[0], "alltoall").alltoall(outs, ins, opts), std::move(written));
                 });
  });
}

EngineBackend::EngineCall EngineBackend::alltoall_in_one(const std::vector<at::Tensor>& outputs,
                                                         const std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  std::vector<at::Tensor> flat_inputs;
  std::vector<int64_t> input_splits, output_splits;
  for (const auto& t : inputs) {
    flat_inputs.push_back(engine_bytes(t, "alltoall").reshape(-1));
    input_splits.push_back(t.numel());
  }
  int64_t received = 0;
  for (const auto& t : outputs) {
    output_splits.push_back(t.numel());
    received += t.numel();
  }
  auto in = at::cat(flat_inputs);
  auto out = at::empty({received}, in.options());
  auto work = cpu_engine("alltoall").alltoall_base(out, in, output_splits, input_splits, opts);
  return {std::move(work), [outputs, out] {
            at::NoGradGuard no_grad;  // receive buffers that require grad take it too
            int64_t at = 0;
            for (const auto& t : outputs) {
              engine_bytes(t, "alltoall").copy_(out.narrow(0, at, t.numel()).view(t.sizes()));
              at += t.numel();
            }
          }};
}

c10::intrusive_ptr<c10d::Work> EngineBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                  std::vector<at::Tensor>& inputs,
                                                                  const c10d::AllgatherOptions& opts) {
  return refusing("allgather_coalesced", inputs, [&] {
    check_nonempty(inputs.size(), "the input list", "allgather_coalesced");
    CallTerms terms{"allgather_coalesced(" + tensors_text(inputs) + " -> " + tensors_text(flattened(outputs)) + ")"};
    return issue("allgather_coalesced", {"allgather_coalesced", inputs, flattened(outputs)},
                 c10d::OpType::ALLGATHER_COALESCED, std::move(terms), opts.asyncOp, [this, outputs, inputs, opts] {
                   EngineTensors written;
                   auto outs = flat_for_gloo(engine_bytes(written.outputs(outputs), "allgather_coalesced"));
                   auto ins = flat_for_gloo(engine_bytes(EngineTensors::inputs(inputs), "allgather_coalesced"));
                   return written_back(engine(inputs[0], "allgather_coalesced").allgather_coalesced(outs, ins, opts),
                                       std::move(written));
                 });
  });
}

c10::intrusive_ptr<c10d::Work> EngineBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_nonempty(tensors.size(), "the tensor list", "send");
  check_rank(dst, getSize(), "dst", "send");  // gloo reads past its peers' list (a crash) for another
  return issue_message(CommsCall::message("send", tensors, dst), [&] {
    auto dense = EngineTensors::inputs(tensors);
    const auto to = message_route(tensors[0], dst, "send");
    if (described_by_gloo(to.backend, tensors)) return described_.send(to.backend, dense[0], to.peer, tag);
    auto bytes = engine_bytes(dense, "send");
    return to.backend.send(bytes, to.peer, tag);
  });
}

c10::intrusive_ptr<c10d::Work> EngineBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_nonempty(tensors.size(), "the tensor list", "recv");
  check_rank(src, getSize(), "src", "recv");
  if (src != getRank() || !own_messages()) check_received_into_contiguous(tensors);
  return issue_message(CommsCall::message("recv", tensors, src), [&] {
    auto bytes = engine_bytes(tensors, "recv");  // a dtype gloo does not move: TypeError here, at the call
    const auto from = message_route(tensors[0], src, "recv");
    if (described_by_gloo(from.backend, tensors)) return described_.recv(from.backend, tensors[0], from.peer, tag);
    return from.backend.recv(bytes, from.peer, tag);
  });
}

c10::intrusive_ptr<c10d::Work> EngineBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  check_nonempty(tensors.size(), "the tensor list", "recv");
  check_received_into_contiguous(tensors);
  return issue_message(CommsCall::message("recv", tensors, -1), [&] {
    auto bytes = engine_bytes(tensors, "recv");  // as recv's
    auto& from = engine(tensors[0], "recv");
    if (described_by_gloo(from, tensors)) return described_.recv(from, tensors[0], -1, tag);
    return from.recvAnysource(bytes, tag);
  });
}

void EngineBackend::post_step(c10::intrusive_ptr<c10d::Work> work) {
  std::lock_guard<std::mutex> lock(post_step_mutex_);
  post_step_ = std::move(work);
}

void EngineBackend::settle_post_step() {
  c10::intrusive_ptr<c10d::Work> pending;
  {
    std::lock_guard<std::mutex> lock(post_step_mutex_);
    pending = std::move(post_step_);
  }
  // Its error, if any, is its own call's to report.
  if (pending) pending->getFuture()->wait();
}

}  // namespace hca
