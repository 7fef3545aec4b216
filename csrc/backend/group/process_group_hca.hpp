// ProcessGroupHCA: the c10d backend "hca" for hierarchical_copy and
// reduce_to_one_device. It reads each call's arguments once, asks the plan for
// packs and schedules, and hands the collective to the executor of the
// tensors' device, in call order, on its work queue.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "../../plan/plan.h"
#include "../../transport/control/control_block.h"
#include "../../transport/cuda/cuda_executor.h"
#include "../../transport/executor.h"
#include "../../transport/shm/mailbox.h"
#include "../c10d_overrides.hpp"
#include "../calls/call_args.hpp"
#include "../calls/call_record.hpp"
#include "../calls/stream_call.hpp"
#include "../calls/work_hca.hpp"
#include "group_life.hpp"
#include "plan_cache.hpp"
#include "store_rendezvous.hpp"

namespace hca {

// What runs collectives on CPU tensors: the shared-memory executor, or the
// stream executor over host threads (for tests of the logic CUDA shares with it).
enum class CpuExecutor { SharedMemory, HostStreams };

class ProcessGroupHCA : public c10d::Backend {
 public:
  // An all-reduce's choice per call, and the cost model it came from (JSON, for
  // torch_hca.explain).
  struct ChoiceTable {
    std::vector<SizeChoice> by_size;
    std::string cost_model;
  };
  // The choices by the world size of the group they serve, so that a child
  // split off finds its own size's (none for a size they lack). CPU tensors'
  // also by whether the ranks have fewer CPUs between them than ranks (they
  // take turns), counted from each rank's CPUs so that a child counts its own.
  struct ChoiceTables {
    std::map<std::pair<int, bool>, ChoiceTable> cpu;
    std::vector<std::vector<int>> cpus_of_ranks;
    std::map<int, ChoiceTable> cuda_sharing_one_gpu;  // ranks that all share one GPU
    std::map<int, ChoiceTable> cuda_gpu_per_rank;     // a GPU per rank, every one a peer of every other
  };
  // `options` must have been validated (validate(options, size) runs again here);
  // they serve CPU tensors, their choice per call `tables.cpu`'s of this size and CPUs
  // where it has tables (else the options' own). CUDA tensors follow them but
  // for their groups, `cuda_groups` (empty: the same), and their choice per
  // call: none (the options' algorithm and packing) until the group's first
  // CUDA collective asks which GPU each rank's tensors are on (settle_cuda_choice);
  // then `tables.cuda_sharing_one_gpu`'s of this size where all are on one GPU,
  // `tables.cuda_gpu_per_rank`'s where each is on a GPU of its own.
  ProcessGroupHCA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout, PlanOptions options, size_t shm_slot_bytes, int shm_slots,
                  cuda::CudaConfig cuda_config, CpuExecutor cpu_executor = CpuExecutor::SharedMemory,
                  Groups cuda_groups = {}, ChoiceTables tables = {});
  ~ProcessGroupHCA() override;

