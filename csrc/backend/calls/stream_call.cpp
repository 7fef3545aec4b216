#include "stream_call.hpp"

#include <c10/util/Exception.h>

#include <utility>
#include <vector>

#include "../../transport/control/wait.h"
#include "../../transport/stream/event_pool.h"
#include "issue_order.hpp"
#include "../group/owning_process.hpp"
#include "../group/process_group_hca.hpp"

namespace hca {

namespace {

// Runtime failures on the caller's side surface as DistBackendError.
template <class Fn>
void as_backend_error(Fn fn) {
  try {
    fn();
  } catch (const Failure& failure) {
    C10_THROW_ERROR(DistBackendError, failure.what());
  }
}

// The streams of destroyed groups, reused by later groups instead of destroyed:
// freeing a tensor that a stream used (recordStream, as point-to-point calls
// leave their tensors) makes torch's caching allocator record an event on that
// stream, so a stream must outlive every such tensor, which the user may keep
// past the group's end (torch's own stream pool never destroys its streams).
class IdleStreams {
 public:
  DeviceRuntime::Stream take(DeviceRuntime& runtime, int device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      forget_the_parents();
      auto& idle = idle_[{&runtime, device}];
      if (!idle.empty()) {
        const DeviceRuntime::Stream stream = idle.back();
        idle.pop_back();
        return stream;
      }
    }
    return runtime.create_stream();
  }
  // With work still queued on it: a later group's work runs after it.
  void give_back(DeviceRuntime& runtime, int device, DeviceRuntime::Stream stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    forget_the_parents();
    idle_[{&runtime, device}].push_back(stream);
  }

 private:
  // A forked child cannot use its parent's streams (CUDA refuses; the model's
  // stream threads are not copied): they are left, never used.
  void forget_the_parents() {
    if (forks_ == forks_so_far()) return;
    idle_.clear();
    forks_ = forks_so_far();
  }

  std::mutex mutex_;
  uint64_t forks_ = forks_so_far();
  std::map<std::pair<DeviceRuntime*, int>, std::vector<DeviceRuntime::Stream>> idle_;
};

IdleStreams& idle_streams() {
  static auto* streams = new IdleStreams();  // never destroyed: groups may end at exit
  return *streams;
}

}  // namespace

StreamCall::StreamCall(DeviceRuntime& runtime, int device, DeviceRuntime::Stream internal,
                       DeviceRuntime::Stream caller)
    : runtime_(runtime), device_(device), internal_(internal) {
  DeviceGuard guard(runtime_, device_);
  as_backend_error([&] {
    ready_ = EventPool::of(runtime_).take(device_);
    end_ = EventPool::of(runtime_).take(device_);
    runtime_.record(ready_, caller);
  });
}

StreamCall::~StreamCall() {
  if (ready_) EventPool::of(runtime_).give_back(device_, ready_);
  if (end_) EventPool::of(runtime_).give_back(device_, end_);
}

void StreamCall::begin() const {
  DeviceGuard guard(runtime_, device_);
  as_backend_error([&] { runtime_.wait(internal_, ready_); });
}

void StreamCall::end() {
  DeviceGuard guard(runtime_, device_);
  as_backend_error([&] { runtime_.record(end_, internal_); });
}

void StreamCall::wait_for_end() const {
  DeviceGuard guard(runtime_, device_);
  try {
    runtime_.synchronize(end_);
  } catch (const Failure& fault) {
    note_fault(fault.what());
    check_fault();
  }
}

bool StreamCall::query() const {
  try {
    DeviceGuard guard(runtime_, device_);
    return runtime_.query(end_);
  } catch (const Failure& fault) {
    note_fault(fault.what());
    return true;  // finished, with an error: wait() raises it
  }
}

bool StreamCall::passed_end() const {
  DeviceGuard guard(runtime_, device_);
  return runtime_.query(end_);
}

