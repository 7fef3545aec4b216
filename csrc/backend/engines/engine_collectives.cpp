// EngineBackend's collectives handed whole to the engine of their tensors' device: the list
// all_gather and the reduce-scatters (the `nccl` pass-through's, and the list forms of a group
// across nodes whose ranks' slots differ in size), with hca's work around gloo's where gloo
// lacks something NCCL has: PREMUL_SUM, a NaN that wins MIN and MAX, all_gather slots of
// several sizes.
#include <c10/util/Exception.h>

#include "../calls/call_args.hpp"
#include "engine_backend.hpp"

namespace hca {

bool one_size(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.numel() != tensors[0].numel()) return false;
  }
  return true;
}

std::optional<PremulFactor> post_scale(const c10d::ReduceOp& op, const std::vector<at::Tensor>& tensors,
                                       const char* name) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM || tensors.empty() || !tensors[0].is_cpu()) return std::nullopt;
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(at::isFloatingType(t.scalar_type()), "hca ", name, ": ReduceOp.PREMUL_SUM is not supported for ",
                      c10::getDtypeNames(t.scalar_type()).first, " (floating dtypes only)");
  }
  return PremulFactor::of(op, name, at::kCPU);
}

c10::intrusive_ptr<c10d::Work> EngineBackend::allgather_by_engine(std::vector<std::vector<at::Tensor>>& outputs,
                                                                  std::vector<at::Tensor>& inputs,
                                                                  const c10d::AllgatherOptions& opts) {
  return refusing("allgather", inputs, [&] {
    check_list_form(inputs, outputs, getRank(), getSize(), "input", "output", "allgather");
    const auto flat_outputs = flattened(outputs);
    // This rank's input is its slot of a list every rank passes alike (the slots may differ in
    // size from rank to rank): so that such ranks agree.
    CallTerms terms{"all_gather(its slot -> " + tensors_text(flat_outputs) + ")"};
    return issue("allgather", {"all_gather", inputs, flat_outputs}, c10d::OpType::ALLGATHER, std::move(terms),
                 opts.asyncOp, [this, outputs, inputs, opts] {
                   EngineTensors written;
                   auto outs = flat_for_gloo(engine_bytes(written.outputs(outputs), "allgather"));
                   auto ins = flat_for_gloo(engine_bytes(EngineTensors::inputs(inputs), "allgather"));
                   if (ins[0].is_cpu() && !one_size(outs[0])) {
                     return allgather_by_broadcasts(outs[0], ins[0], opts.timeout, std::move(written));
                   }
                   return written_back(engine(inputs[0], "allgather").allgather(outs, ins, opts), std::move(written));
                 });
  });
}