  const std::string getBackendName() const override { return "hca"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  // ProcessGroup::splitGroup: a child over `ranks` (of this group), meeting on this group's
  // store (not the one torch names, see split), with this group's options, staging sizes and
  // executor, its groups those of this group restricted to the child's ranks; nullptr on a rank
  // outside `ranks`.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  // dist.shrink_group, called by the ranks that stay (the excluded ones may be
  // dead): a child over them, as split's, meeting on this group's store; with
  // SHRINK_ABORT this group is aborted first. `opts` may set the child's timeout.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                           const c10::intrusive_ptr<Options>& opts) override;
  const PlanOptions& options() const { return options_; }
  // The table that chooses all-reduces per call for CPU or CUDA tensors (empty: none).
  std::vector<SizeChoice> by_size(bool cuda) const;
  // Every rank tells the others the GPU its CUDA tensors are on (`gpu()`, its
  // UUID) and, where all name one GPU, CUDA tensors take the table of ranks
  // sharing one. Once per group (later calls return at once; one that failed
  // is not counted), at its first CUDA collective that plans with the options:
  // every rank plans its collectives in one order, so all ask at the same call
  // and choose alike. Tests call it first, with made-up GPUs.
  void settle_cuda_choice(const std::function<std::string()>& gpu);
  // The hierarchy's groups that plans for CPU or CUDA tensors follow.
  const Groups& groups(bool cuda) const { return cuda ? cuda_options_.groups : options_.groups; }
  // How the groups were found, for `torch_hca.hierarchy` (set once, by whoever made the group).
  const std::string& hierarchy() const { return hierarchy_; }
  void set_hierarchy(std::string text) { hierarchy_ = std::move(text); }
  // The cost model that chose its CPU tensors' packs per call, for `torch_hca.explain`
  // (JSON, "null" for none). CUDA's follows from by_size(true).
  const std::string& cpu_cost_model() const { return cpu_cost_model_; }
  std::string cuda_cost_model() const;
  // Where CPU or CUDA tensors are staged, in words; empty before the first
  // collective that sets it up, in a build without CUDA, and once the group ended.
  std::string staging(bool cuda);
  // Bytes of a rank's staging slot for CPU or CUDA tensors; 0 where staging() is empty.
  size_t staging_slot_bytes(bool cuda);
  // Waits on peers' progress words this rank's stream executor issued for CPU or CUDA tensors.
  uint64_t peer_waits(bool cuda);
  // Tests: this rank's words in the control block and its channels scribbled
  // over (a hostile or broken peer); see ControlBlock / Mailbox::scribble_for_test.
  void scribble_for_test(uint64_t seed) {
    const auto call = life_.enter("scribble_for_test");
    control_->scribble_for_test(seed);
    mailbox_->scribble_for_test(seed);
  }
  // Tests: the CPU `rank` said last that it runs on (-1: none yet); see ControlBlock's RankSlot.
  int cpu_said_by(int rank) {
    const auto call = life_.enter("cpu_said_by");
    TORCH_CHECK(rank >= 0 && rank < control_->world(), "no rank ", rank, " in a group of ", control_->world());
    return control_->cpu_said_by(rank);
  }
  // Tests: bytes of /dev/shm this group's point-to-point channels hold now.
  size_t p2p_reserved_bytes() {
    const auto call = life_.enter("p2p_reserved_bytes");
    return mailbox_->reserved_bytes();
  }
  // Breaks the group with `cause` (the first one wins): peers waiting on this
  // rank raise it, and this rank's later calls say the group is unusable. For
  // failures outside the node's media, e.g. of the stage between nodes.
  void fail(FailureKind kind, const std::string& cause);
  // Raises the failure that broke the group on this rank, if any, naming `op` (the group
  // across nodes asks before each call: its leaders would otherwise wait between nodes for
  // peers that gave up).
  void check_usable(const char* op);
  // The timeout of later calls without one of their own (as gloo's).
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = checked_timeout(timeout, "setTimeout");
    calls_.set_timeout(timeout);
  }
  // destroy_process_group calls shutdown: what is queued runs to its end, then
  // the threads are joined and the segments unmapped, even if the group is
  // still referenced (a DDP model in scope); peers waiting on this rank learn
  // that it left. abort: the same, but what is in flight or queued fails at
  // once, and peers learn that this rank aborted. Later calls raise.
  void shutdown() override { end(false); }
  void abort() override { end(true); }
  // The kind of this rank's first failure in the group, as torch names it: TIMEOUT,
  // REMOTE_ERROR (a peer died, failed or left), COMM_ERROR (anything else, an abort
  // included); SUCCESS while there is none.
  c10d::ErrorType getError() override;

  HCA_OVERRIDE_COLLECTIVES
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  // gather_scatter.cpp; point_to_point.cpp: through the mailbox, independent of the collective queue.
  HCA_OVERRIDE_GATHERS_AND_MESSAGES

  // Counts the collectives and messages issued since the last reset.
  void setSequenceNumberForGroup() override { calls_.reset(); }
  uint64_t getSequenceNumberForGroup() override { return calls_.issued(); }
  // Where this group's ranks are in the world (for profiler traces).
  CallRecorder& calls() { return calls_; }
  HCA_OVERRIDE_COMPLETION_HOOKS
  // The coalescing manager batches in Python (allreduce_coalesced etc.) and
  // waits on the Work that ends the window, not on the window's own calls: it
  // stands for them all (window_work.hpp). Not declared for batch_isend_irecv
  // (supportsCoalescing): one Work for the batch measured 4-33 us slower than a
  // Work per message (docs/architecture.md).
  void startCoalescing() override { calls_.open_window(); }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // TORCH_HCA_SELF_TEST is not "0" (read once, at the group's creation: not on
  // every call; the ranks' settings are compared before that).
  static bool self_test_wanted();
  // Whether its CPU tensors go through the CPU model of the device (TORCH_HCA_CPU_EXECUTOR=streams).
  bool cpu_on_model() const { return cpu_executor_kind_ == CpuExecutor::HostStreams; }
  // Tells the peers that this rank refused the collective `op` at the call, `why` (refusal.hpp):
  // an empty collective in the call's turn, whose signature says so. Never throws (a group that
  // has ended or failed has told its peers already).
  void refuse(const char* op, const std::string& why) noexcept;

