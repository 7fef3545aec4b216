#include "passthrough_backend.hpp"

#include <c10/util/Exception.h>

#include "../../transport/nccl/passthrough.hpp"
#include "../calls/call_args.hpp"
#include "../calls/stream_call.hpp"

namespace hca {
namespace {

// PREMUL_SUM's factor where hca multiplies after the engine's sum (CPU tensors), else none.
std::optional<PremulFactor> post_scale(const c10d::ReduceOp& op, const std::vector<at::Tensor>& tensors,
                                       const char* name) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM || tensors.empty() || !tensors[0].is_cpu()) return std::nullopt;
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(at::isFloatingType(t.scalar_type()), "hca ", name, ": ReduceOp.PREMUL_SUM is not supported for ",
                      t.scalar_type(), " (floating dtypes only)");
  }
  return PremulFactor::of(op, name, at::kCPU);
}

// This rank's own tensor in a list form whose slots may differ in size from rank to rank
// (reduce_scatter's output, all_gather's input: this rank's slot of a list every rank
// passes alike): "its slot" where it fits that slot, so that such ranks agree; else its
// size, which names it where the ranks disagree.
std::string own_slot_text(const at::Tensor& own, const std::vector<at::Tensor>& slots, int rank) {
  const bool fits = static_cast<size_t>(rank) < slots.size() && own.scalar_type() == slots[rank].scalar_type() &&
                    own.numel() == slots[rank].numel();
  return fits ? "its slot" : tensors_text({own});
}

// Whether `tensors` are all of one size.
bool one_size(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.numel() != tensors[0].numel()) return false;
  }
  return true;
}

}  // namespace

