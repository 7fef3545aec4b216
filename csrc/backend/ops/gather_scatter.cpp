// gather, scatter, alltoall (both forms) and allgather_coalesced: each is a
// plan of Copy packs (plan.h) over spans into the caller's tensors. A rank's
// span is null where its role in that pack never touches it.
#include <c10/util/Exception.h>

#include "../group/process_group_hca.hpp"

namespace hca {

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  return refusing("gather", [&] {
    TORCH_CHECK_VALUE(inputs.size() == 1, "hca gather: expects one input tensor, got ", inputs.size());
    check_rank(opts.rootRank, getSize(), "dst", "gather");
    const bool root = opts.rootRank == getRank();
    check_root_list(outputs, root, inputs[0], "the input", getSize(), "gather", "gather_list", "dst");
    std::vector<at::Tensor> all = root ? outputs[0] : std::vector<at::Tensor>{};
    const size_t input = all.size();
    all.push_back(apart_from(inputs[0], all));  // on the root it may be a tensor of its list (its own slot)
    CallArgs args("gather", all, inputs_from(input));
    std::vector<TensorSpan> spans;
    for (size_t j = 0; j < static_cast<size_t>(getSize()); ++j) {
      spans.push_back({args.dense()[input].data_ptr(), root ? args.dense()[j].data_ptr() : nullptr});
    }
    std::vector<Collective> cs;
    cs.push_back(collective(plan_gather(args.descs()[input], getSize(), static_cast<int>(opts.rootRank)),
                            std::move(spans), ReduceOp::Sum, "gather",
                            args.text(input, 1) + ", dst=" + std::to_string(opts.rootRank)));
    std::vector<at::Tensor> results = root ? outputs[0] : std::vector<at::Tensor>{};
    return calls_(*this, {"gather", inputs, results}, opts.asyncOp, [&] {
      return launch(c10d::OpType::GATHER, std::move(args), std::move(cs), std::move(results),
                    timeout_or_default(opts.timeout), opts.asyncOp);
    });
  });
}

#if HCA_HAS_GATHER_SINGLE
c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::gather_single(at::Tensor& output, at::Tensor& input,
                                                              const c10d::GatherOptions& opts) {
  return refusing("gather_single", [&] {
    auto lists = gather_single_slots(output, input, getSize(), opts.rootRank == getRank());
    std::vector<at::Tensor> inputs{input};
    return gather(lists, inputs, opts);
  });
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  return refusing("scatter", [&] {
    TORCH_CHECK_VALUE(outputs.size() == 1, "hca scatter: expects one output tensor, got ", outputs.size());
    check_rank(opts.rootRank, getSize(), "src", "scatter");
    const bool root = opts.rootRank == getRank();
    check_root_list(inputs, root, outputs[0], "the output", getSize(), "scatter", "scatter_list", "src");
    std::vector<at::Tensor> all{outputs[0]};
    if (root) {
      for (const auto& input : apart_from(inputs[0], outputs)) all.push_back(input);  // the output may be one
    }
    CallArgs args("scatter", all, inputs_from(1));
    std::vector<TensorSpan> spans;
    for (int j = 0; j < getSize(); ++j) {
      spans.push_back({root ? args.dense()[1 + j].data_ptr() : nullptr,
                       j == getRank() ? args.dense()[0].data_ptr() : nullptr});
    }
    std::vector<Collective> cs;
    cs.push_back(collective(plan_scatter(args.descs()[0], getSize(), static_cast<int>(opts.rootRank)),
                            std::move(spans), ReduceOp::Sum, "scatter",
                            args.text(0, 1) + ", src=" + std::to_string(opts.rootRank)));
    return calls_(*this, {"scatter", flattened(inputs), outputs}, opts.asyncOp, [&] {
      return launch(c10d::OpType::SCATTER, std::move(args), std::move(cs), outputs, timeout_or_default(opts.timeout),
                    opts.asyncOp);
    });
  });
}

