// `hca` across nodes: hca's own group inside each node, existing engines
// between the nodes (never a home-made network transport). A reduction runs in
// three stages over each pack (who leads which pack: plan/nodes.h): every node
// reduces the pack into its node leader, the pack's node leaders all-reduce it
// with an engine, and each leader copies the result back inside its node.
// Broadcast, reduce, allgather and barrier take the same path; operations
// without a hierarchical form go to the engines over every rank (EngineBackend).
#pragma once
#include <atomic>
#include <map>
#include <set>

#include "../../plan/nodes.h"
#include "../c10d_overrides.hpp"
#include "../calls/call_args.hpp"
#include "../calls/work_hca.hpp"
#include "../group/process_group_hca.hpp"
#include "engine_backend.hpp"

namespace hca {

class NodeBackend : public EngineBackend {
 public:
  // `local`: hca over this rank's node. `leaders`: for each position this rank
  // leads, the engines among that position's leaders (one rank per node, in
  // node order). `world`: engines over every rank.
  NodeBackend(int rank, int size, std::chrono::milliseconds timeout, PlanOptions options, Nodes nodes,
              c10::intrusive_ptr<ProcessGroupHCA> local, std::map<int, Engines> leaders, Engines world);
  ~NodeBackend() override;
  // For every stage: the node's group, the engines among leaders and of the world.
  void setTimeout(std::chrono::milliseconds timeout) override;
  // The node's group's: a failure between nodes breaks it too.
  c10d::ErrorType getError() override {
    check_process("get_error");
    return local_->getError();
  }

  const std::string getBackendName() const override { return "hca"; }
  const Nodes& nodes() const { return nodes_; }
  const PlanOptions& options() const { return options_; }
  const c10::intrusive_ptr<ProcessGroupHCA>& local() const { return local_; }  // hca over this rank's node

  HCA_OVERRIDE_COLLECTIVES

 protected:
  // The node's group, then the engines among leaders and of the world.
  void end_parts(bool abort) override;
  void stop_queue() override { queue_.stop(); }
  WorkQueue& queue() override { return queue_; }
  // Through the node's group, which takes them as NCCL does.
  std::optional<MessageRoute> own_messages() const override {
    return MessageRoute{*local_, nodes_.local_rank[getRank()]};
  }

