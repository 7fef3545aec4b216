#include "process_group_hca.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <functional>
#include <set>

#include "host_heap.hpp"
#include "../../transport/rendezvous.h"
#include "../../transport/shm/shm_executor.h"
#include "../../transport/stream/host_streams.h"
#include "../../transport/stream/staging_place.h"
#ifdef HCA_WITH_CUDA
#include "../../transport/cuda/cuda_runtime.h"
#endif

namespace hca {
namespace {

// Whether ranks with these CPUs (each rank's) have fewer CPUs between them than ranks.
bool fewer_cpus_than_ranks(const std::vector<std::vector<int>>& cpus_of_ranks) {
  std::set<int> cpus;
  for (const auto& mine : cpus_of_ranks) cpus.insert(mine.begin(), mine.end());
  return cpus.size() < cpus_of_ranks.size();
}

}  // namespace

ProcessGroupHCA::ProcessGroupHCA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout, PlanOptions options, size_t shm_slot_bytes,
                                 int shm_slots, cuda::CudaConfig cuda_config, CpuExecutor cpu_executor,
                                 Groups cuda_groups, ChoiceTables tables)
    : c10d::Backend(rank, size),
      options_(std::move(options)),
      tables_(std::move(tables)),
      timeout_(timeout),
      cuda_config_(cuda_config),
      shm_slot_bytes_(shm_slot_bytes),
      shm_slots_(shm_slots),
      cpu_executor_kind_(cpu_executor),
      store_(store) {
  raise_heap_thresholds();
  calls_.set_timeout(timeout);
  if (!tables_.cpu.empty()) {
    TORCH_CHECK_VALUE(tables_.cpus_of_ranks.size() == static_cast<size_t>(size), "hca: CPU tables need the CPUs of each of ",
                      size, " ranks, got ", tables_.cpus_of_ranks.size());
    const auto own = tables_.cpu.find({size, fewer_cpus_than_ranks(tables_.cpus_of_ranks)});
    const ChoiceTable table = own == tables_.cpu.end() ? ChoiceTable{{}, "null"} : own->second;
    options_.by_size = table.by_size;
    cpu_cost_model_ = table.cost_model;
  }
  cuda_options_ = options_;
  if (!cuda_groups.empty()) cuda_options_.groups = std::move(cuda_groups);
  // The CPU path's choice per call does not hold for devices: theirs is measured apart.
  cuda_options_.by_size.clear();
  try {
    validate(options_, size);
    validate(cuda_options_, size);
    for (const auto* tables : {&tables_.cuda_sharing_one_gpu, &tables_.cuda_gpu_per_rank}) {
      const auto table = tables->find(size);
      if (table != tables->end()) {  // refused now, not at the first CUDA collective
        PlanOptions chosen = cuda_options_;
        chosen.by_size = table->second.by_size;
        validate(chosen, size);
      }
    }
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  StoreRendezvous rendezvous(store);
  try {
    control_ = std::make_unique<ControlBlock>(rendezvous, rank, size, timeout);
    cuda_message_streams_ = make_cuda_call_streams();  // creates streams at its first call only
    if (cpu_executor == CpuExecutor::HostStreams) {
      cpu_call_streams_ = make_model_call_streams();
      cpu_message_streams_ = make_model_call_streams();
      cpu_executor_ = make_host_stream_executor(*control_, std::make_shared<StoreRendezvous>(store_),
                                                RingLayout{shm_slot_bytes, shm_slots});
    } else {
      cpu_executor_ = std::make_unique<shm::ShmExecutor>(*control_, rendezvous, shm_slot_bytes, shm_slots, timeout);
    }
    mailbox_ = std::make_unique<shm::Mailbox>(*control_, rendezvous, shm::Mailbox::ring_bytes_for(size), timeout);
  } catch (const std::exception& e) {
    publish_setup_failure(rendezvous, rank, e.what());
    throw;
  }
}

ProcessGroupHCA::~ProcessGroupHCA() {
  if (life_.owner().is_current()) {
    end(false, false);  // a no-op after shutdown or abort
    return;
  }
  // A forked child: the threads, the store and the words of the shared segments
  // are the parent's, still in use; the child leaves them alone.
  leave_in_child(mailbox_);
  leave_in_child(cuda_message_streams_);
  leave_in_child(cpu_message_streams_);
  leave_in_child(cuda_executor_);
  leave_in_child(cpu_executor_);
  leave_in_child(cuda_call_streams_);
  leave_in_child(cpu_call_streams_);
  leave_in_child(control_);
  leave_in_child(store_);
}

void ProcessGroupHCA::fail(FailureKind kind, const std::string& cause) {
  if (auto call = life_.try_enter()) control_->publish_failure(Failure(kind, "", getRank(), cause));
}

void ProcessGroupHCA::check_usable(const char* op) {
  if (auto call = life_.try_enter()) control_->check_usable(op);
}

void ProcessGroupHCA::end(bool abort, bool destroyed) {
  const std::string rank = "rank " + std::to_string(getRank());
  life_.end(
      abort,
      // Published first: this rank's waits and streams, on any thread, give up at once.
      [&] { control_->publish_failure(Failure(FailureKind::Aborted, "", getRank(), rank + " aborted its process group")); },
      [&] {
        queue_.stop();
        if (!abort) mailbox_->finish_sends();  // an abort fails them instead
      },
      [&] {
        mailbox_.reset();  // fails the messages still pending
        cuda_message_streams_.reset();
        cpu_message_streams_.reset();
        cuda_executor_.reset();
        cpu_executor_.reset();
        cuda_call_streams_.reset();
        cpu_call_streams_.reset();
        control_->mark_left(destroyed);  // what peers still waiting on this rank are told
        failure_at_end_ = control_->failure_word(getRank()).load();
        control_.reset();
      });
}

c10d::ErrorType ProcessGroupHCA::getError() {
  life_.owner().check("get_error");
  uint32_t word = failure_at_end_.load();
  if (auto call = life_.try_enter()) word = control_->failure_word(getRank()).load();
  return error_type(word);
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupHCA::getBackendOptions() {
  return c10::make_intrusive<Options>(getBackendName(), timeout_.load());
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupHCA::split(const c10::intrusive_ptr<c10d::Store>& /*store*/,
                                                         const std::vector<int>& ranks,
                                                         const c10::intrusive_ptr<Options>& opts) {
  life_.enter("split");
  if (opts && !opts->group_name.empty() && opts->group_name == last_split_name_) {
    if (auto same = last_split_.lock()) return same;
  }
  std::vector<int> sorted(ranks);
  std::sort(sorted.begin(), sorted.end());
  if (!std::binary_search(sorted.begin(), sorted.end(), getRank())) return nullptr;
  for (int r : sorted) check_rank(r, getSize(), "ranks", "split");
  // Not on `store`: torch names it after the child's group name, which dist.split_group hashes
  // with how many groups the rank knows (a rank left out of an earlier new_group knows fewer), so
  // ranks of one child may get different stores. The child meets on this group's store instead,
  // under its ranks and how many times this group split them off, which its ranks count alike.
  std::string key = "hca_split/";
  for (int r : sorted) key += std::to_string(r) + ",";
  key += "/" + std::to_string(++splits_[sorted]) + "/";
  auto group = child(c10::make_intrusive<c10d::PrefixStore>(key, store_), sorted,
                     opts ? opts->timeout : timeout_.load(), "split");
  last_split_name_ = opts ? opts->group_name : "";
  last_split_ = c10::weak_intrusive_ptr<c10d::Backend>(group);
  return group;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupHCA::shrink(const std::vector<int64_t>& ranks_to_exclude,
                                                          int shrink_flags, const c10::intrusive_ptr<Options>& opts) {
  life_.enter("shrink");
  std::vector<int> kept;
  for (int r = 0; r < getSize(); ++r) {
    if (std::find(ranks_to_exclude.begin(), ranks_to_exclude.end(), r) == ranks_to_exclude.end()) kept.push_back(r);
  }
  TORCH_CHECK_VALUE(std::binary_search(kept.begin(), kept.end(), getRank()), "hca shrink: rank ", getRank(),
                    " is excluded; only the ranks that stay call shrink");
  // The excluded ranks take no part: the child meets on this group's store,
  // under a key every staying rank counts alike.
  auto store = c10::make_intrusive<c10d::PrefixStore>("hca_shrink/" + std::to_string(++shrinks_) + "/", store_);
  const auto timeout = opts ? opts->timeout : timeout_.load();
  if (shrink_flags & kShrinkAbort) abort();  // what is in flight fails now, not at its timeout
  return child(store, kept, timeout, "shrink");
}

c10::intrusive_ptr<ProcessGroupHCA> ProcessGroupHCA::child(const c10::intrusive_ptr<c10d::Store>& store,
                                                           const std::vector<int>& ranks,
                                                           std::chrono::milliseconds timeout, const char* basis) const {
  PlanOptions options = options_;
  options.groups = restrict_groups(options_.groups, ranks);
  // The same reducing rank where the child has it, else the child's default.
  const auto reducer = std::find(ranks.begin(), ranks.end(), options_.reduce_to_device);
  options.reduce_to_device = reducer == ranks.end() ? -1 : static_cast<int>(reducer - ranks.begin());
  const int rank = static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), getRank()) - ranks.begin());
  // The tables by world size and CPUs: the child takes its own, from its own ranks' CPUs.
  ChoiceTables tables = tables_;
  if (!tables.cpus_of_ranks.empty()) {
    tables.cpus_of_ranks.clear();
    for (int r : ranks) tables.cpus_of_ranks.push_back(tables_.cpus_of_ranks[r]);
  }
  auto group = c10::make_intrusive<ProcessGroupHCA>(store, rank, static_cast<int>(ranks.size()), timeout,
                                                    std::move(options), shm_slot_bytes_, shm_slots_, cuda_config_,
                                                    cpu_executor_kind_, restrict_groups(cuda_options_.groups, ranks),
                                                    std::move(tables));
  std::string parent_ranks;
  for (int r : ranks) parent_ranks += (parent_ranks.empty() ? "" : ",") + std::to_string(r);
  const std::string how = std::string(R"({"groups": [], "basis": ")") + basis +
                          R"(", "reason": "the parent group's, kept for its ranks )" + parent_ranks + R"("})";
  group->set_hierarchy(R"({"cpu": )" + how + R"(, "cuda": )" + how + R"(, "places": null})");
  // Its ranks in the world, from this group's (none known: this group is the world).
  std::vector<int64_t> global;
  for (int r : ranks) global.push_back(calls_.global_ranks().empty() ? r : calls_.global_ranks()[r]);
  group->calls_.set_global_ranks(global);
  return group;
}

