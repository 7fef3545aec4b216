#include "call_record.hpp"

#include <algorithm>

#include "window_work.hpp"
#include "work_hca.hpp"

namespace hca {

std::vector<at::Tensor> flattened(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> all;
  for (const auto& list : lists) all.insert(all.end(), list.begin(), list.end());
  return all;
}

void CallRecorder::set_global_ranks(const std::vector<int64_t>& ranks) {
  global_ranks_ = ranks;
  rank_start_ = ranks.empty() ? 0 : static_cast<int>(ranks[0]);
  rank_stride_ = ranks.size() > 1 ? static_cast<int>(ranks[1] - ranks[0]) : 1;
  for (size_t i = 1; i < ranks.size(); ++i) {
    if (ranks[i] - ranks[i - 1] != rank_stride_) rank_stride_ = -1;
  }
  if (rank_stride_ <= 0) rank_stride_ = -1;
}

void CallRecorder::open_window() {
  std::lock_guard<std::mutex> lock(window_mutex_);
  window_.clear();  // a window never closed (an exception in the manager's body) is dropped
  window_prune_at_ = kWindowPruneAt;
  window_open_ = true;
}

c10::intrusive_ptr<c10d::Work> CallRecorder::close_window(int rank) {
  std::lock_guard<std::mutex> lock(window_mutex_);
  window_open_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.swap(window_);
  return c10::make_intrusive<WindowWork>(rank, std::move(works));
}

c10::intrusive_ptr<c10d::Work> CallRecorder::counted(c10::intrusive_ptr<c10d::Work> work) {
  ++issued_;
  if (window_open_.load(std::memory_order_relaxed) && work) {
    std::lock_guard<std::mutex> lock(window_mutex_);
    if (window_open_) {
      // A window torch never closes (an exception inside its manager) must not keep every later
      // call's tensors alive: calls that finished well need no wait, and go once the window is long.
      if (window_.size() >= window_prune_at_) {
        window_.erase(std::remove_if(window_.begin(), window_.end(),
                                     [](const auto& w) { return w->isCompleted() && w->isSuccess(); }),
                      window_.end());
        window_prune_at_ = std::max(kWindowPruneAt, 2 * window_.size());
      }
      window_.push_back(work);
    }
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> CallRecorder::followed(FlightLog::Ticket entry, bool device_tensors,
                                                      c10::intrusive_ptr<c10d::Work> work) {
  if (!entry.awaited() || !work) return work;
  if (entry.hooked) entry.completion_key = flight_->completion_key(*work);
  // hca's own Works say whether they issued to a stream (the CPU model's do); others go by the tensors.
  const auto* own = dynamic_cast<const WorkHCA*>(work.get());
  const bool on_device = own ? own->on_device() : device_tensors;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const c10::Error&) {  // a Work without a Future: what it issued is all the host sees
    flight_->finished(entry, true);
    return work;
  }
  if (future->completed()) {  // a blocking call run on the caller's thread
    if (!future->hasError()) flight_->finished(entry, on_device);
    return work;
  }
  future->addCallback([flight = flight_, entry, on_device](c10::ivalue::Future& done) {
    if (!done.hasError()) flight->finished(entry, on_device);
  });
  return work;
}

bool CallRecorder::on_a_device(const CommsCall& call) {
  for (const auto* list : {&call.inputs, &call.outputs}) {
    for (const auto& t : *list) {
      if (t.defined() && !t.is_cpu()) return true;
    }
  }
  return false;
}

int64_t CallRecorder::numel(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.defined() ? t.numel() : 0;
  return total;
}

at::ScalarType CallRecorder::dtype(const CommsCall& call) {
  for (const auto* list : {&call.inputs, &call.outputs}) {
    for (const auto& t : *list) {
      if (t.defined()) return t.scalar_type();
    }
  }
  return at::kByte;  // a call without tensors (barrier), as ProcessGroupNCCL records it
}

}  // namespace hca
