// Each communication call of a backend counted (its sequence number), entered
// in torch's Flight Recorder (flight_record.hpp) and, when a profiler listens,
// recorded with the metadata torch's trace tools read (ParamCommsUtils.hpp: the
// call's name, message sizes, dtype, group and its ranks in the world), as
// ProcessGroupNCCL records its own.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "flight_record.hpp"
#include "refusal.hpp"

// Whether the caller waits in the call (`async_op`) is recorded where torch can
// record it (2.13 on); older torch records every call as async.
#ifdef RECORD_PARAM_COMMS_DATA_WITH_ASYNC_OP
#define HCA_RECORD_PARAM_COMMS(async_op, ...) RECORD_PARAM_COMMS_DATA_WITH_ASYNC_OP(__VA_ARGS__, async_op)
#else
#define HCA_RECORD_PARAM_COMMS(async_op, ...) RECORD_PARAM_COMMS_DATA(__VA_ARGS__)
#endif

namespace hca {

// A call as trace tools see it: ProcessGroupNCCL's name for it ("allreduce",
// "all_gather", "send", ...), what it reads and what it writes.
struct CommsCall {
  const char* name;
  const std::vector<at::Tensor>& inputs;
  const std::vector<at::Tensor>& outputs;
  std::vector<int64_t> input_splits = {};
  std::vector<int64_t> output_splits = {};
  std::optional<int> peer = std::nullopt;  // a message's: its peer (-1: any source)

  // A send or receive of `tensors` (ProcessGroupNCCL records the peer in the rank's place).
  static CommsCall message(const char* name, const std::vector<at::Tensor>& tensors, int peer) {
    return {name, tensors, tensors, {}, {}, peer};
  }
};

// Every tensor of a list of lists, in order (allgather's outputs, scatter's inputs).
std::vector<at::Tensor> flattened(const std::vector<std::vector<at::Tensor>>& lists);

class CallRecorder {
 public:
  // The group's ranks in the world, in group order (empty: the world itself).
  void set_global_ranks(const std::vector<int64_t>& ranks);
  const std::vector<int64_t>& global_ranks() const { return global_ranks_; }
  // The timeout the Flight Recorder's entries say the calls have.
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ms_ = timeout.count(); }
  // setSequenceNumberForGroup / getSequenceNumberForGroup: the calls issued since.
  void reset() { issued_ = 0; }
  uint64_t issued() const { return issued_; }

  // torch's coalescing manager (startCoalescing, then endCoalescing): the Works
  // of the calls issued in between, kept until the window closes, which
  // returns them as one Work (window_work.hpp) of `rank`.
  void open_window();
  c10::intrusive_ptr<c10d::Work> close_window(int rank);
  FlightLog& flight() { return *flight_; }

  // Issues the call (`issue` returns its Work), counted once it is issued (and handed on:
  // no longer refused at the call, refusal.hpp);
  // `async_op`: the caller's, false where it waits in the call.
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> operator()(const c10d::Backend& backend, const CommsCall& call, bool async_op,
                                            Issue&& issue) {
    mark_handed_on();
    const auto entry = flight_->scheduled(backend, global_ranks_, call.name, call.peer, call.inputs, call.outputs,
                                          std::chrono::milliseconds(timeout_ms_.load()));
    const bool device_tensors = entry.awaited() && on_a_device(call);  // before `issue` may move the tensors
    if (!at::hasCallbacks()) return counted(followed(entry, device_tensors, issue()));
    const auto seq = std::make_tuple(static_cast<int64_t>(issued_ + 1), call.peer.has_value());
    const auto name = std::make_tuple(backend.getGroupUid(), backend.getGroupDesc());
    const int rank = call.peer.value_or(backend.getRank());
    HCA_RECORD_PARAM_COMMS(async_op, seq, name, call.inputs, call.outputs, rank, call.name, numel(call.inputs),
                           numel(call.outputs), dtype(call), call.input_splits, call.output_splits, rank_start_,
                           rank_stride_, backend.getSize());
    return counted(followed(entry, device_tensors, issue()));
  }

 private:
  c10::intrusive_ptr<c10d::Work> counted(c10::intrusive_ptr<c10d::Work> work);
  // `work`, whose Flight Recorder entry is retired once it ends well; `device_tensors`: the call's
  // tensors are on a device (on_a_device).
  c10::intrusive_ptr<c10d::Work> followed(FlightLog::Ticket entry, bool device_tensors,
                                          c10::intrusive_ptr<c10d::Work> work);
  static bool on_a_device(const CommsCall& call);
  static int64_t numel(const std::vector<at::Tensor>& tensors);
  static at::ScalarType dtype(const CommsCall& call);

  std::atomic<uint64_t> issued_{0};
  static constexpr size_t kWindowPruneAt = 64;
  std::atomic<bool> window_open_{false};
  // The window's length at which the next call prunes it: doubled when a pruning
  // leaves it long (calls still running), so that calls do not each scan it.
  size_t window_prune_at_ = kWindowPruneAt;
  std::mutex window_mutex_;
  std::vector<c10::intrusive_ptr<c10d::Work>> window_;
  std::vector<int64_t> global_ranks_;
  // Shared with the callbacks of the Works it follows, which may end after the group.
  std::shared_ptr<FlightLog> flight_ = std::make_shared<FlightLog>();
  std::atomic<int64_t> timeout_ms_{0};
  // As ParamCommsDebugInfo takes the ranks: the first and the stride between
  // them (-1: not evenly spaced, the ranks are then not listed).
  int rank_start_ = 0;
  int rank_stride_ = 1;
};

}  // namespace hca