void StreamCall::make_current_stream_wait() const {
  check_fault();
  // The current stream is the device's: a null (legacy default) stream means
  // the current device's, so the device must be current.
  DeviceGuard guard(runtime_, device_);
  as_backend_error([&] { runtime_.wait(current_stream(), end_); });
  after_current_stream_waits();
}

void StreamCall::check_released() const {
  check_fault();
  const std::string cause = issued_->cause();
  if (!cause.empty()) {
    C10_THROW_ERROR(DistBackendError, cause + " (this call was released unfinished: its outputs are undefined)");
  }
}

void StreamCall::note_fault(const std::string& fault) const {
  std::lock_guard<std::mutex> lock(fault_mutex_);
  if (fault_.empty()) fault_ = fault;
}

void StreamCall::check_fault() const {
  std::lock_guard<std::mutex> lock(fault_mutex_);
  if (!fault_.empty()) C10_THROW_ERROR(DistBackendError, fault_ + " (its outputs are undefined)");
}

std::shared_ptr<const CallTensors> StreamCall::keep(CallTensors tensors) const {
  return std::make_shared<const CallTensors>(std::move(tensors));
}

CallStreams::CallStreams(DeviceRuntime& runtime, std::function<int(const at::Device&)> index_of,
                         CallerStream caller_stream, MakeCall make)
    : runtime_(runtime),
      index_of_(std::move(index_of)),
      caller_stream_(std::move(caller_stream)),
      make_(std::move(make)) {}

CallStreams::~CallStreams() {
  for (const auto& [device, stream] : streams_) idle_streams().give_back(runtime_, device, stream);
}

std::shared_ptr<StreamCall> CallStreams::call_on(int index) {
  const DeviceRuntime::Stream caller = caller_stream_(index);
  DeviceGuard guard(runtime_, index);
  // Refused on the caller's thread, so that the group stays usable.
  TORCH_CHECK(!runtime_.capturing(caller), "hca: collectives cannot be captured in a CUDA graph yet (the current "
              "stream of device ", index, " is capturing)");
  DeviceRuntime::Stream stream = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& internal = streams_[index];
    if (!internal) as_backend_error([&] { internal = idle_streams().take(runtime_, index); });
    stream = internal;
  }
  return make_(index, stream, caller);
}

void CallStreams::synchronize_caller(const at::Device& device) {
  const int index = index_of_(device);
  DeviceGuard guard(runtime_, index);
  as_backend_error([&] {
    EventPool& events = EventPool::of(runtime_);
    const DeviceRuntime::Event passed = events.take(index);
    try {
      runtime_.record(passed, caller_stream_(index));
      runtime_.synchronize(passed);
    } catch (...) {
      events.give_back(index, passed);
      throw;
    }
    events.give_back(index, passed);
  });
}

std::vector<int> CallStreams::devices() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int> used;
  for (const auto& [index, stream] : streams_) used.push_back(index);
  return used;
}

#ifndef HCA_WITH_CUDA
std::unique_ptr<CallStreams> make_cuda_call_streams() { return nullptr; }
#endif

std::function<void()> issued_and_waited(std::shared_ptr<StreamCall> call, std::shared_ptr<const CallTensors> kept,
                                        std::function<void()> body, std::shared_ptr<IssueTicket> turn) {
  return [call = std::move(call), kept = std::move(kept), body = std::move(body), turn = std::move(turn)] {
    if (turn) turn->await();
    // The thread running it (the group's worker) on the call's device: never a context on device 0.
    DeviceGuard guard(call->runtime(), call->device_index());
    call->begin();
    try {
      const IssueTicket::Held inside(turn.get());
      call->from_host(body);
    } catch (...) {
      call->end();
      if (turn) turn->pass();
      call->keep_until_passed(kept);  // what was issued before the error still reads it
      throw;
    }
    call->end();
    if (turn) turn->pass();
    // The host never waits for the device: the stream keeps what it reads, and the caller's
    // stream waits for the end (wait()).
    call->keep_until_passed(kept);
    call->issued()->settle();
  };
}

