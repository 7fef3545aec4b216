#include "window_work.hpp"

#include <algorithm>

namespace hca {

WindowWork::WindowWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
    : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {
  if (works_.size() == 1) {
    future_ = works_[0]->getFuture();
    return;
  }
  if (works_.empty()) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    return;
  }
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
      c10::FutureType::create(works_[0]->getFuture()->elementType()));
  for (const auto& work : works_) futures.push_back(work->getFuture());
  future_ = c10::collectAll(futures);
}

bool WindowWork::isCompleted() {
  return std::all_of(works_.begin(), works_.end(), [](const auto& work) { return work->isCompleted(); });
}

bool WindowWork::isSuccess() const {
  return std::all_of(works_.begin(), works_.end(), [](const auto& work) { return work->isSuccess(); });
}

bool WindowWork::wait(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  for (const auto& work : works_) {
    if (timeout == kNoTimeout) {
      work->wait(kNoTimeout);
      continue;
    }
    // At least a millisecond: zero would mean no timeout at all.
    const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                               std::chrono::milliseconds(1));
    if (!work->wait(left)) return false;
  }
  return true;
}

void WindowWork::synchronize() {
  for (const auto& work : works_) work->synchronize();
}

std::vector<at::Tensor> WindowWork::result() {
  std::vector<at::Tensor> all;
  for (const auto& work : works_) {
    auto part = work->result();
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

c10::intrusive_ptr<c10::ivalue::Future> WindowWork::getFuture() { return future_; }

}  // namespace hca