PassthroughBackend::PassthroughBackend(int rank, int size, std::chrono::milliseconds timeout, PackingOptions packing,
                                       Engines engines)
    : EngineBackend(rank, size, std::move(engines)), timeout_(timeout), packing_(packing) {}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "allreduce");
  CallTerms terms{"allreduce(" + tensors_text(tensors) + ", " + reduction_text(opts.reduceOp) + ")"};
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() != at::kStrided) {
    return issue("allreduce", {"allreduce", tensors, tensors}, c10d::OpType::ALLREDUCE, std::move(terms),
                 opts.asyncOp, [this, tensors, opts]() mutable {  // sparse: the engine's own form
                   return EngineCall{engine(tensors[0], "allreduce").allreduce(tensors, opts)};
                 });
  }
  CallArgs args("allreduce", tensors);
  const auto scale = post_scale(opts.reduceOp, tensors, "allreduce");
  // The same ops as the other algorithms; PREMUL_SUM is the engine's (NCCL) or post_scale's (gloo).
  if (opts.reduceOp.op_ != c10d::ReduceOp::PREMUL_SUM) args.reduce_op(opts.reduceOp);
  check_engine_reduction(tensors, opts.reduceOp, "allreduce");
  const auto timeout = opts.timeout == c10d::kUnsetTimeout ? timeout_.load() : opts.timeout;
  const c10d::ReduceOp engine_op = scale ? c10d::ReduceOp(c10d::ReduceOp::SUM) : opts.reduceOp;
  if (args.device().is_cpu()) {
    // gloo's turn on the queue, as issue gives it: the dense copies are taken there, after the calls before.
    return record({"allreduce", tensors, tensors}, opts.asyncOp, [&] {
      return agreed_on_queue(c10d::OpType::ALLREDUCE, tensors, std::move(terms), "allreduce", opts.asyncOp,
                             [this, tensors, scale, engine_op, timeout] {
                               CallArgs args("allreduce", tensors);
                               const auto op = engine_op.op_;
                               const bool nans = nans_go_round(op, args.dense());
                               const at::Tensor mask = nans ? nan_mask(args.dense(), op) : at::Tensor();
                               nccl::PackedAllreduce packed(cpu_engine("allreduce"), args.dense(),
                                                            make_packs(args.descs(), packing_), engine_op, timeout);
                               packed.finish();
                               if (nans) {
                                 std::vector<at::Tensor> masks{mask};
                                 c10d::AllreduceOptions alike;
                                 alike.reduceOp = engine_op;
                                 alike.timeout = timeout;
                                 cpu_engine("allreduce").allreduce(masks, alike)->wait();
                                 put_nans_back(args.dense(), mask, op);
                               }
                               if (scale) {
                                 for (const auto& t : args.dense()) scale->multiply(t, t);
                               }
                               args.write_back();
                             });
    });
  }
  settle_post_step();  // the packs reach the engine here, before record (issue's steps, in this order)
  std::shared_ptr<nccl::PackedAllreduce> packed;
  {
    const auto turn = engine_turn(tensors);
    packed = std::make_shared<nccl::PackedAllreduce>(engine(tensors[0], "allreduce"), args.dense(),
                                                     make_packs(args.descs(), packing_), engine_op, timeout);
  }
  // hca's writes after the engine's sum run on the group's stream, which the engine's next
  // call does not wait for (NCCL orders its calls on its own stream): a later call on these
  // tensors (in place, the same tensor again, as NCCL allows before wait()) must wait for them.
  const bool after_engine = packed->writes_tensors() || args.copies();
  std::function<void()> body = [packed, args] {
    packed->finish();
    args.write_back();
  };
  // The engine's results are divided and copied back on this group's stream, which the
  // caller's stream then waits for (it would race otherwise).
  std::shared_ptr<StreamCall> call;
  if (CallStreams* streams = call_streams(args.device())) {
    call = streams->call(args.device());
    body = issued_and_waited(call, call->keep(CallTensors{std::move(args), tensors}), std::move(body));
  }
  return record({"allreduce", tensors, tensors}, opts.asyncOp, [&] {
    auto work = c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::ALLREDUCE, tensors, std::move(body),
                                             std::move(call));
    if (after_engine) post_step(work);
    queue_.submit(work, !opts.asyncOp);
    return work;
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "broadcast");
  CallTerms terms{"broadcast(" + tensors_text(tensors) + ", src=" + std::to_string(opts.rootRank) + ")"};
  return issue("broadcast", {"broadcast", tensors, tensors}, c10d::OpType::BROADCAST, std::move(terms), opts.asyncOp,
               [this, tensors, opts] {
                 EngineTensors written;
                 auto bytes = engine_bytes(written.outputs(tensors), "broadcast");
                 return written_back(engine(tensors[0], "broadcast").broadcast(bytes, opts), std::move(written));
               });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  check_nonempty(tensors.size(), "the tensor list", "reduce");
  check_engine_reduction(tensors, opts.reduceOp, "reduce");
  const auto scale = post_scale(opts.reduceOp, tensors, "reduce");
  CallTerms terms{"reduce(" + tensors_text(tensors) + ", " + reduction_text(opts.reduceOp) +
                  ", dst=" + std::to_string(opts.rootRank) + ")"};
  return issue("reduce", {"reduce", tensors, tensors}, c10d::OpType::REDUCE, std::move(terms), opts.asyncOp,
               [this, tensors, opts, scale] {
                 // gloo works in the tensors of every rank and leaves partial results in those of ranks
                 // other than the root; NCCL, and hca's own algorithms, leave them as given: so gloo
                 // gets copies there (taken here, after the calls before have written the tensors).
                 EngineTensors written;
                 std::vector<at::Tensor> given;
                 if (tensors[0].is_cpu() && getRank() != opts.rootRank) {
                   for (const auto& t : tensors) given.push_back(t.clone(at::MemoryFormat::Contiguous));
                 } else {
                   given = written.outputs(tensors);
                 }
                 const auto op = opts.reduceOp.op_;
                 std::vector<at::Tensor> mask;
                 if (nans_go_round(op, given)) mask.push_back(nan_mask(given, op));
                 auto& gloo = engine(tensors[0], "reduce");
                 const bool root = getRank() == opts.rootRank;  // the others' sums are scratch
                 auto call = scaled_after(gloo.reduce(given, summing(opts, scale)),
                                          root ? given : std::vector<at::Tensor>{},
                                          scale, std::move(written));
                 if (mask.empty()) return call;
                 auto masks_work = gloo.reduce(mask, opts);
                 return with_nans_put_back(std::move(call), std::move(masks_work), given, mask, op);
               });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  check_nonempty(inputs.size(), "the input list", "allgather");
  const auto flat_outputs = flattened(outputs);
  const bool one_list = inputs.size() == 1 && outputs.size() == 1;
  CallTerms terms{"all_gather(" + (one_list ? own_slot_text(inputs[0], outputs[0], getRank()) : tensors_text(inputs)) +
                  " -> " + tensors_text(flat_outputs) + ")"};
  return issue("allgather", {"all_gather", inputs, flat_outputs}, c10d::OpType::ALLGATHER, std::move(terms),
               opts.asyncOp, [this, outputs, inputs, opts, one_list] {
                 EngineTensors written;
                 auto outs = flat_for_gloo(engine_bytes(written.outputs(outputs), "allgather"));
                 auto ins = flat_for_gloo(engine_bytes(EngineTensors::inputs(inputs), "allgather"));
                 if (one_list && ins[0].is_cpu() && static_cast<int>(outs[0].size()) == getSize() &&
                     !one_size(outs[0])) {
                   return allgather_by_broadcasts(outs[0], ins[0], opts.timeout, std::move(written));
                 }
                 return written_back(engine(inputs[0], "allgather").allgather(outs, ins, opts), std::move(written));
               });
}

