// A backend that hands the operations it has no form of its own for to stock
// engines over the same ranks, chosen by the tensors' device: the base of the
// `nccl` algorithm's wrapper and of the group across nodes.
#pragma once
#include <mutex>
#include <optional>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "../calls/call_args.hpp"
#include "../calls/call_record.hpp"
#include "../calls/issue_order.hpp"
#include "../calls/stream_call.hpp"
#include "../calls/work_hca.hpp"
#include "../c10d_overrides.hpp"
#include "../group/group_life.hpp"
#include "call_agreement.hpp"
#include "described_messages.hpp"

namespace hca {

// Stock engines over one set of ranks: for CPU tensors (gloo) and for CUDA
// tensors (ProcessGroupNCCL); either may be null.
struct Engines {
  c10::intrusive_ptr<c10d::Backend> cpu, cuda;
};

// The tensors as the engines move them: float8 and float4 ones as uint8 views
// (gloo knows no float8; NCCL moves them as uint8 where it has no float8 type),
// int16, uint16, uint32 and uint64 as views of a dtype of their width that both
// carry (gloo has none of them; NCCL no 16-bit integers), complex ones as their
// real views. The integers are only moved: reductions of them are refused before
// (check_engine_reduction).
at::Tensor engine_bytes(const at::Tensor& tensor, const char* op);
std::vector<at::Tensor> engine_bytes(const std::vector<at::Tensor>& tensors, const char* op);
std::vector<std::vector<at::Tensor>> engine_bytes(const std::vector<std::vector<at::Tensor>>& lists, const char* op);

// The tensors a stock engine gets for one call. gloo reads and writes a CPU tensor
// from its data pointer as if it were contiguous (a strided view's broadcast,
// reduce, scatter or reduce-scatter came out wrong, silently) or refuses it
// (all-to-all, messages): a non-contiguous CPU tensor goes to the engine as a
// dense copy, and an output's copy is written back after the engine's call.
// CUDA tensors go as they are: NCCL refuses non-contiguous ones, naming them.
class EngineTensors {
 public:
  // An input: `t`, or a dense copy.
  static at::Tensor input(const at::Tensor& t);
  static std::vector<at::Tensor> inputs(const std::vector<at::Tensor>& ts);
  static std::vector<std::vector<at::Tensor>> inputs(const std::vector<std::vector<at::Tensor>>& lists);
  // An output (which in-place forms read too): `t`, or a dense copy of it, written back by write_back().
  at::Tensor output(const at::Tensor& t);
  std::vector<at::Tensor> outputs(const std::vector<at::Tensor>& ts);
  std::vector<std::vector<at::Tensor>> outputs(const std::vector<std::vector<at::Tensor>>& lists);
  bool copies() const { return !back_.empty(); }
  // The engine's results into the caller's tensors (after its call has finished).
  void write_back() const;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (the caller's, the engine's)
};

// gloo checks the shapes of a call's tensors where NCCL and hca's own algorithms take any shape
// of the right size (an all-gather's whole shaped (ranks, *part) or flat, a gather list of
// (2, 3) tensors for parts of 6 elements): so CPU tensors, which go to gloo, go flat, once
// their sizes are checked or agreed on; they are dense by then (EngineTensors). CUDA tensors
// go as they are.
at::Tensor flat_for_gloo(const at::Tensor& tensor);
std::vector<at::Tensor> flat_for_gloo(const std::vector<at::Tensor>& tensors);
std::vector<std::vector<at::Tensor>> flat_for_gloo(const std::vector<std::vector<at::Tensor>>& lists);

// Before a reduction reaches a stock engine, hca's own errors. Any tensor: a
// TypeError for int16, uint16, uint32 and uint64 (gloo has no arithmetic for
// them, NCCL none for 16-bit integers; hca's own algorithms on one node reduce
// them, and so do the stages between nodes, `widened`: WidenedForEngine), a
// ValueError for complex ones but with SUM, AVG, PREMUL_SUM. CPU tensors
// (to gloo): a TypeError for a dtype gloo cannot reduce (float8, ...), a
// ValueError for AVG on integers (gloo sums, then fails to divide, and leaves
// the sums in the tensors) and for BAND, BOR, BXOR on floating dtypes. CUDA
// tensors (to NCCL, or between nodes to either engine, alike on every rank): a
// ValueError for BAND, BOR, BXOR, which NCCL lacks; the rest under NCCL's rules.
void check_engine_reduction(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& reduce_op, const char* op,
                            bool widened = false);

// A reduction of int16, uint16, uint32 or uint64 tensors by an engine that has no arithmetic for
// them: copies in a wider dtype that it reduces to the same bits (int16 and uint16 in int32,
// uint32 in int64: every op's result, cut back to the dtype's width, is the dtype's own; uint64
// as int64, whose SUM, PRODUCT and bitwise ops are the same bits, and whose order is the unsigned
// one once the top bit is flipped, for MIN and MAX; without a flip, their own int64 view), put
// back into the tensors by narrow().
class WidenedForEngine {
 public:
  WidenedForEngine(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op);
  // The tensors to hand the engine: the wider copies, or the tensors themselves where none is needed.
  const std::vector<at::Tensor>& tensors() const { return wide_.empty() ? given_ : wide_; }
  // The engine's results, back in the given tensors.
  void narrow() const;