std::function<void()> drained(std::vector<std::shared_ptr<StreamCall>> calls, std::chrono::milliseconds timeout) {
  return [calls = std::move(calls), timeout] {
    const auto deadline = deadline_after(timeout);
    for (const auto& call : calls) {
      DeviceGuard guard(call->runtime(), call->device_index());
      call->begin();
      call->end();
      // Polled, not synchronized: a device that never gets there must not hold the barrier for ever.
      // query() is true on a fault too, which wait_for_end() then raises as DistBackendError.
      if (!poll_until(deadline, [&] { return call->query(); })) {
        C10_THROW_ERROR(DistBackendError, "hca barrier: this rank's device work issued before the barrier (on device " +
                                              std::to_string(call->device_index()) + ") did not finish within " +
                                              std::to_string(timeout.count()) + " ms");
      }
      call->wait_for_end();
      call->issued()->settle();
    }
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::launch_on_stream(c10d::OpType type, Executor& executor,
                                                                 CallArgs args, std::vector<Collective> collectives,
                                                                 std::vector<at::Tensor> outputs, bool async_op,
                                                                 const char* internal_title,
                                                                 std::function<void()> before) {
  // Made first: it refuses a capturing stream before the self-test would put work on it.
  std::shared_ptr<StreamCall> call = call_streams(args.device())->call(args.device());
  try {
    self_test_once(args.device());
  } catch (const c10::DistBackendError& e) {
    const std::string first = std::string(args.name()) + ", the group's first collective on " +
                              c10::DeviceTypeName(args.device().type(), true) + " tensors";
    C10_THROW_ERROR(DistBackendError, "hca: " + first + ", failed in the self-test that runs before it: " +
                                          e.what_without_backtrace());
  }
  const size_t collectives_size = collectives.size();
  auto kept = call->keep(CallTensors{std::move(args), outputs});
  for (auto& c : collectives) {
    c.device = call->device_index();
    c.stream = call->stream();
    c.issued = call->issued();
    c.keep = kept;
  }
  // Taken here, on the caller's thread: the device gets this call's work after every earlier call's.
  auto ticket = std::make_shared<IssueTicket>(&call->runtime(), call->device_index());
  auto body = [&executor, call, kept, collectives = std::move(collectives), before = std::move(before), ticket]() mutable {
    ticket->await();
    if (before) before();
    // The thread running it (the group's worker) on the call's device: never a context on device 0.
    DeviceGuard guard(call->runtime(), call->device_index());
    call->begin();
    if (kept->args.premultiplies()) call->on_stream([tensors = kept.get()] { tensors->args.premultiply(); });
    for (const auto& c : collectives) {
      try {
        executor.run(c);
      } catch (const std::runtime_error& e) {
        C10_THROW_ERROR(DistBackendError, e.what());
      }
    }
    // Not kept alive by this closure (on CUDA it runs now, issuing copies): the
    // executor keeps the tensors until the stream has passed the call's end.
    call->on_stream([tensors = kept.get()] { tensors->args.write_back(); });
    call->end();
    // The executor holds the tensors from here (and lets go on its watchdog): the closure keeps
    // none, so the worker, which drops it under the queue's running lock, never frees the last
    // reference (a storage's deleter may run Python that waits for this group's next call).
    collectives.clear();
    executor.end_call(call->stream(), call->issued(), std::move(kept));
    ticket->pass();  // (else when the closure goes: after an error, or if it never ran)
  };
  auto work = c10::make_intrusive<WorkHCA>(getRank(), type, std::move(outputs), std::move(body), std::move(call),
                                           internal_title);
  collectives_issued_ += collectives_size;  // after the self-test's, which the executor starts first
  queue_.submit(work, !async_op);
  return work;
}

}  // namespace hca
