#include "node_backend.hpp"

#include <c10/util/Exception.h>

#include <optional>

#include "../../transport/nccl/passthrough.hpp"

namespace hca {
namespace {

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

// Row indices for index_select on `like`'s device.
at::Tensor rows_on(const std::vector<int64_t>& rows, const at::Tensor& like) {
  return at::tensor(rows).to(like.device());
}

template <class Options>
Options stage_options(std::chrono::milliseconds timeout) {
  Options o;
  o.timeout = timeout;
  o.asyncOp = false;  // the node's own stages run inline, one after the other
  return o;
}

}  // namespace

NodeBackend::NodeBackend(int rank, int size, std::chrono::milliseconds timeout, PlanOptions options, Nodes nodes,
                         c10::intrusive_ptr<ProcessGroupHCA> local, std::map<int, Engines> leaders, Engines world)
    : EngineBackend(rank, size, timeout, world),
      timeout_(timeout),
      options_(std::move(options)),
      nodes_(std::move(nodes)),
      local_(std::move(local)),
      leaders_(std::move(leaders)) {
  try {
    validate_across_nodes(options_, nodes_);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  TORCH_CHECK_VALUE(nodes_.world() == size, "hca: ", nodes_.world(), " node identities for ", size, " ranks");
  for (int p = 0; p < nodes_.positions(); ++p) {
    TORCH_CHECK_VALUE(!leads(p) || leaders_.count(p), "hca: rank ", rank, " leads position ", p,
                      " but has no engine among that position's leaders");
  }
  // CPU tensors stand for device memory where the node's group runs on the model: so do its stages.
  if (local_->cpu_on_model()) model_call_streams_ = make_model_call_streams();
}

NodeBackend::~NodeBackend() {
  if (!in_forked_child()) return;
  leave_in_child(leaders_);
}

void NodeBackend::setTimeout(std::chrono::milliseconds timeout) {
  EngineBackend::setTimeout(timeout);  // first: it refuses a negative timeout before anything changes
  timeout_ = timeout;
  local_->setTimeout(timeout);
  for (auto& entry : leaders_) set_engines_timeout(entry.second, timeout);
}

void NodeBackend::end_parts(bool abort) {
  if (abort) {
    local_->abort();
  } else {
    local_->shutdown();
  }
  for (auto& entry : leaders_) end_engines(entry.second, abort);
  EngineBackend::end_parts(abort);
}

void NodeBackend::check_device(const at::Device& device, const char* op) const {
#ifdef HCA_WITH_CUDA
  constexpr bool with_cuda = true;
#else
  constexpr bool with_cuda = false;
#endif
  TORCH_CHECK_NOT_IMPLEMENTED(device.is_cpu() || (with_cuda && device.is_cuda()), "hca ", op, ": tensors on ", device,
                              " are not supported across nodes by this build (CPU tensors are",
                              (with_cuda ? ", and CUDA tensors" : "; CUDA tensors need a build with CUDA"), ")");
}

NodeBackend::LeadersAgreement NodeBackend::agree_among_leaders(const std::set<int>& positions,
                                                               const at::Device& device,
                                                               const std::string& text) const {
  LeadersAgreement agreement;
  for (int position : positions) {
    if (!leads(position)) continue;
    const Engines& engines = leaders_.at(position);
    if ((device.is_cuda() && engines.cuda) || !engines.cpu) continue;  // NCCL's (unchecked, as stock NCCL), or none
    agreement.by_position.emplace(
        position, PendingAgreement(*engines.cpu, {text}, "the exchange among the nodes' leaders", [position](int m) {
          return "node " + std::to_string(m) + "'s leader at position " + std::to_string(position);
        }));
  }
  return agreement;
}

void NodeBackend::LeadersAgreement::settle(int position) {
  const auto pending = by_position.find(position);
  if (pending != by_position.end()) pending->second.settle();
}

void NodeBackend::LeadersAgreement::settle_all() {
  for (auto& entry : by_position) entry.second.settle();
}

NodeBackend::AmongLeaders NodeBackend::among_leaders(int position, std::vector<at::Tensor> tensors,
                                                     LeadersAgreement& agreed, const Issue& issue,
                                                     c10d::ReduceOp::RedOpType reduction) const {
  const Engines& engines = leaders_.at(position);
  AmongLeaders call;
  if (reduction != c10d::ReduceOp::UNUSED) {
    call.widened.emplace(tensors, reduction);
    tensors = call.widened->tensors();
  }
  tensors = engine_bytes(tensors, "the exchange among the nodes' leaders");
  const bool cuda = !tensors.empty() && tensors[0].device().is_cuda();
  if (cuda && engines.cuda) {
    call.work = issue(*engines.cuda, tensors);
    return call;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(engines.cpu, "hca: no engine between nodes for CPU tensors");
  // (On the CPU model of the device the host stands for this call's stream: gloo reads what it has.)
  if (cuda) {
    // Through host memory: the copy waits for this call's stream, the results go back on it.
    call.given = tensors;
    for (auto& t : tensors) t = t.to(at::kCPU);
    call.staged = tensors;
  }
  if (nans_go_round(reduction, tensors)) {
    call.reduced = tensors;
    call.nan_mask = nan_mask(tensors, reduction);
    call.reduction = reduction;
  }
  agreed.settle(position);
  call.work = issue(*engines.cpu, tensors);
  if (call.nan_mask.defined()) {
    std::vector<at::Tensor> mask{call.nan_mask};
    call.mask_work = issue(*engines.cpu, mask);
  }
  return call;
}

void NodeBackend::AmongLeaders::finish() {
  work->wait();
  if (mask_work) {
    mask_work->wait();
    put_nans_back(reduced, nan_mask, reduction);
  }
  for (size_t i = 0; i < given.size(); ++i) given[i].copy_(staged[i]);
  if (widened) widened->narrow();
}

void NodeBackend::refuse_in_node(const char* op, const std::string& why) noexcept {
  try {
    // In the call's turn on this group's queue: the node's group gets it after the earlier calls' stages.
    queue_.submit(c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::UNKNOWN, std::vector<at::Tensor>{},
                                               [this, op, why] { local_->refuse(op, why); }),
                  false);
  } catch (...) {
    // The group has ended: its parts have ended too.
  }
}

c10::intrusive_ptr<c10d::Work> NodeBackend::launch(c10d::OpType type, const CallArgs& args,
                                                   std::vector<at::Tensor> outputs, std::function<void()> body,
                                                   bool async_op) {
  std::function<void()> guarded = [this, op = args.name(), body = std::move(body)] {
    try {
      local_->check_usable(op);
      body();
    } catch (const std::exception& e) {
      const std::string where = "node " + std::to_string(node()) + " of " + std::to_string(nodes_.count()) +
                                " (ranks " + ranks_text(nodes_.members[node()]) + ")";
      const std::string cause = message_of(e);
      // The node's other ranks may wait on this one in a later stage: tell them.
      local_->fail(FailureKind::BetweenNodes, "rank " + std::to_string(getRank()) + " on " + where + ": " + cause);
      C10_THROW_ERROR(DistBackendError, "hca " + std::string(op) + " across nodes failed on rank " +
                                            std::to_string(getRank()) + ", " + where + ": " + cause);
    }
  };
  std::shared_ptr<StreamCall> call;
  // A call without tensors (a barrier) has none, as on CUDA, where its device reads as the CPU.
  if (CallStreams* streams = args.dense().empty() ? nullptr : call_streams(args.device())) {
    call = streams->call(args.device());
    // Taken now, on the caller's thread: the stages (the node's group, the engines among
    // leaders) reach the device in this call's turn, whenever the worker gets to them.
    auto turn = std::make_shared<IssueTicket>(&call->runtime(), call->device_index());
    guarded = issued_and_waited(call, call->keep(CallTensors{args, outputs}), std::move(guarded), std::move(turn));
  }
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(outputs), std::move(guarded), std::move(call));
  queue_.submit(work, !async_op);
  return work;
}

void NodeBackend::allreduce_stages(const std::vector<at::Tensor>& tensors, const std::vector<Pack>& packs,
                                   c10d::ReduceOp op, std::chrono::milliseconds timeout, const std::string& text) {
  std::vector<at::Tensor> flats;
  std::vector<int> positions;
  for (const Pack& pack : packs) {
    flats.push_back(nccl::packed(tensors, pack));
    positions.push_back(pack_position(nodes_, options_, pack.index));
  }
  // Position 0's leaders agree even where there are no packs (no elements): so that a node whose
  // call has elements and one whose call has none are told apart.
  std::set<int> agreeing(positions.begin(), positions.end());
  agreeing.insert(0);
  auto agreed = agree_among_leaders(agreeing, tensors[0].device(), text);
  // Pipelined: a leader's exchange between nodes (on the engine's own threads)
  // overlaps the next pack's reduction and the previous pack's copy back.
  auto reduce_opts = stage_options<c10d::ReduceOptions>(timeout);
  reduce_opts.reduceOp = nccl::engine_op(op);
  c10d::AllreduceOptions across;
  across.reduceOp = nccl::engine_op(op);
  across.timeout = timeout;
  std::vector<std::optional<AmongLeaders>> exchanges(flats.size());
  for (size_t i = 0; i < flats.size(); ++i) {
    reduce_opts.rootRank = local_leader(positions[i]);
    std::vector<at::Tensor> one{flats[i]};
    local_->reduce(one, reduce_opts)->wait();
    if (!leads(positions[i])) continue;
    exchanges[i] = among_leaders(positions[i], {flats[i]}, agreed,
                                 [&](c10d::Backend& engine, std::vector<at::Tensor>& pack) {
      return engine.allreduce(pack, across);
    }, across.reduceOp.op_);
  }
  auto copy_back = stage_options<c10d::BroadcastOptions>(timeout);
  for (size_t i = 0; i < flats.size(); ++i) {
    if (exchanges[i]) {
      exchanges[i]->finish();
      if (op == c10d::ReduceOp::AVG) flats[i].div_(getSize());
    }
    copy_back.rootRank = local_leader(positions[i]);
    std::vector<at::Tensor> one{flats[i]};
    local_->broadcast(one, copy_back)->wait();
  }
  agreed.settle_all();
  for (size_t i = 0; i < packs.size(); ++i) nccl::unpack(flats[i], tensors, packs[i]);
}

c10::intrusive_ptr<c10d::Work> NodeBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  return refusing_in_node("allreduce", [&] {
    check_nonempty(tensors.size(), "the tensor list", "allreduce");
    if (is_sparse_call(tensors)) {
      CallTerms terms{"allreduce(" + tensors_text(tensors) + ", " + reduction_text(opts.reduceOp) + ")"};
      return issue("allreduce", {"allreduce", tensors, tensors}, c10d::OpType::ALLREDUCE, std::move(terms),
                   opts.asyncOp, [this, tensors, opts]() mutable {
                     return EngineCall{engine(tensors[0], "allreduce").allreduce(tensors, opts)};
                   });
    }
    CallArgs args("allreduce", tensors);
    const Scaled in_place{0, tensors.size(), false};
    args.reduce_op(opts.reduceOp, &in_place);
    check_engine_reduction(tensors, opts.reduceOp, "allreduce", /*widened=*/true);
    check_device(args.device(), "allreduce");
    auto body = [this, args, packs = make_packs(args.descs(), options_.packing), op = opts.reduceOp,
                 timeout = timeout_or_default(opts.timeout)] {
      args.premultiply();
      allreduce_stages(args.dense(), packs, staged_op(args, op), timeout,
                       "allreduce(" + args.text(0, args.descs().size()) + ", " + reduction_text(op) + ")");
      args.write_back();
    };
    return record({"allreduce", tensors, tensors}, opts.asyncOp,
                  [&] { return launch(c10d::OpType::ALLREDUCE, args, tensors, std::move(body), opts.asyncOp); });
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> NodeBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  return refusing_in_node("broadcast", [&] {
    check_nonempty(tensors.size(), "the tensor list", "broadcast");
    check_rank(opts.rootRank, getSize(), "src", "broadcast");
    CallArgs args("broadcast", tensors);
    check_device(args.device(), "broadcast");
    auto body = [this, args, src = static_cast<int>(opts.rootRank), timeout = timeout_or_default(opts.timeout)] {
      // The source leads its own node; every other node's rank at its position receives.
      const int position = root_position(nodes_, src);
      if (leads(position)) {
        c10d::BroadcastOptions across;
        across.rootRank = nodes_.node_of[src];
        across.timeout = timeout;
        auto agreed = agree_among_leaders(
            {position}, args.device(),
            "broadcast(" + args.text(0, args.descs().size()) + ", src=" + std::to_string(src) + ")");
        among_leaders(position, args.dense(), agreed, [&](c10d::Backend& engine, std::vector<at::Tensor>& tensors) {
          return engine.broadcast(tensors, across);
        }).finish();
      }
      auto inside = stage_options<c10d::BroadcastOptions>(timeout);
      inside.rootRank = local_leader(position);
      std::vector<at::Tensor> dense = args.dense();
      local_->broadcast(dense, inside)->wait();
      args.write_back();
    };
    return record({"broadcast", tensors, tensors}, opts.asyncOp,
                  [&] { return launch(c10d::OpType::BROADCAST, args, tensors, std::move(body), opts.asyncOp); });
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return refusing_in_node("reduce", [&] {
    check_nonempty(tensors.size(), "the tensor list", "reduce");
    check_rank(opts.rootRank, getSize(), "dst", "reduce");
    CallArgs args("reduce", tensors);
    const int root = static_cast<int>(opts.rootRank);
    const Scaled scaled{0, tensors.size(), getRank() != root};  // only dst's tensors change
    args.reduce_op(opts.reduceOp, &scaled);
    check_engine_reduction(tensors, opts.reduceOp, "reduce", /*widened=*/true);
    check_device(args.device(), "reduce");
    auto body = [this, args, dst = root, given_op = opts.reduceOp, timeout = timeout_or_default(opts.timeout)] {
      args.premultiply();
      const c10d::ReduceOp op = staged_op(args, given_op);
      const int position = root_position(nodes_, dst);
      auto agreed = agree_among_leaders({position}, args.device(),
                                        "reduce(" + args.text(0, args.descs().size()) + ", " +
                                            reduction_text(given_op) + ", dst=" + std::to_string(dst) + ")");
      const bool relays = leads(position) && getRank() != dst;  // a leader of another node
      // A relaying leader reduces into scratch copies: only dst's tensors change.
      std::vector<at::Tensor> partial;
      for (const auto& t : args.dense()) partial.push_back(relays ? t.clone() : t);
      auto inside = stage_options<c10d::ReduceOptions>(timeout);
      inside.reduceOp = nccl::engine_op(op);
      inside.rootRank = local_leader(position);
      local_->reduce(partial, inside)->wait();
      if (leads(position)) {
        c10d::ReduceOptions across;
        across.reduceOp = nccl::engine_op(op);
        across.rootRank = nodes_.node_of[dst];
        across.timeout = timeout;
        among_leaders(position, partial, agreed, [&](c10d::Backend& engine, std::vector<at::Tensor>& tensors) {
          return engine.reduce(tensors, across);
        }, across.reduceOp.op_).finish();
      }
      if (getRank() == dst) {
        if (op == c10d::ReduceOp::AVG) {
          for (auto& t : partial) t.div_(getSize());
        }
        args.write_back();
      }
    };
    return record({"reduce", tensors, tensors}, opts.asyncOp,
                  [&] { return launch(c10d::OpType::REDUCE, args, tensors, std::move(body), opts.asyncOp); });
  });
}

void NodeBackend::reduce_scatter_stages(at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op,
                                        std::chrono::milliseconds timeout, LeadersAgreement& agreed) {
  const int64_t k = output.numel();
  std::vector<at::Tensor> whole{input.clone()};
  auto inside = stage_options<c10d::ReduceOptions>(timeout);
  inside.reduceOp = nccl::engine_op(op);
  inside.rootRank = local_leader(0);
  local_->reduce(whole, inside)->wait();
  at::Tensor blocks;  // on a leader: its node's ranks' blocks, reduced over every node
  if (leads(0)) {
    const at::Tensor rows = whole[0].view({getSize(), k});
    c10d::ReduceOptions across;
    across.reduceOp = nccl::engine_op(op);
    across.timeout = timeout;
    std::vector<AmongLeaders> reductions;
    for (int m = 0; m < nodes_.count(); ++m) {
      const auto& members = nodes_.members[m];
      at::Tensor part = rows.index_select(0, rows_on(std::vector<int64_t>(members.begin(), members.end()), rows));
      across.rootRank = m;
      reductions.push_back(among_leaders(0, {part}, agreed,
                                         [&](c10d::Backend& engine, std::vector<at::Tensor>& tensors) {
        return engine.reduce(tensors, across);
      }, across.reduceOp.op_));
      if (m == node()) blocks = part;
    }
    for (auto& r : reductions) r.finish();
    if (op == c10d::ReduceOp::AVG) blocks.div_(getSize());
  }
  auto scatter = stage_options<c10d::ScatterOptions>(timeout);
  scatter.rootRank = local_leader(0);
  std::vector<at::Tensor> mine{output};
  std::vector<std::vector<at::Tensor>> per_rank;
  if (leads(0)) per_rank.push_back(blocks.unbind(0));  // a row per rank of this node (none wider: k may be 0)
  local_->scatter(mine, per_rank, scatter)->wait();
}

void NodeBackend::allgather_stages(at::Tensor& output, at::Tensor& input, std::chrono::milliseconds timeout,
                                   LeadersAgreement& agreed) {
  const int64_t k = input.numel();
  const int here = static_cast<int>(nodes_.members[node()].size());
  at::Tensor node_blocks = at::empty({here * k}, input.options());
  local_->_allgather_base(node_blocks, input, stage_options<c10d::AllgatherOptions>(timeout))->wait();
  if (leads(0)) {
    // Nodes may differ in size: each leader sends its node's blocks padded to the largest node.
    const int64_t widest = nodes_.positions();
    at::Tensor padded = at::empty({widest * k}, input.options());
    padded.narrow(0, 0, here * k).copy_(node_blocks);
    at::Tensor every = at::empty({nodes_.count() * widest * k}, input.options());
    c10d::AllgatherOptions across;
    across.timeout = timeout;
    among_leaders(0, {every, padded}, agreed, [&](c10d::Backend& engine, std::vector<at::Tensor>& tensors) {
      return engine._allgather_base(tensors[0], tensors[1], across);
    }).finish();
    std::vector<int64_t> order;  // where rank r's block sits in `every`
    for (int r = 0; r < getSize(); ++r) order.push_back(nodes_.node_of[r] * widest + nodes_.local_rank[r]);
    output.view({getSize(), k}).copy_(every.view({nodes_.count() * widest, k}).index_select(0, rows_on(order, every)));
  }
  auto inside = stage_options<c10d::BroadcastOptions>(timeout);
  inside.rootRank = local_leader(0);
  std::vector<at::Tensor> one{output};
  local_->broadcast(one, inside)->wait();
}

c10::intrusive_ptr<c10d::Work> NodeBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  return refusing_in_node("allgather", [&] {
    if (uneven_list(outputs, inputs.size())) return allgather_by_engine(outputs, inputs, opts);
    CallArgs args = allgather_list_args(outputs, inputs, getRank(), getSize());
    auto& list = outputs[0];
    const size_t input = list.size();
    const int64_t k = static_cast<int64_t>(args.descs()[input].numel);
    check_device(args.device(), "allgather");
    auto body = [this, args, input, k, timeout = timeout_or_default(opts.timeout)] {
      auto agreed = agree_among_leaders({0}, args.device(), "all_gather(" + args.text(0, args.descs().size()) + ")");
      at::Tensor in = args.dense()[input];
      at::Tensor flat = at::empty({getSize() * k}, in.options());
      allgather_stages(flat, in, timeout, agreed);
      for (size_t j = 0; j < input; ++j) args.dense()[j].view(-1).copy_(flat.narrow(0, j * k, k));
      args.write_back();
    };
    return record({"all_gather", inputs, list}, opts.asyncOp,
                  [&] { return launch(c10d::OpType::ALLGATHER, args, list, std::move(body), opts.asyncOp); });
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  return refusing_in_node("allgather_into_tensor", [&] {
    std::vector<at::Tensor> outputs{output}, inputs{input};
    return allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  return refusing_in_node("allgather_into_tensor", [&] {
    CallArgs args = allgather_tensor_args(outputs, inputs, getRank(), getSize());
    const size_t n = outputs.size();
    check_device(args.device(), "allgather_into_tensor");
    auto body = [this, args, n, timeout = timeout_or_default(opts.timeout)] {
      auto agreed = agree_among_leaders({0}, args.device(),
                                        "all_gather_into_tensor(" + args.text(0, args.descs().size()) + ")");
      for (size_t i = 0; i < n; ++i) {
        at::Tensor out = args.dense()[i].view(-1), in = args.dense()[n + i].view(-1);
        allgather_stages(out, in, timeout, agreed);
      }
      args.write_back();
    };
    return record({"allgather_into_tensor_coalesced", inputs, outputs}, opts.asyncOp,
                  [&] { return launch(c10d::OpType::_ALLGATHER_BASE, args, outputs, std::move(body), opts.asyncOp); });
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  return refusing_in_node("reduce_scatter", [&] {
    if (uneven_list(inputs, outputs.size())) return reduce_scatter_by_engine(outputs, inputs, opts);
    StackedInputs stacked = stacked_reduce_scatter_inputs(outputs, inputs, getRank(), getSize());
    std::vector<at::Tensor> ins{stacked.tensor};
    return reduce_scatter_staged(outputs, ins, opts, {"reduce_scatter", flattened(inputs), outputs},
                                 c10d::OpType::REDUCE_SCATTER, "reduce_scatter");
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  return refusing_in_node("reduce_scatter_tensor", [&] {
    std::vector<at::Tensor> outputs{output}, inputs{input};
    return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::ReduceScatterOptions& opts) {
  return refusing_in_node("reduce_scatter_tensor", [&] {
    return reduce_scatter_staged(outputs, inputs, opts, {"reduce_scatter_tensor_coalesced", inputs, outputs},
                                 c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor");
  });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::reduce_scatter_staged(std::vector<at::Tensor>& outputs,
                                                                  std::vector<at::Tensor>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts,
                                                                  const CommsCall& call, c10d::OpType type,
                                                                  const char* name) {
  CallArgs args = reduce_scatter_tensor_args(outputs, inputs, getRank(), getSize(), name);
  const size_t n = outputs.size();
  const Scaled copies_of_inputs{n, inputs.size(), true};
  args.reduce_op(opts.reduceOp, &copies_of_inputs);
  check_engine_reduction(inputs, opts.reduceOp, name, /*widened=*/true);
  check_device(args.device(), name);
  auto body = [this, args, n, op = opts.reduceOp, timeout = timeout_or_default(opts.timeout)] {
    args.premultiply();
    auto agreed = agree_among_leaders(
        {0}, args.device(), "reduce_scatter(" + args.text(0, args.descs().size()) + ", " + reduction_text(op) + ")");
    for (size_t i = 0; i < n; ++i) {
      at::Tensor out = args.dense()[i].view(-1);
      reduce_scatter_stages(out, args.dense()[n + i].view(-1), staged_op(args, op), timeout, agreed);
    }
    args.write_back();
  };
  return record(call, opts.asyncOp, [&] { return launch(type, args, outputs, std::move(body), opts.asyncOp); });
}

c10::intrusive_ptr<c10d::Work> NodeBackend::barrier(const c10d::BarrierOptions& opts) {
  const CallArgs args("barrier", {});
  auto body = [this, timeout = timeout_or_default(opts.timeout)] {
    auto agreed = agree_among_leaders({0}, at::kCPU, "barrier()");
    const auto inside = stage_options<c10d::BarrierOptions>(timeout);
    local_->barrier(inside)->wait();
    if (leads(0)) {
      c10d::BarrierOptions across;
      across.timeout = timeout;
      among_leaders(0, {}, agreed,
                    [&](c10d::Backend& engine, std::vector<at::Tensor>&) { return engine.barrier(across); })
          .finish();
    }
    local_->barrier(inside)->wait();
  };
  return record({"barrier", {}, {}}, opts.asyncOp,
                [&] { return launch(c10d::OpType::BARRIER, args, {}, std::move(body), opts.asyncOp); });
}

}  // namespace hca