EngineBackend::EngineCall EngineBackend::allgather_by_broadcasts(std::vector<at::Tensor> slots, at::Tensor input,
                                                                 std::chrono::milliseconds timeout,
                                                                 EngineTensors written) {
  const int rank = getRank();
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

template <typename Inputs, typename Reduce>
EngineBackend::EngineCall EngineBackend::reduce_scatter_through(std::vector<at::Tensor> outs, Inputs ins,
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

c10::intrusive_ptr<c10d::Work> EngineBackend::reduce_scatter_by_engine(std::vector<at::Tensor>& outputs,
                                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                                       const c10d::ReduceScatterOptions& opts) {
  return refusing("reduce_scatter", outputs, [&] {
    check_list_form(outputs, inputs, getRank(), getSize(), "output", "input", "reduce_scatter");
    const auto flat_inputs = flattened(inputs);
    check_engine_reduction(flat_inputs, opts.reduceOp, "reduce_scatter");
    check_engine_reduction(outputs, opts.reduceOp, "reduce_scatter");
    const auto scale = post_scale(opts.reduceOp, flat_inputs, "reduce_scatter");
    // gloo, as NCCL, takes slots of different sizes: each rank's output is its own slot.
    return issue("reduce_scatter", {"reduce_scatter", flat_inputs, outputs}, c10d::OpType::REDUCE_SCATTER,
                 reduce_scatter_terms(flat_inputs, "its slot", opts), opts.asyncOp,
                 [this, outputs, inputs, opts, scale] {
                   EngineTensors written;
                   auto outs = flat_for_gloo(written.outputs(outputs));
                   auto ins = flat_for_gloo(EngineTensors::inputs(apart_from(inputs, outputs)));
                   auto& gloo = engine(outputs[0], "reduce_scatter");
                   return reduce_scatter_through(outs, ins, opts, scale, std::move(written),
                                                 [&gloo](auto& o, auto& i, const c10d::ReduceScatterOptions& with) {
                                                   return gloo.reduce_scatter(o, i, with);
                                                 });
                 });
  });
}

c10::intrusive_ptr<c10d::Work> EngineBackend::reduce_scatter_base_by_engine(at::Tensor& output, at::Tensor& input,
                                                                            const c10d::ReduceScatterOptions& opts) {
  return refusing("reduce_scatter_tensor", {input}, [&] {
    check_engine_reduction({input, output}, opts.reduceOp, "reduce_scatter_tensor");
    check_tensor_form({input}, {output}, getSize(), "input", "output", "reduce_scatter_tensor");
    const auto scale = post_scale(opts.reduceOp, {input}, "reduce_scatter_tensor");
    return issue("reduce_scatter_tensor", {"_reduce_scatter_base", {input}, {output}},
                 c10d::OpType::_REDUCE_SCATTER_BASE, reduce_scatter_terms({input}, tensors_text({output}), opts),
                 opts.asyncOp, [this, output, input, opts, scale] {
                   EngineTensors written;
                   auto out = flat_for_gloo(written.output(output));
                   auto in = flat_for_gloo(EngineTensors::input(input));
                   auto& gloo = engine(output, "reduce_scatter_tensor");
                   return reduce_scatter_through({out}, std::vector<at::Tensor>{in}, opts, scale, std::move(written),
                                                 [&gloo](auto& o, auto& i, const c10d::ReduceScatterOptions& with) {
                                                   return gloo._reduce_scatter_base(o[0], i[0], with);
                                                 });
                 });
  });
}

c10::intrusive_ptr<c10d::Work> EngineBackend::reduce_scatter_tensor_coalesced_by_engine(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  return refusing("reduce_scatter_tensor", inputs, [&] {
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
  });
}

CallTerms EngineBackend::reduce_scatter_terms(const std::vector<at::Tensor>& inputs, const std::string& outputs,
                                              const c10d::ReduceScatterOptions& opts) {
  return {"reduce_scatter(" + tensors_text(inputs) + " -> " + outputs + ", " + reduction_text(opts.reduceOp) + ")"};
}

std::vector<at::Tensor> EngineBackend::masks_of(const std::vector<at::Tensor>& tensors,
                                                c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> masks;
  for (const auto& t : tensors) masks.push_back(nan_mask({t}, op).view(t.sizes()));
  return masks;
}

std::vector<std::vector<at::Tensor>> EngineBackend::masks_of(const std::vector<std::vector<at::Tensor>>& lists,
                                                             c10d::ReduceOp::RedOpType op) {
  std::vector<std::vector<at::Tensor>> masks;
  for (const auto& list : lists) masks.push_back(masks_of(list, op));
  return masks;
}

EngineBackend::EngineCall EngineBackend::with_nans_put_back(EngineCall call,
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

EngineBackend::EngineCall EngineBackend::scaled_after(c10::intrusive_ptr<c10d::Work> engine_work,
                                                      std::vector<at::Tensor> sums,
                                                      const std::optional<PremulFactor>& scale,
                                                      EngineTensors written) {
  if (!scale) return written_back(std::move(engine_work), std::move(written));
  return {std::move(engine_work), [sums = std::move(sums), scale = *scale, written = std::move(written)] {
            for (const auto& s : sums) scale.multiply(s, s);
            written.write_back();
          }};
}

}  // namespace hca