 private:
  int node() const { return nodes_.node_of[getRank()]; }
  // This node's leader of `position`, as a rank of the node's own group.
  int local_leader(int position) const { return nodes_.local_rank[nodes_.leader(node(), position)]; }
  bool leads(int position) const { return nodes_.leader(node(), position) == getRank(); }
  // The leaders' agreement on one call (its text: the op, the tensors, the root, the
  // reduction): the nodes' own groups check that their ranks agree, but not that the
  // nodes do, and gloo among the leaders aborts the process where they do not. Started
  // on each engine among leaders that this rank uses for the call and gloo carries,
  // before the node's own first stage, so that it runs meanwhile; settled before the
  // first exchange on that engine.
  struct LeadersAgreement {
    std::map<int, PendingAgreement> by_position;
    void settle(int position);
    void settle_all();  // those the call made no exchange on
  };
  LeadersAgreement agree_among_leaders(const std::set<int>& positions, const at::Device& device,
                                       const std::string& text) const;
  // Issues `issue` among the leaders of `position` on `tensors` (what it reads
  // and writes), once `agreed` is settled there; finish() waits for it and
  // copies host-staged results back. `reduction`: the op that `issue` reduces with, if any:
  // where gloo's MIN or MAX would drop a NaN, `issue` also carries the NaNs' places
  // (nans_go_round), which finish() puts back.
  class AmongLeaders {
   public:
    void finish();
    c10::intrusive_ptr<c10d::Work> work, mask_work;
    std::vector<at::Tensor> given, staged;
    std::vector<at::Tensor> reduced;  // where NaNs go round: gloo's tensors, and their mask
    at::Tensor nan_mask;
    c10d::ReduceOp::RedOpType reduction = c10d::ReduceOp::UNUSED;
    std::optional<WidenedForEngine> widened;  // a reduction of integers the engines have no arithmetic for
  };
  using Issue = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&, std::vector<at::Tensor>&)>;
  AmongLeaders among_leaders(int position, std::vector<at::Tensor> tensors, LeadersAgreement& agreed,
                             const Issue& issue,
                             c10d::ReduceOp::RedOpType reduction = c10d::ReduceOp::UNUSED) const;
  // The op the stages reduce with: SUM for a PREMUL_SUM, whose factor premultiply()
  // applied to this rank's tensors first (as NCCL's does), else `op`.
  static c10d::ReduceOp staged_op(const CallArgs& args, const c10d::ReduceOp& op) {
    return args.premultiplies() ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
  }
  // Whether a list form (one list of `lists`, beside `others` tensors: one) has a slot per
  // rank of several sizes, as NCCL takes them: the stages move blocks of one size, so such
  // calls go whole to the engines over every rank (allgather_by_engine, reduce_scatter_by_engine).
  bool uneven_list(const std::vector<std::vector<at::Tensor>>& lists, size_t others) const {
    return lists.size() == 1 && others == 1 && static_cast<int>(lists[0].size()) == getSize() && !one_size(lists[0]);
  }
  // `call()`, a collective, refused in its turn where it raises bad input at the call (refusal.hpp):
  // through the node's group, whose ranks then fail at once. Ranks of other nodes are not told:
  // they wait for it until the timeout, as for any failure of another node's stages.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> refusing_in_node(const char* op, Call&& call) {
    return refused_at_the_call([this, op](const std::string& why) { refuse_in_node(op, why); },
                               std::forward<Call>(call));
  }
  void refuse_in_node(const char* op, const std::string& why) noexcept;
  // NotImplementedError for tensors this build does not carry across nodes.
  void check_device(const at::Device& device, const char* op) const;

  // The three stages of an allreduce of dense `tensors` cut into `packs`, each
  // led from its pack position; AVG sums and divides once, on the leaders.
  void allreduce_stages(const std::vector<at::Tensor>& tensors, const std::vector<Pack>& packs, c10d::ReduceOp op,
                        std::chrono::milliseconds timeout, const std::string& text);
  // reduce_scatter of one dense input of world blocks: the node reduces it into
  // its leader of position 0, the leaders reduce each node's blocks into that
  // node's leader, which scatters them inside its node.
  void reduce_scatter_stages(at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op,
                             std::chrono::milliseconds timeout, LeadersAgreement& agreed);
  // reduce_scatter_tensor_coalesced's stages, for it and for the list form (its inputs
  // stacked): `call`, `type` and `name` are the form's, for the profiler and in errors.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_staged(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::ReduceScatterOptions& opts, const CommsCall& call,
                                                       c10d::OpType type, const char* name);
  // allgather of one dense input into one dense output of world blocks.
  void allgather_stages(at::Tensor& output, at::Tensor& input, std::chrono::milliseconds timeout,
                        LeadersAgreement& agreed);
  // Queues `body` over the call's tensors (for CUDA tensors, issued on an
  // internal stream with ProcessGroupNCCL's semantics); a failure breaks the
  // node's group (its ranks stop waiting on this one) and surfaces as
  // DistBackendError naming the op and this node.
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const CallArgs& args, std::vector<at::Tensor> outputs,
                                        std::function<void()> body, bool async_op);
  std::chrono::milliseconds timeout_or_default(std::chrono::milliseconds timeout) const {
    return timeout == c10d::kUnsetTimeout ? timeout_.load() : timeout;
  }

  std::atomic<std::chrono::milliseconds> timeout_;
  PlanOptions options_;
  Nodes nodes_;
  c10::intrusive_ptr<ProcessGroupHCA> local_;
  std::map<int, Engines> leaders_;
  WorkQueue queue_;  // last: its worker stops before the groups go
};

}  // namespace hca