std::vector<int64_t> ProcessGroupHCA::exchange(const std::vector<int64_t>& mine, std::chrono::milliseconds timeout) {
  at::Tensor in = at::tensor(c10::ArrayRef<int64_t>(mine), at::kLong);
  at::Tensor out = at::empty({getSize() * static_cast<int64_t>(mine.size())}, at::kLong);
  gather_step(out, in, timeout, "hca:internal_count_exchange");
  return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::launch_alltoall(
    c10d::OpType type, CallArgs args, const std::vector<int64_t>& sends, const std::vector<int64_t>& expects,
    bool equal, const std::vector<const void*>& sources, const std::vector<void*>& targets,
    std::vector<at::Tensor> outputs, const c10d::AllToAllOptions& opts) {
  const auto timeout = timeout_or_default(opts.timeout);
  const int world = getSize(), rank = getRank();
  const DType dtype = args.descs()[0].dtype;
  std::vector<size_t> counts(static_cast<size_t>(world) * world, equal ? static_cast<size_t>(sends[0]) : 0);
  // Equal splits are checked by the signature (it holds the sizes); other
  // counts are exchanged first, so that every rank builds the same plan.
  std::string details = equal ? args.text(0, args.descs().size()) : std::string(dtype_name(dtype));
  if (!equal) {
    std::vector<int64_t> mine = sends;
    mine.insert(mine.end(), expects.begin(), expects.end());
    try {
      counts = alltoall_counts(exchange(mine, timeout), world);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK_VALUE(false, "hca ", args.name(), ": ", e.what());
    }
  }
  std::vector<TensorSpan> spans;
  for (int i = 0; i < world; ++i) {
    for (int j = 0; j < world; ++j) spans.push_back({i == rank ? sources[j] : nullptr, j == rank ? targets[i] : nullptr});
  }
  std::vector<Collective> cs;
  cs.push_back(collective(plan_alltoall(dtype, counts, world), std::move(spans), ReduceOp::Sum, args.name(), details));
  return launch(type, std::move(args), std::move(cs), std::move(outputs), timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_splits,
                                                              std::vector<int64_t>& input_splits,
                                                              const c10d::AllToAllOptions& opts) {
  return refusing("alltoall_base", [&] {
    const at::Tensor source = apart_from(input, {output});
    CallArgs args("alltoall_base", {output, source}, inputs_from(1));
    args.check_like(0, 1, output.numel(), "the output");
    const int world = getSize();
    const auto in_rows = rows_per_rank(input, input_splits, world, "input");
    const auto out_rows = rows_per_rank(output, output_splits, world, "output");
    // Each side's rows as its own shape makes them, as NCCL and gloo count them: what a pair of
    // ranks sends and expects is compared (by the signature, or exchanged), not the rows' shapes.
    // (in the elements the plan counts: a complex one's real parts)
    const int64_t row = input.size(0) ? args.dense()[1].numel() / input.size(0) : 0;
    const int64_t out_row = output.size(0) ? args.dense()[0].numel() / output.size(0) : 0;
    std::vector<int64_t> sends, expects;
    std::vector<const void*> sources;
    std::vector<void*> targets;
    int64_t in_at = 0, out_at = 0;
    for (int j = 0; j < world; ++j) {
      sends.push_back(in_rows[j] * row);
      expects.push_back(out_rows[j] * out_row);
      sources.push_back(byte_offset(args.dense()[1], in_at));
      targets.push_back(byte_offset(args.dense()[0], out_at));
      in_at += sends.back();
      out_at += expects.back();
    }
    const bool equal = input_splits.empty() && output_splits.empty() && input.numel() == output.numel();
    return calls_(*this, {"all_to_all", {input}, {output}, input_splits, output_splits}, opts.asyncOp, [&] {
      return launch_alltoall(c10d::OpType::ALLTOALL_BASE, std::move(args), sends, expects, equal, sources, targets,
                             {output}, opts);
    });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  return refusing("alltoall", [&] {
    const int world = getSize();
    check_alltoall_lists(outputs, inputs, world);
    std::vector<at::Tensor> all = outputs;
    for (const auto& input : apart_from(inputs, outputs)) all.push_back(input);
    CallArgs args("alltoall", all, inputs_from(outputs.size()));
    std::vector<int64_t> sends, expects;
    std::vector<const void*> sources;
    std::vector<void*> targets;
    for (int j = 0; j < world; ++j) {
      args.check_like(j, world, outputs[j].numel(), "an output tensor");
      args.check_like(world + j, world, inputs[j].numel(), "an input tensor");
      sends.push_back(static_cast<int64_t>(args.descs()[world + j].numel));  // (a complex one's real parts)
      expects.push_back(static_cast<int64_t>(args.descs()[j].numel));
      sources.push_back(args.dense()[world + j].data_ptr());
      targets.push_back(args.dense()[j].data_ptr());
    }
    return calls_(*this, {"all_to_all", inputs, outputs, sends, expects}, opts.asyncOp, [&] {
      return launch_alltoall(c10d::OpType::ALLTOALL, std::move(args), sends, expects, false, sources, targets, outputs,
                             opts);
    });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                    std::vector<at::Tensor>& inputs,
                                                                    const c10d::AllgatherOptions& opts) {
  return refusing("allgather_coalesced", [&] {
    const int world = getSize();
    check_nonempty(inputs.size(), "the input list", "allgather_coalesced");
    TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == world, "hca allgather_coalesced: ", outputs.size(),
                      " output lists, expected one per rank (", world, ")");
    std::vector<at::Tensor> all, results;
    for (const auto& list : outputs) {
      TORCH_CHECK_VALUE(list.size() == inputs.size(), "hca allgather_coalesced: an output list has ", list.size(),
                        " tensors for ", inputs.size(), " inputs");
      all.insert(all.end(), list.begin(), list.end());
    }
    results = all;
    const size_t first_input = all.size(), k = inputs.size();
    for (const auto& input : apart_from(inputs, results)) all.push_back(input);  // an input may be its own slot
    CallArgs args("allgather_coalesced", all, inputs_from(first_input));
    std::vector<Collective> cs;
    for (size_t t = 0; t < k; ++t) {
      const size_t input = first_input + t;
      std::vector<TensorSpan> spans;
      for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
        args.check_like(r * k + t, input, all[input].numel(), "an output tensor");
        spans.push_back({args.dense()[input].data_ptr(), args.dense()[r * k + t].data_ptr()});
      }
      const std::vector<size_t> counts(world, args.descs()[input].numel);
      cs.push_back(collective(plan_allgather(args.descs()[input].dtype, counts), std::move(spans), ReduceOp::Sum,
                              "allgather_coalesced", args.text(input, 1)));
    }
    return calls_(*this, {"allgather_coalesced", inputs, results}, opts.asyncOp, [&] {
      return launch(c10d::OpType::ALLGATHER_COALESCED, std::move(args), std::move(cs), std::move(results),
                    timeout_or_default(opts.timeout), opts.asyncOp);
    });
  });
}

}  // namespace hca