EngineBackend::EngineCall PassthroughBackend::allgather_by_broadcasts(std::vector<at::Tensor> slots, at::Tensor input,
                                                                      std::chrono::milliseconds timeout,
                                                                      EngineTensors written) {
  const int rank = getRank();
  // Every rank's input misfits alike where the ranks agreed on a misfit (see own_slot_text): so
  // every rank raises, before gloo would get a message longer than a slot (it aborts the process).
  TORCH_CHECK_VALUE(input.numel() == slots[rank].numel(), "hca allgather: this rank's input has ", input.numel(),
                    " elements but its output tensor ", slots[rank].numel());
  auto& gloo = cpu_engine("allgather");
  c10::intrusive_ptr<c10d::Work> last;
  for (int r = 0; r < getSize(); ++r) {
    if (last) last->wait();
    std::vector<at::Tensor> one{r == rank ? input : slots[r]};
    c10d::BroadcastOptions from;
    from.rootRank = r;
    from.timeout = timeout;
    last = gloo.broadcast(one, from);
  }
  return {std::move(last), [slots, input, rank, written = std::move(written)] {
            at::NoGradGuard no_grad;  // outputs that require grad take it too
            slots[rank].copy_(input);
            written.write_back();
          }};
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  check_tensor_form({output}, {input}, getSize(), "output", "input", "allgather_into_tensor");
  CallTerms terms{"all_gather_into_tensor(" + tensors_text({input}) + " -> " + tensors_text({output}) + ")"};
  return issue("allgather_into_tensor", {"_allgather_base", {input}, {output}}, c10d::OpType::_ALLGATHER_BASE,
               std::move(terms), opts.asyncOp, [this, output, input, opts] {
                 EngineTensors written;
                 auto out = flat_for_gloo(engine_bytes(written.output(output), "allgather_into_tensor"));
                 auto in = flat_for_gloo(engine_bytes(EngineTensors::input(input), "allgather_into_tensor"));
                 return written_back(engine(input, "allgather_into_tensor")._allgather_base(out, in, opts),
                                     std::move(written));
               });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  check_nonempty(inputs.size(), "the input list", "allgather_into_tensor");
  check_tensor_form(outputs, inputs, getSize(), "output", "input", "allgather_into_tensor");
  CallTerms terms{"all_gather_into_tensor(" + tensors_text(inputs) + " -> " + tensors_text(outputs) + ")"};
  return issue("allgather_into_tensor", {"allgather_into_tensor_coalesced", inputs, outputs}, c10d::OpType::COALESCED,
               std::move(terms), opts.asyncOp, [this, outputs, inputs, opts] {
                 EngineTensors written;
                 auto outs = flat_for_gloo(engine_bytes(written.outputs(outputs), "allgather_into_tensor"));
                 auto ins = flat_for_gloo(engine_bytes(EngineTensors::inputs(inputs), "allgather_into_tensor"));
                 return written_back(
                     engine(inputs[0], "allgather_into_tensor").allgather_into_tensor_coalesced(outs, ins, opts),
                     std::move(written));
               });
}

