#include "passthrough_backend.hpp"

#include <c10/util/Exception.h>

#include "../../transport/nccl/passthrough.hpp"
#include "../calls/call_args.hpp"
#include "../calls/stream_call.hpp"

namespace hca {

PassthroughBackend::PassthroughBackend(int rank, int size, std::chrono::milliseconds timeout, PackingOptions packing,
                                       Engines engines, const c10::intrusive_ptr<c10d::Store>& one_node_store)
    : EngineBackend(rank, size, timeout, std::move(engines)), timeout_(timeout), packing_(packing) {
  if (one_node_store && size > 1) shared_ = std::make_unique<SharedAgreements>(one_node_store, rank, size, timeout);
  agreed_in_shared_memory_ = shared_ != nullptr;
}

PassthroughBackend::~PassthroughBackend() {
  if (shared_ && in_forked_child()) shared_->leave_in_child();
}

void PassthroughBackend::agree(const CallTerms& terms, const char* op) {
  if (!shared_) return EngineBackend::agree(terms, op);
  shared_->agree(terms.text, op, timeout_.load());
  // An all-to-all's split sizes must pair up: gloo's sum checks that, once every rank is known
  // to make this very all-to-all.
  if (!terms.sends.empty()) EngineBackend::agree(terms, op);
}

void PassthroughBackend::end_parts(bool abort) {
  if (shared_ && abort) {
    shared_->abort(getRank());  // first: this rank's agreements, on any thread, give up at once
  } else if (shared_) {  // a shutdown, once the calls inside are done: the peers are told it left
    std::lock_guard<std::mutex> lock(shared_mutex_);
    shared_->leave();
    failure_at_end_ = shared_->failure_word(getRank());
    shared_.reset();
  }
  EngineBackend::end_parts(abort);
}

c10d::ErrorType PassthroughBackend::getError() {
  check_process("get_error");
  std::lock_guard<std::mutex> lock(shared_mutex_);
  return error_type(shared_ ? shared_->failure_word(getRank()) : failure_at_end_);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  return refusing("allreduce", tensors, [&] {
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
      std::vector<at::Tensor> read = tensors;  // the packs too: the stream reads them after the engine
      read.insert(read.end(), packed->flats().begin(), packed->flats().end());
      body = issued_and_waited(call, call->keep(CallTensors{std::move(args), std::move(read)}), std::move(body));
    }
    return record({"allreduce", tensors, tensors}, opts.asyncOp, [&] {
      auto work = c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::ALLREDUCE, tensors, std::move(body),
                                               std::move(call));
      if (after_engine) post_step(work);
      queue_.submit(work, !opts.asyncOp);
      return work;
    });
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  return refusing("broadcast", tensors, [&] {
    check_nonempty(tensors.size(), "the tensor list", "broadcast");
    check_rank(opts.rootRank, getSize(), "src", "broadcast");
    CallTerms terms{"broadcast(" + tensors_text(tensors) + ", src=" + std::to_string(opts.rootRank) + ")"};
    return issue("broadcast", {"broadcast", tensors, tensors}, c10d::OpType::BROADCAST, std::move(terms), opts.asyncOp,
                 [this, tensors, opts] {
                   EngineTensors written;
                   auto bytes = engine_bytes(written.outputs(tensors), "broadcast");
                   return written_back(engine(tensors[0], "broadcast").broadcast(bytes, opts), std::move(written));
                 });
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  return refusing("reduce", tensors, [&] {
    check_nonempty(tensors.size(), "the tensor list", "reduce");
    check_rank(opts.rootRank, getSize(), "dst", "reduce");
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
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  return allgather_by_engine(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  return refusing("allgather_into_tensor", {input}, [&] {
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
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  return refusing("allgather_into_tensor", inputs, [&] {
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
  });
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_by_engine(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_base_by_engine(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_tensor_coalesced_by_engine(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PassthroughBackend::barrier(const c10d::BarrierOptions& opts) {
  return issue("barrier", {"barrier", {}, {}}, c10d::OpType::BARRIER, {"barrier()"}, opts.asyncOp,
               [this, opts] { return EngineCall{cpu_engine("barrier").barrier(opts)}; });
}

}  // namespace hca