const PlanOptions& ProcessGroupHCA::options_for(const at::Device& device) {
  if (!device.is_cuda()) return options_;
#ifdef HCA_WITH_CUDA
  settle_cuda_choice([&] { return cuda::device_uuid(device.index()); });
#endif
  return cuda_options_;
}

void ProcessGroupHCA::settle_cuda_choice(const std::function<std::string()>& gpu) {
  std::call_once(cuda_choice_settled_, [&] { ask_where_cuda_tensors_are(gpu()); });
}

void ProcessGroupHCA::ask_where_cuda_tensors_are(const std::string& gpu) {
  const auto own_size = [&](const std::map<int, ChoiceTable>& tables) {
    const auto table = tables.find(getSize());
    return table == tables.end() ? nullptr : &table->second;
  };
  const ChoiceTable* sharing = own_size(tables_.cuda_sharing_one_gpu);
  const ChoiceTable* per_rank = own_size(tables_.cuda_gpu_per_rank);
  if (!sharing && !per_rank) return;  // alike on every rank: the same options and size
  const auto call = life_.try_enter();
  if (!call) return;  // the group ended: the collective that asked says so
  const std::string topic = "cuda_tensors_gpu";
  std::vector<std::string> gpus;
  try {
    // The store's wait keeps the deadline; a peer that died or failed ends it
    // at once, as in a collective's wait. So does a peer that started a
    // collective this rank never issued without asking first: it called
    // something else here (CPU tensors, or a collective that plans without
    // the options), and waits for this rank in vain.
    WaitContext ctx = control_->begin("which GPU each rank's CUDA tensors are on", timeout_.load(), true);
    ctx.deadline = Clock::time_point::max();
    const uint64_t issued = collectives_issued_.load();
    StoreRendezvous rendezvous(store_);
    gpus = exchange_reports(rendezvous, topic, getRank(), getSize(), gpu, timeout_.load(), [&] {
      for (int peer = 0; peer < getSize(); ++peer) {
        if (peer == getRank()) continue;
        control_->check_peer(peer, ctx);
        if (control_->started_by(peer) > issued && !rendezvous.has(report_key(topic, peer))) {
          throw Failure(FailureKind::Mismatch, ctx.operation, peer,
                        kMismatchedCalls + ("rank " + std::to_string(getRank())) +
                            "'s next collective is on CUDA tensors, but rank " + std::to_string(peer) + " called " +
                            control_->last_started_signature(peer));
        }
      }
    });
  } catch (const std::exception& e) {
    const auto* failure = dynamic_cast<const Failure*>(&e);
    const std::string message = std::string("hca: the group's first collective on CUDA tensors asks each rank which "
                                            "GPU its tensors are on, to choose its all-reduces: ") +
                                e.what();
    fail(failure ? failure->kind() : FailureKind::Timeout, message);  // peers waiting on this rank learn why
    C10_THROW_ERROR(DistBackendError, message);
  }
  const ChoiceTable* table = share_one_device(gpus) ? sharing : each_on_its_own(gpus) ? per_rank : nullptr;
  if (table) {
    std::lock_guard<std::mutex> lock(cuda_choice_mutex_);
    cuda_options_.by_size = table->by_size;
    cuda_cost_model_ = table->cost_model;
  }
}