template <typename Inputs, typename Reduce>
EngineBackend::EngineCall PassthroughBackend::reduce_scatter_through(std::vector<at::Tensor> outs, Inputs ins,
                                                                     const c10d::ReduceScatterOptions& opts,
                                                                     const std::optional<PremulFactor>& scale,
                                                                     EngineTensors written, Reduce reduce) {
  const auto op = opts.reduceOp.op_;
  const bool nans = nans_go_round(op, outs);
  auto out_masks = nans ? masks_of(outs, op) : std::vector<at::Tensor>{};
  auto in_masks = nans ? masks_of(ins, op) : Inputs{};  // taken before gloo writes the tensors
  auto call = scaled_after(reduce(outs, ins, summing(opts, scale)), outs, scale, std::move(written));
  if (!nans) return call;
  auto masks_work = reduce(out_masks, in_masks, opts);
  return with_nans_put_back(std::move(call), std::move(masks_work), std::move(outs), std::move(out_masks), op);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  check_nonempty(outputs.size(), "the output list", "reduce_scatter");
  const auto flat_inputs = flattened(inputs);
  check_engine_reduction(flat_inputs, opts.reduceOp, "reduce_scatter");
  check_engine_reduction(outputs, opts.reduceOp, "reduce_scatter");
  const auto scale = post_scale(opts.reduceOp, flat_inputs, "reduce_scatter");
  // gloo, as NCCL, takes slots of different sizes: each rank's output is its own.
  const auto own = outputs.size() == 1 && inputs.size() == 1 ? own_slot_text(outputs[0], flat_inputs, getRank())
                                                              : tensors_text(outputs);
  return issue("reduce_scatter", {"reduce_scatter", flat_inputs, outputs}, c10d::OpType::REDUCE_SCATTER,
               reduce_scatter_terms(flat_inputs, own, opts), opts.asyncOp, [this, outputs, inputs, opts, scale] {
                 EngineTensors written;
                 auto outs = flat_for_gloo(written.outputs(outputs));
                 auto ins = flat_for_gloo(EngineTensors::inputs(apart_from(inputs, outputs)));
                 auto& gloo = engine(outputs[0], "reduce_scatter");
                 return reduce_scatter_through(outs, ins, opts, scale, std::move(written),
                                               [&gloo](auto& o, auto& i, const c10d::ReduceScatterOptions& with) {
                                                 return gloo.reduce_scatter(o, i, with);
                                               });
               });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  check_engine_reduction({input, output}, opts.reduceOp, "reduce_scatter_tensor");
  check_tensor_form({input}, {output}, getSize(), "input", "output", "reduce_scatter_tensor");
  const auto scale = post_scale(opts.reduceOp, {input}, "reduce_scatter_tensor");
  return issue("reduce_scatter_tensor", {"_reduce_scatter_base", {input}, {output}}, c10d::OpType::_REDUCE_SCATTER_BASE,
               reduce_scatter_terms({input}, tensors_text({output}), opts), opts.asyncOp,
               [this, output, input, opts, scale] {
                 EngineTensors written;
                 auto out = flat_for_gloo(written.output(output));
                 auto in = flat_for_gloo(EngineTensors::input(input));
                 auto& gloo = engine(output, "reduce_scatter_tensor");
                 return reduce_scatter_through({out}, std::vector<at::Tensor>{in}, opts, scale, std::move(written),
                                               [&gloo](auto& o, auto& i, const c10d::ReduceScatterOptions& with) {
                                                 return gloo._reduce_scatter_base(o[0], i[0], with);
                                               });
               });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  check_nonempty(inputs.size(), "the input list", "reduce_scatter_tensor");
  check_engine_reduction(inputs, opts.reduceOp, "reduce_scatter_tensor");
  check_engine_reduction(outputs, opts.reduceOp, "reduce_scatter_tensor");
  check_tensor_form(inputs, outputs, getSize(), "input", "output", "reduce_scatter_tensor");
  const auto scale = post_scale(opts.reduceOp, inputs, "reduce_scatter_tensor");
  return issue("reduce_scatter_tensor", {"reduce_scatter_tensor_coalesced", inputs, outputs}, c10d::OpType::COALESCED,
               reduce_scatter_terms(inputs, tensors_text(outputs), opts), opts.asyncOp,
               [this, outputs, inputs, opts, scale] {
                 EngineTensors written;
                 auto outs = flat_for_gloo(written.outputs(outputs));
                 auto ins = flat_for_gloo(EngineTensors::inputs(apart_from(inputs, outputs)));
                 auto& gloo = engine(inputs[0], "reduce_scatter_tensor");
                 return reduce_scatter_through(outs, ins, opts, scale, std::move(written),
                                               [&gloo](auto& o, auto& i, const c10d::ReduceScatterOptions& with) {
                                                 return gloo.reduce_scatter_tensor_coalesced(o, i, with);
                                               });
               });
}