 private:
  std::vector<at::Tensor> given_, wide_;
  bool flipped_ = false;
};

// gloo's MIN and MAX keep or drop a NaN by the order they meet it, where hca's kernels let a
// NaN win, as torch.amax does. So where gloo reduces floating CPU tensors with MIN or MAX, the
// NaNs' places go round too: a mask the same reduction carries (uint8, every tensor's elements
// in turn; 1 marks a NaN under MAX, 0 under MIN), taken before gloo gets the tensors (it writes
// them on threads of its own), and the NaNs put back into the results after.
bool nans_go_round(c10d::ReduceOp::RedOpType op, const std::vector<at::Tensor>& tensors);
at::Tensor nan_mask(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op);
void put_nans_back(const std::vector<at::Tensor>& results, const at::Tensor& mask, c10d::ReduceOp::RedOpType op);

// Whether `tensors` are all of one size (a list form's slots).
bool one_size(const std::vector<at::Tensor>& tensors);
// PREMUL_SUM where the engine is gloo, which lacks it: its factor (`name`: the call), where the
// engine sums and hca multiplies the results by it after, in the call's turn (as AVG divides
// after the sum); none for CUDA tensors (NCCL has PREMUL_SUM and gets it as it is) or another op.
std::optional<PremulFactor> post_scale(const c10d::ReduceOp& op, const std::vector<at::Tensor>& tensors,
                                       const char* name);
// Shuts down (or aborts) each engine there is.
void end_engines(Engines& engines, bool abort);
// Sets the default timeout of each engine there is.
void set_engines_timeout(Engines& engines, std::chrono::milliseconds timeout);

class EngineBackend : public c10d::Backend {
 public:
  // `engines.cpu` is required: every call without tensors goes there. `timeout`: the calls'
  // (what the Flight Recorder enters).
  EngineBackend(int rank, int size, std::chrono::milliseconds timeout, Engines engines);
  ~EngineBackend() override;

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  // Ending runs once, whoever asks and however often (the group's life, as
  // ProcessGroupHCA's): an abort first aborts the parts so that the calls inside
  // give up; then the queue stops (what it holds runs to its end, or fails after
  // an abort), the calls inside are awaited, and a shutdown shuts the parts down.
  // Later calls raise DistBackendError. The engines: ProcessGroupNCCL ends its
  // communicators; gloo has neither.
  void shutdown() override { end(false); }
  void abort() override { end(true); }
  void setTimeout(std::chrono::milliseconds timeout) override;
  // The calls made through this backend since the last reset (forwarded to the
  // engines too, which number what they are handed: packs, stages).
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override { return calls_.issued(); }
  // Where this group's ranks are in the world (for profiler traces).
  CallRecorder& calls() { return calls_; }
  HCA_OVERRIDE_COMPLETION_HOOKS
  // The coalescing manager's window, as ProcessGroupHCA's (window_work.hpp).
  void startCoalescing() override { calls_.open_window(); }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    return calls_.close_window(getRank());
  }
  HCA_OVERRIDE_GATHERS_AND_MESSAGES