std::string ProcessGroupHCA::cuda_cost_model() const {
  std::lock_guard<std::mutex> lock(cuda_choice_mutex_);
  return cuda_cost_model_;
}

std::vector<SizeChoice> ProcessGroupHCA::by_size(bool cuda) const {
  if (!cuda) return options_.by_size;
  std::lock_guard<std::mutex> lock(cuda_choice_mutex_);
  return cuda_options_.by_size;
}

Executor& ProcessGroupHCA::executor_for(const at::Device& device, const char* op) {
  if (device.is_cpu()) return *cpu_executor_;
#ifdef HCA_WITH_CUDA
  if (device.is_cuda()) {
    std::lock_guard<std::mutex> lock(cuda_executor_mutex_);  // two threads' first CUDA calls make one
    if (!cuda_executor_) {
      cuda_call_streams_ = make_cuda_call_streams();
      cuda_executor_ = cuda::make_cuda_executor(*control_, std::make_shared<StoreRendezvous>(store_), cuda_config_);
    }
    return *cuda_executor_;
  }
#endif
  TORCH_CHECK_NOT_IMPLEMENTED(false, "hca ", op, ": tensors on ", device,
                              " are not supported by this build (it has no executor for ", device.type(), ")");
}

template <class T>
T ProcessGroupHCA::ask_staging(bool cuda, T (Executor::*ask)() const, T none) {
  const auto call = life_.try_enter();
  if (!call) return none;
  if (!cuda) return (*cpu_executor_.*ask)();
  std::lock_guard<std::mutex> lock(cuda_executor_mutex_);
  return cuda_executor_ ? (*cuda_executor_.*ask)() : none;
}