CallTerms PassthroughBackend::reduce_scatter_terms(const std::vector<at::Tensor>& inputs, const std::string& outputs,
                                                   const c10d::ReduceScatterOptions& opts) {
  return {"reduce_scatter(" + tensors_text(inputs) + " -> " + outputs + ", " + reduction_text(opts.reduceOp) + ")"};
}

std::vector<at::Tensor> PassthroughBackend::masks_of(const std::vector<at::Tensor>& tensors,
                                                     c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> masks;
  for (const auto& t : tensors) masks.push_back(nan_mask({t}, op).view(t.sizes()));
  return masks;
}

std::vector<std::vector<at::Tensor>> PassthroughBackend::masks_of(const std::vector<std::vector<at::Tensor>>& lists,
                                                                  c10d::ReduceOp::RedOpType op) {
  std::vector<std::vector<at::Tensor>> masks;
  for (const auto& list : lists) masks.push_back(masks_of(list, op));
  return masks;
}

EngineBackend::EngineCall PassthroughBackend::with_nans_put_back(EngineCall call,
                                                                 c10::intrusive_ptr<c10d::Work> masks_work,
                                                                 std::vector<at::Tensor> results,
                                                                 std::vector<at::Tensor> masks,
                                                                 c10d::ReduceOp::RedOpType op) {
  return {std::move(call.work), [masks_work = std::move(masks_work), results = std::move(results),
                                 masks = std::move(masks), op, step = std::move(call.step)] {
            masks_work->wait();
            std::vector<at::Tensor> flat;
            for (const auto& m : masks) flat.push_back(m.reshape(-1));
            put_nans_back(results, at::cat(flat), op);
            if (step) step();
          }};
}

EngineBackend::EngineCall PassthroughBackend::scaled_after(c10::intrusive_ptr<c10d::Work> engine_work,
                                                           std::vector<at::Tensor> sums,
                                                           const std::optional<PremulFactor>& scale,
                                                           EngineTensors written) {
  if (!scale) return written_back(std::move(engine_work), std::move(written));
  return {std::move(engine_work), [sums = std::move(sums), scale = *scale, written = std::move(written)] {
            for (const auto& s : sums) scale.multiply(s, s);
            written.write_back();
          }};
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::barrier(const c10d::BarrierOptions& opts) {
  return issue("barrier", {"barrier", {}, {}}, c10d::OpType::BARRIER, {"barrier()"}, opts.asyncOp,
               [this, opts] { return EngineCall{cpu_engine("barrier").barrier(opts)}; });
}

}  // namespace hca