 protected:
  CallRecorder calls_;  // every public call goes through it (issue)
  // A call as its engine gets it: the engine's Work, and `step`, hca's host code on the
  // engine's results after it (a write-back, arithmetic), if any.
  struct EngineCall {
    c10::intrusive_ptr<c10d::Work> work;
    std::function<void()> step = nullptr;
  };
  // `work`, then `written`'s write-back where it copied.
  static EngineCall written_back(c10::intrusive_ptr<c10d::Work> work, EngineTensors written);
  // A public collective, counted by the recorder: `issue_call` hands it to the engine of its
  // tensors' device. CPU tensors' (gloo's) go through the group's queue, in call order (the
  // caller does not wait for its peers): there the ranks agree on `terms` first, then the
  // engine gets the call, and its step runs once the engine is done. CUDA tensors' reach
  // the engine at once, in their turn on the device (engine_turn), once the post-step of an
  // earlier call (post_step) has run: the engine starts a call at once, and it must see
  // what that post-step wrote; the step follows on the queue (then). `issue_call` is called
  // later, on another thread, for CPU tensors: it holds what it uses. What it would raise
  // for bad input is raised before, naming `op` (check_engine_dtypes).
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> issue(const char* op, const CommsCall& call, c10d::OpType type, CallTerms terms,
                                       bool async_op, Issue issue_call) {
    const auto& tensors = call.inputs.empty() ? call.outputs : call.inputs;
    check_engine_dtypes(call, op);
    settle_post_step();
    return record(call, async_op, [&]() -> c10::intrusive_ptr<c10d::Work> {
      const auto turn = engine_turn(tensors);
      if (!tensors.empty() && tensors[0].defined() && !tensors[0].is_cpu()) {
        EngineCall started = issue_call();
        return then(std::move(started.work), type, call.outputs, std::move(started.step), async_op);
      }
      return agreed_on_queue(type, call.outputs, std::move(terms), op, async_op,
                             [issue_call = std::move(issue_call)]() mutable {
        EngineCall started = issue_call();
        started.work->wait();
        if (started.step) started.step();
      });
    });
  }
  // A message, counted by the recorder: `issue_call` hands it to its engine at once (gloo's
  // messages carry their own tags: they need no turn among the collectives).
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> issue_message(const CommsCall& call, Issue&& issue_call) {
    settle_post_step();
    return record(call, true, [&] {
      const auto turn = engine_turn(call.inputs);
      return issue_call();
    });
  }
  // `call()`, a collective on `tensors` that the engines carry, refused in its turn where it raises
  // bad input at the call (refusal.hpp): CPU tensors' calls by an agreement, on the group's queue,
  // on terms that say so, which peers that made the call find mismatched. CUDA tensors' calls
  // reach NCCL unchecked (every call would pay a round on the host): their peers wait, as NCCL's do.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> refusing(const char* op, const std::vector<at::Tensor>& tensors, Call&& call) {
    return refused_at_the_call([&](const std::string& why) { refuse_by_agreement(op, tensors, why); },
                               std::forward<Call>(call));
  }
  void refuse_by_agreement(const char* op, const std::vector<at::Tensor>& tensors, const std::string& why) noexcept;
  // The ranks agree on a call's `terms` before the CPU engine gets it: through that engine, here.
  virtual void agree(const CallTerms& terms, const char* op);
  // A Work of the group's queue (a blocking call's runs on this thread when nothing is queued):
  // the ranks agree on `terms` (agree), then `run` hands the call to the engine and waits for it.
  c10::intrusive_ptr<c10d::Work> agreed_on_queue(c10d::OpType type, std::vector<at::Tensor> outputs, CallTerms terms,
                                                 const char* op, bool async_op, std::function<void()> run);
  // A list all-to-all of CPU tensors, which gloo's takes of one size only (NCCL's and hca's own
  // algorithms', any): through gloo's all_to_all_single, the inputs in one tensor with each one's
  // elements as its split, and the results copied into the outputs after.
  EngineCall alltoall_in_one(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                             const c10d::AllToAllOptions& opts);
  // Collectives handed whole to the engine of their tensors' device (engine_collectives.cpp):
  // the list all_gather, and the reduce-scatters, list, tensor and coalesced. gloo's results
  // get what gloo lacks (post_scale, nans_go_round, allgather_by_broadcasts).
  c10::intrusive_ptr<c10d::Work> allgather_by_engine(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_by_engine(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_base_by_engine(at::Tensor& output, at::Tensor& input,
                                                               const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced_by_engine(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::ReduceScatterOptions& opts);
  // The engine's options for a reduce or reduce-scatter: SUM where `scale` multiplies after.
  template <typename Options>
  static Options summing(const Options& opts, const std::optional<PremulFactor>& scale) {
    Options engine_opts = opts;
    if (scale) engine_opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    return engine_opts;
  }
  // A reduction's `engine_work` into `sums` (the engine's outputs: the caller's, or dense
  // copies that `written` writes back), then the scale where there is one, then the write-back.
  static EngineCall scaled_after(c10::intrusive_ptr<c10d::Work> engine_work, std::vector<at::Tensor> sums,
                                 const std::optional<PremulFactor>& scale, EngineTensors written);
  // A reduce-scatter through gloo: `reduce(outs, ins, opts)`, then the scale or the write-back
  // (scaled_after). Where gloo's MIN or MAX would drop a NaN (nans_go_round), `reduce` runs
  // alike on the tensors' NaN masks (masks_of) after it, and the NaNs are put back first.
  template <typename Inputs, typename Reduce>
  static EngineCall reduce_scatter_through(std::vector<at::Tensor> outs, Inputs ins,
                                           const c10d::ReduceScatterOptions& opts,
                                           const std::optional<PremulFactor>& scale, EngineTensors written,
                                           Reduce reduce);
  // Each tensor's NaN mask (nan_mask), of its shape, for the same call on them.
  static std::vector<at::Tensor> masks_of(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op);
  static std::vector<std::vector<at::Tensor>> masks_of(const std::vector<std::vector<at::Tensor>>& lists,
                                                       c10d::ReduceOp::RedOpType op);
  // `call`, then, once `masks_work` (that call on `masks`) is done, the NaNs they mark put back
  // into `results` (the engine's outputs), before `call`'s own step (a write-back).
  static EngineCall with_nans_put_back(EngineCall call, c10::intrusive_ptr<c10d::Work> masks_work,
                                       std::vector<at::Tensor> results, std::vector<at::Tensor> masks,
                                       c10d::ReduceOp::RedOpType op);
  // An all_gather into slots of different sizes on CPU tensors (dense, flat: `slots`, `input`),
  // which gloo's all_gather refuses: a gloo broadcast from each rank in turn into its slot, as
  // NCCL gathers such slots; this rank's input is copied into its own slot after. `timeout`: the call's.
  EngineCall allgather_by_broadcasts(std::vector<at::Tensor> slots, at::Tensor input,
                                     std::chrono::milliseconds timeout, EngineTensors written);
  // What the ranks of a reduce-scatter agree on (`outputs`: their text).
  static CallTerms reduce_scatter_terms(const std::vector<at::Tensor>& inputs, const std::string& outputs,
                                        const c10d::ReduceScatterOptions& opts);
  // The TypeError for a CPU tensor of a dtype gloo does not move, raised on the caller's thread.
  static void check_engine_dtypes(const CommsCall& call, const char* op);
  // Before an engine gets a call on `tensors` (on this thread, at once): on a CUDA device,
  // the call's turn there, once every earlier call of the process's groups has issued its
  // work (IssueTicket, held until the engine has the call; ProcessGroupHCA's workers issue
  // in the same turns). NCCL's kernels wait for the peers', and on a hardware queue shared
  // with hca's streams, calls that reach the device in a different order on each rank
  // deadlock. Null for CPU tensors, which queue nowhere. On the CPU model of the device,
  // where gloo stands for NCCL and reads and writes the tensors on the host at once, the
  // host first waits for the caller's current stream, as NCCL's stream would.
  std::unique_ptr<IssueTicket> engine_turn(const std::vector<at::Tensor>& tensors) const;
  // A public call, counted by the recorder, inside the group's life (refused once it ends).
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> record(const CommsCall& call, bool async_op, Issue&& issue_call) {
    const auto inside = life_.enter(call.name);
    return calls_(*this, call, async_op, std::forward<Issue>(issue_call));
  }
  // What ending does to the parts: abort them, or shut them down (the engines;
  // NodeBackend adds its node's group and the engines among leaders).
  virtual void end_parts(bool abort);
  // Stops the queue of a backend that has one.
  virtual void stop_queue() {}
  // `work` runs hca's own arithmetic on an engine's results after the engine's
  // call (AVG's division, PREMUL_SUM's factor, on CPU tensors): the next call waits for it.
  void post_step(c10::intrusive_ptr<c10d::Work> work);
  // Waits for that post-step (issue does; a call that reaches an engine before issue, too).
  void settle_post_step();
  // `engine_work`, or where there is a `step` (host code on the engine's results: hca's
  // arithmetic, a write-back), a Work of the group's queue that waits for the engine's and
  // then runs it; later calls wait for that (post_step). Collectives only: the queue runs
  // one step at a time, and a receive's would hold up the calls its sender may wait for.
  c10::intrusive_ptr<c10d::Work> then(c10::intrusive_ptr<c10d::Work> engine_work, c10d::OpType type,
                                      std::vector<at::Tensor> results, std::function<void()> step, bool async_op);
  // ValueError for a non-contiguous CPU tensor a message is received into (gloo receives into
  // contiguous memory only, and a step on the queue could hold up what its sender waits for).
  static void check_received_into_contiguous(const std::vector<at::Tensor>& tensors);
  // The group's queue, where `then` runs its steps.
  virtual WorkQueue& queue() = 0;
  // The engine for `tensor`'s device, or NotImplementedError naming `op` and the device.
  c10d::Backend& engine(const at::Tensor& tensor, const char* op) const;
  // Where a message between this rank and `peer` (a rank of this group) on `tensor`'s device
  // goes: its engine, and the peer's rank there.
  struct MessageRoute {
    c10d::Backend& backend;
    int peer;
  };
  MessageRoute message_route(const at::Tensor& tensor, int peer, const char* op) const;
  // Messages to oneself of CPU tensors, which gloo takes none of (NCCL takes them), go here: a
  // group of hca's own and this rank's rank in it; none (they are refused) unless a subclass has one.
  virtual std::optional<MessageRoute> own_messages() const { return std::nullopt; }
  // Whether a message of `tensors` through `backend` is gloo's, and so goes after a description
  // of its tensor (DescribedMessages): one dense CPU tensor (gloo refuses lists itself).
  bool described_by_gloo(const c10d::Backend& backend, const std::vector<at::Tensor>& tensors) const {
    return &backend == engines_.cpu.get() && tensors.size() == 1 && tensors[0].is_cpu();
  }
  c10d::Backend& cpu_engine(const char* op) const {
    life_.owner().check(op);
    return *engines_.cpu;
  }
  // The groups' own work on CUDA tensors (hca's arithmetic after an engine, the stages across
  // nodes) runs on their streams; null without CUDA.
  std::unique_ptr<CallStreams> cuda_call_streams_ = make_cuda_call_streams();
  // The same on the CPU model of the device, for CPU tensors: set by a backend whose parts run
  // there (the group across nodes, when its node's group does); null otherwise.
  std::unique_ptr<CallStreams> model_call_streams_;
  // The streams of the groups' own work on `device`'s tensors: CUDA's, or the model's; null where
  // that work runs on the host without streams.
  CallStreams* call_streams(const at::Device& device) const {
    return device.is_cuda() ? cuda_call_streams_.get() : device.is_cpu() ? model_call_streams_.get() : nullptr;
  }
  // Whether this is a child forked from the process that made the backend.
  bool in_forked_child() const { return !life_.owner().is_current(); }
  // DistBackendError naming `op` in a forked child.
  void check_process(const char* op) const { life_.owner().check(op); }

 private:
  void end(bool abort);

  GroupLife life_;
  Engines engines_;
  DescribedMessages described_;  // the CPU engine's messages
  std::mutex post_step_mutex_;
  c10::intrusive_ptr<c10d::Work> post_step_;
};

}  // namespace hca