std::string ProcessGroupHCA::staging(bool cuda) { return ask_staging(cuda, &Executor::staging, std::string()); }

size_t ProcessGroupHCA::staging_slot_bytes(bool cuda) {
  return ask_staging(cuda, &Executor::staging_slot_bytes, size_t{0});
}

uint64_t ProcessGroupHCA::peer_waits(bool cuda) { return ask_staging(cuda, &Executor::peer_waits, uint64_t{0}); }

CallStreams* ProcessGroupHCA::call_streams(const at::Device& device) {
  return device.is_cpu() ? cpu_call_streams_.get() : cuda_call_streams_.get();
}

std::chrono::milliseconds ProcessGroupHCA::timeout_or_default(std::chrono::milliseconds timeout) const {
  return timeout == c10d::kUnsetTimeout ? timeout_.load() : checked_timeout(timeout, "the call's options");
}

std::string ProcessGroupHCA::signature(const char* name, const std::string& details) const {
  const std::string text = std::string(name) + "(" + details + ", " +
                     (options_.by_size.empty() ? std::string(algorithm_name(options_.algorithm)) + ", num_packs=" +
                                                     std::to_string(options_.packing.num_packs)
                                               : "chosen per call") + ")";
  return fitted_text(text, 200);  // the control block's slot
}