 private:
  // `ask` of the CPU or CUDA executor, or `none` where there is none (yet, or any more).
  template <class T>
  T ask_staging(bool cuda, T (Executor::*ask)() const, T none);
  // torch.distributed's SHRINK_ABORT.
  static constexpr int kShrinkAbort = 1;
  // A group over `ranks` (sorted, this rank among them) of this one, on `store`: this
  // group's options, staging sizes and executor, its groups kept for those ranks, and
  // those ranks' places in the world.
  c10::intrusive_ptr<ProcessGroupHCA> child(const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::vector<int>& ranks, std::chrono::milliseconds timeout,
                                            const char* basis) const;
  // shutdown and abort, through life_.
  // `destroyed`: asked to (shutdown, abort), not by the group's destructor.
  void end(bool abort, bool destroyed = true);
  // `call()`, one of the collectives: refused in its turn where it raises bad input at the call.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> refusing(const char* op, Call&& call) {
    return refused_at_the_call([this, op](const std::string& why) { refuse(op, why); }, std::forward<Call>(call));
  }
  // The executor of `device`'s tensors, chosen here and nowhere else;
  // NotImplementedError naming the device where this build has none.
  Executor& executor_for(const at::Device& device, const char* op);
  // Queues `collectives` (which address args' dense tensors) as one Work.
  // `internal_title`: one of hca's own calls (the self-test, a count exchange),
  // named so in the profiler (static text) and not numbered among the user's.
  // `before`: what the Work runs first, on the group's worker (the barrier's drains).
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, CallArgs args, std::vector<Collective> collectives,
                                        std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                                        bool async_op, const char* internal_title = nullptr,
                                        std::function<void()> before = nullptr);
  // launch() for a stream executor (CUDA tensors; CPU tensors on the model of
  // the device): stream semantics of ProcessGroupNCCL (stream_call.cpp).
  c10::intrusive_ptr<c10d::Work> launch_on_stream(c10d::OpType type, Executor& executor, CallArgs args,
                                                  std::vector<Collective> collectives,
                                                  std::vector<at::Tensor> outputs, bool async_op,
                                                  const char* internal_title, std::function<void()> before);
  // On the caller's thread, for a barrier: a Work step that returns once this
  // rank's device work issued before the barrier has finished, on every device
  // the group has issued calls on (its calls there, and the caller's current
  // stream), or raises after `timeout`; null without such a device.
  std::function<void()> drain_devices(std::chrono::milliseconds timeout);
  // At the group's first call on a stream transport for `device`'s tensors:
  // each algorithm's all-reduce and broadcast checked on every rank
  // (self_test.cpp); DistBackendError on a wrong result, on every rank.
  void self_test_once(const at::Device& device);
  // The group's internal streams for `device`'s tensors, null where its
  // executor runs each collective to the end on the host (shared memory).
  CallStreams* call_streams(const at::Device& device);
  // The group's streams for messages of `device`'s tensors (apart from the
  // collectives': a message must not queue behind a collective waiting for a
  // peer); null where messages go from the host (CPU tensors in shared memory).
  CallStreams* message_streams(const at::Device& device) {
    return device.is_cpu() ? cpu_message_streams_.get() : device.is_cuda() ? cuda_message_streams_.get() : nullptr;
  }
  c10::intrusive_ptr<c10d::Work> post_message(c10d::OpType type, std::vector<at::Tensor>& tensors, int peer, int tag);
  c10::intrusive_ptr<c10d::Work> post_stream_message(c10d::OpType type, CallStreams& streams, CallArgs args,
                                                     std::vector<at::Tensor>& tensors, int peer, int tag);
  // allreduce of sparse COO tensors (SUM): gathers every rank's indices and values.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  // Every rank's `input` into `output`, a step of a larger call; blocking. An
  // internal call named `title` (static text) in the profiler and in errors.
  void gather_step(const at::Tensor& output, const at::Tensor& input, std::chrono::milliseconds timeout,
                   const char* title);
  // Every rank's `mine` (same length everywhere), concatenated in rank order; blocking.
  std::vector<int64_t> exchange(const std::vector<int64_t>& mine, std::chrono::milliseconds timeout);
  // The alltoall of `args` (outputs first): this rank sends sends[j] elements
  // from sources[j] to rank j and receives expects[i] at targets[i] from rank
  // i; `equal`: every rank passes the same equal counts (no exchange needed).
  c10::intrusive_ptr<c10d::Work> launch_alltoall(c10d::OpType type, CallArgs args, const std::vector<int64_t>& sends,
                                                 const std::vector<int64_t>& expects, bool equal,
                                                 const std::vector<const void*>& sources,
                                                 const std::vector<void*>& targets, std::vector<at::Tensor> outputs,
                                                 const c10d::AllToAllOptions& opts);
  // "allreduce(Float[10], SUM, hierarchical_copy, num_packs=1)": what every rank must agree on.
  std::string signature(const char* name, const std::string& details) const;
  // An in-place collective over every tensor of `args`, its plan and signature
  // from the cache (made by `plan` and `details` on a miss).
  Collective cached_collective(const char* name, const CallArgs& args, ReduceOp op, int64_t root,
                               const std::function<std::vector<PackPlan>()>& plan,
                               const std::function<std::string()>& details);
  Collective collective(std::vector<PackPlan> plan, std::vector<TensorSpan> spans, ReduceOp op, const char* name,
                        const std::string& details) const;
  Collective allgather_collective(const CallArgs& args, size_t output, size_t input) const;
  Collective reduce_scatter_collective(const CallArgs& args, size_t output, size_t input, ReduceOp op);
  std::chrono::milliseconds timeout_or_default(std::chrono::milliseconds timeout) const;
  // CUDA's: the choice settled first (settle_cuda_choice).
  const PlanOptions& options_for(const at::Device& device);
  void ask_where_cuda_tensors_are(const std::string& gpu);

  GroupLife life_;  // every call and every ending goes through it
  PlanOptions options_;       // CPU tensors
  PlanOptions cuda_options_;  // CUDA tensors: the same but for the groups and their table
  const ChoiceTables tables_;
  std::once_flag cuda_choice_settled_;
  // Collectives queued for the executors, in the order their control block
  // starts them (the self-test's before the call that ran it).
  std::atomic<uint64_t> collectives_issued_{0};
  mutable std::mutex cuda_choice_mutex_;  // cuda_options_.by_size, set by settle_cuda_choice
  std::string hierarchy_;
  std::string cpu_cost_model_ = "null";
  std::string cuda_cost_model_ = "null";  // the CUDA table's, once settled; under cuda_choice_mutex_
  std::atomic<std::chrono::milliseconds> timeout_;  // setTimeout may change it
  cuda::CudaConfig cuda_config_;
  size_t shm_slot_bytes_;
  int shm_slots_;
  CpuExecutor cpu_executor_kind_;
  // The last child split off, by group name: ProcessGroup::splitGroup asks each of its
  // device types (cpu and cuda: both this backend) for the same split, which is one child.
  std::string last_split_name_;
  c10::weak_intrusive_ptr<c10d::Backend> last_split_{c10::intrusive_ptr<c10d::Backend>()};
  int shrinks_ = 0;  // the children shrink made, which name their keys on the store
  std::map<std::vector<int>, int> splits_;  // children split off per set of ranks, which name their keys on the store
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<ControlBlock> control_;  // null once ended
  std::atomic<uint32_t> failure_at_end_{0};  // this rank's FailureKind when the group ended
  // Before the executors: their streams outlive what the executors issued.
  std::unique_ptr<CallStreams> cpu_call_streams_;  // with the model of the device only
  std::unique_ptr<CallStreams> cuda_call_streams_;
  std::unique_ptr<Executor> cpu_executor_;
  std::unique_ptr<Executor> cuda_executor_;  // made at the first CUDA collective
  std::mutex cuda_executor_mutex_;
  std::unique_ptr<CallStreams> cpu_message_streams_;  // with the model of the device only
  std::unique_ptr<CallStreams> cuda_message_streams_;  // null in a build without CUDA
  std::unique_ptr<shm::Mailbox> mailbox_;  // after them: its callbacks issue on them
  const bool self_test_wanted_ = self_test_wanted();
  std::recursive_mutex self_test_mutex_;  // its own collectives come back through launch()
  std::set<c10::DeviceType> self_tested_;
  PlanCache plans_;
  CallRecorder calls_;
  WorkQueue queue_;  // last: its worker stops before the executors go
};

}  // namespace hca