Collective ProcessGroupHCA::collective(std::vector<PackPlan> plan, std::vector<TensorSpan> spans, ReduceOp op,
                                       const char* name, const std::string& details) const {
  return {std::make_shared<const std::vector<PackPlan>>(std::move(plan)), std::move(spans), op,
          signature(name, details)};
}

Collective ProcessGroupHCA::cached_collective(const char* name, const CallArgs& args, ReduceOp op, int64_t root,
                                              const std::function<std::vector<PackPlan>()>& plan,
                                              const std::function<std::string()>& details) {
  std::string key(name);
  key.push_back(static_cast<char>(args.device().type()));  // CPU and CUDA tensors may follow different groups
  key.push_back(static_cast<char>(op));
  key.append(reinterpret_cast<const char*>(&root), sizeof(root));
  args.append_key(key, 0, args.descs().size());
  auto entry = plans_.get(key, [&] {
    return PlanCache::Entry{std::make_shared<const std::vector<PackPlan>>(plan()), signature(name, details())};
  });
  return {std::move(entry.plan), args.in_place(0, args.descs().size()), op, std::move(entry.signature)};
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::launch(c10d::OpType type, CallArgs args,
                                                       std::vector<Collective> collectives,
                                                       std::vector<at::Tensor> outputs,
                                                       std::chrono::milliseconds timeout, bool async_op,
                                                       const char* internal_title, std::function<void()> before) {
  const auto call = life_.enter(args.name());  // held while this thread uses the group's parts
  Executor& executor = executor_for(args.device(), args.name());
  for (auto& c : collectives) {
    c.timeout = timeout;
    c.internal = internal_title != nullptr;
  }
  if (call_streams(args.device())) {
    return launch_on_stream(type, executor, std::move(args), std::move(collectives), std::move(outputs), async_op,
                            internal_title, std::move(before));
  }
  const size_t collectives_size = collectives.size();
  auto body = [&executor, collectives = std::move(collectives), args = std::move(args), before = std::move(before)] {
    if (before) before();
    args.premultiply();
    for (const auto& c : collectives) {
      try {
        executor.run(c);
      } catch (const std::runtime_error& e) {
        C10_THROW_ERROR(DistBackendError, e.what());
      }
    }
    args.write_back();
  };
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(outputs), std::move(body), nullptr,
                                           internal_title);
  collectives_issued_ += collectives_size;
  queue_.submit(work, !async_op);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  return refusing("allreduce", [&] {
    check_nonempty(tensors.size(), "the tensor list", "allreduce");
    if (is_sparse_call(tensors)) {
      return calls_(*this, {"allreduce", tensors, tensors}, opts.asyncOp,
                    [&] { return allreduce_sparse(tensors[0], opts); });
    }
    CallArgs args("allreduce", tensors);
    const Scaled in_place{0, tensors.size(), false};
    const ReduceOp op = args.reduce_op(opts.reduceOp, &in_place);
    std::vector<Collective> cs;
    cs.push_back(cached_collective(
        "allreduce", args, op, 0, [&] { return plan_allreduce(args.descs(), getSize(), options_for(args.device())); },
        [&] { return args.text(0, tensors.size()) + ", " + op_name(op); }));
    return calls_(*this, {"allreduce", tensors, tensors}, opts.asyncOp, [&] {
      return launch(c10d::OpType::ALLREDUCE, std::move(args), std::move(cs), tensors, timeout_or_default(opts.timeout),
                    opts.asyncOp);
    });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  return refusing("broadcast", [&] {
    check_nonempty(tensors.size(), "the tensor list", "broadcast");
    check_rank(opts.rootRank, getSize(), "src", "broadcast");
    CallArgs args("broadcast", tensors);
    std::vector<Collective> cs;
    const int src = static_cast<int>(opts.rootRank);
    cs.push_back(cached_collective(
        "broadcast", args, ReduceOp::Sum, src, [&] { return plan_broadcast(args.descs(), getSize(), src); },
        [&] { return args.text(0, tensors.size()) + ", src=" + std::to_string(src); }));
    return calls_(*this, {"broadcast", tensors, tensors}, opts.asyncOp, [&] {
      return launch(c10d::OpType::BROADCAST, std::move(args), std::move(cs), tensors, timeout_or_default(opts.timeout),
                    opts.asyncOp);
    });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  return refusing("reduce", [&] {
    check_nonempty(tensors.size(), "the tensor list", "reduce");
    check_rank(opts.rootRank, getSize(), "dst", "reduce");
    CallArgs args("reduce", tensors);
    const int dst = static_cast<int>(opts.rootRank);
    // PREMUL_SUM: dst's tensors take the result, so they are multiplied in place; the
    // others' stay as given (as NCCL leaves them), so theirs are multiplied into copies.
    const Scaled scaled{0, tensors.size(), getRank() != dst};
    const ReduceOp op = args.reduce_op(opts.reduceOp, &scaled);
    std::vector<Collective> cs;
    cs.push_back(cached_collective(
        "reduce", args, op, dst, [&] { return plan_reduce(args.descs(), getSize(), dst, options_for(args.device())); },
        [&] { return args.text(0, tensors.size()) + ", " + op_name(op) + ", dst=" + std::to_string(dst); }));
    return calls_(*this, {"reduce", tensors, tensors}, opts.asyncOp, [&] {
      return launch(c10d::OpType::REDUCE, std::move(args), std::move(cs), tensors, timeout_or_default(opts.timeout),
                    opts.asyncOp);
    });
  });
}

Collective ProcessGroupHCA::allgather_collective(const CallArgs& args, size_t output, size_t input) const {
  const int64_t numel = static_cast<int64_t>(args.descs()[input].numel);
  const at::Tensor& in = args.dense()[input];
  const at::Tensor& out = args.dense()[output];
  std::vector<TensorSpan> spans;
  for (int j = 0; j < getSize(); ++j) spans.push_back({in.data_ptr(), byte_offset(out, j * numel)});
  const std::vector<size_t> counts(getSize(), args.descs()[input].numel);
  return collective(plan_allgather(args.descs()[input].dtype, counts), std::move(spans), ReduceOp::Sum, args.name(),
                    args.text(input, 1));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  return refusing("allgather", [&] {
    CallArgs args = allgather_list_args(outputs, inputs, getRank(), getSize());
    auto& list = outputs[0];
    const size_t input = list.size();
    const at::Tensor& in = args.dense()[input];
    std::vector<TensorSpan> spans;
    for (size_t j = 0; j < list.size(); ++j) spans.push_back({in.data_ptr(), args.dense()[j].data_ptr()});
    std::vector<Collective> cs;
    // Every rank's part, as the list gives them (they may differ in size): the same text on every rank.
    cs.push_back(collective(plan_allgather(args.descs()[input].dtype, numels(args, 0, list.size())), std::move(spans),
                            ReduceOp::Sum, "allgather", args.text(0, list.size())));
    return calls_(*this, {"all_gather", inputs, list}, opts.asyncOp, [&] {
      return launch(c10d::OpType::ALLGATHER, std::move(args), std::move(cs), list, timeout_or_default(opts.timeout),
                    opts.asyncOp);
    });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  return refusing("allgather_into_tensor", [&] {
    std::vector<at::Tensor> outputs{output}, inputs{input};
    return allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                std::vector<at::Tensor>& inputs,
                                                                                const c10d::AllgatherOptions& opts) {
  return refusing("allgather_into_tensor", [&] {
    CallArgs args = allgather_tensor_args(outputs, inputs, getRank(), getSize());
    std::vector<Collective> cs;
    for (size_t i = 0; i < inputs.size(); ++i) cs.push_back(allgather_collective(args, i, outputs.size() + i));
    return calls_(*this, {"allgather_into_tensor_coalesced", inputs, outputs}, opts.asyncOp, [&] {
      return launch(c10d::OpType::_ALLGATHER_BASE, std::move(args), std::move(cs), outputs,
                    timeout_or_default(opts.timeout), opts.asyncOp);
    });
  });
}

void ProcessGroupHCA::gather_step(const at::Tensor& output, const at::Tensor& input,
                                  std::chrono::milliseconds timeout, const char* title) {
  CallArgs args = allgather_tensor_args({output}, {input}, getRank(), getSize());
  std::vector<Collective> cs{allgather_collective(args, 0, 1)};
  cs[0].signature = std::string(title) + " " + cs[0].signature;
  launch(c10d::OpType::_ALLGATHER_BASE, std::move(args), std::move(cs), {output}, timeout, false, title)->wait();
}

Collective ProcessGroupHCA::reduce_scatter_collective(const CallArgs& args, size_t output, size_t input,
                                                      ReduceOp op) {
  const int64_t numel = static_cast<int64_t>(args.descs()[output].numel);
  const at::Tensor& in = args.dense()[input];
  const at::Tensor& out = args.dense()[output];
  std::vector<TensorSpan> spans;
  for (int j = 0; j < getSize(); ++j) spans.push_back({byte_offset(in, j * numel), out.data_ptr()});
  const std::vector<size_t> counts(getSize(), args.descs()[output].numel);
  return collective(plan_reduce_scatter(args.descs()[output].dtype, counts, options_for(args.device())),
                    std::move(spans), op, args.name(), args.text(output, 1) + ", " + op_name(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  return refusing("reduce_scatter", [&] {
    StackedInputs stacked = stacked_reduce_scatter_inputs(outputs, inputs, getRank(), getSize());
    CallArgs args("reduce_scatter", {outputs[0], stacked.tensor});  // the stack is a copy: it shares nothing
    const Scaled stack_in_place{1, 1, false};
    const ReduceOp op = args.reduce_op(opts.reduceOp, &stack_in_place);
    // Input j (counts[j] elements, maybe not the output's size on other ranks) into rank j's output.
    std::vector<TensorSpan> spans;
    int64_t at = 0;
    for (size_t count : stacked.counts) {
      spans.push_back({byte_offset(args.dense()[1], at), args.dense()[0].data_ptr()});
      at += static_cast<int64_t>(count);
    }
    std::vector<Collective> cs;
    cs.push_back(collective(plan_reduce_scatter(args.descs()[0].dtype, stacked.counts, options_for(args.device())),
                            std::move(spans), op, "reduce_scatter", stacked.text + ", " + op_name(op)));
    return calls_(*this, {"reduce_scatter", flattened(inputs), outputs}, opts.asyncOp, [&] {
      return launch(c10d::OpType::REDUCE_SCATTER, std::move(args), std::move(cs), outputs,
                    timeout_or_default(opts.timeout), opts.asyncOp);
    });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  return refusing("reduce_scatter_tensor", [&] {
    std::vector<at::Tensor> outputs{output}, inputs{input};
    return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  return refusing("reduce_scatter_tensor", [&] {
    CallArgs args = reduce_scatter_tensor_args(outputs, inputs, getRank(), getSize());
    const Scaled copies_of_inputs{outputs.size(), inputs.size(), true};
    const ReduceOp op = args.reduce_op(opts.reduceOp, &copies_of_inputs);
    std::vector<Collective> cs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      cs.push_back(reduce_scatter_collective(args, i, outputs.size() + i, op));
    }
    return calls_(*this, {"reduce_scatter_tensor_coalesced", inputs, outputs}, opts.asyncOp, [&] {
      return launch(c10d::OpType::_REDUCE_SCATTER_BASE, std::move(args), std::move(cs), outputs,
                    timeout_or_default(opts.timeout), opts.asyncOp);
    });
  });
}

// As ProcessGroupNCCL's barrier (a collective on the device that the host then waits for): once it
// returns on any rank, every rank's device work issued before it has finished. Each rank first waits
// for its own device work, then the hosts meet.
c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::barrier(const c10d::BarrierOptions& opts) {
  CallArgs args("barrier", {});
  std::vector<Collective> cs;
  cs.push_back(collective({}, {}, ReduceOp::Sum, "barrier", ""));
  return calls_(*this, {"barrier", {}, {}}, opts.asyncOp, [&] {
    const auto timeout = timeout_or_default(opts.timeout);
    return launch(c10d::OpType::BARRIER, std::move(args), std::move(cs), {}, timeout, opts.asyncOp, nullptr,
                  drain_devices(timeout));
  });
}

void ProcessGroupHCA::refuse(const char* op, const std::string& why) noexcept {
  try {
    std::vector<Collective> cs;
    cs.push_back(collective({}, {}, ReduceOp::Sum, op, refusal_text(why)));
    launch(c10d::OpType::UNKNOWN, CallArgs(op, {}), std::move(cs), {}, timeout_.load(), true, "hca:refused_call");
  } catch (...) {
    // The group has ended or failed: its peers hear of that instead.
  }
}

std::function<void()> ProcessGroupHCA::drain_devices(std::chrono::milliseconds timeout) {
  const auto call = life_.try_enter();  // the streams go when the group ends (launch() then says so)
  if (!call) return nullptr;
  std::vector<std::shared_ptr<StreamCall>> calls;
  auto each_device = [&calls](CallStreams* streams) {
    if (streams) {
      for (int device : streams->devices()) calls.push_back(streams->call_on(device));
    }
  };
  each_device(cpu_call_streams_.get());
  {
    std::lock_guard<std::mutex> lock(cuda_executor_mutex_);
    each_device(cuda_call_streams_.get());
  }
  return calls.empty() ? nullptr : drained(std::move(calls), timeout);
}

void ProcessGroupHCA::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const auto call = life_.enter("monitoredBarrier");
  const auto timeout = timeout_or_default(opts.timeout);
  auto body = [this, timeout, wait_all_ranks] {
    try {
      control_->monitored_barrier(timeout, wait_all_ranks);
    } catch (const Failure& e) {
      C10_THROW_ERROR(DistBackendError, e.what());
    }
  };
  auto work = c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::BARRIER, std::vector<at::Tensor>{}, body);
  queue_.submit(work, true);
  work->wait(kNoTimeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::endCoalescing() {
  return calls_.close_window(getRank());
}

}  // namespace hca
