// The Work that ends a coalescing window (torch's _coalescing_manager, which
// replaces the Works of the calls made in the window by this one): the window's
// calls as one. ProcessGroupNCCL's stands for its last kernel on its one
// stream; hca's calls may run on different streams (collectives, messages) and
// devices, so this one waits for each call, on the caller's thread, where each
// Work orders the caller's current stream after its own device work.
#pragma once
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <vector>

namespace hca {

class WindowWork final : public c10d::Work {
 public:
  WindowWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works);
  bool isCompleted() override;
  bool isSuccess() const override;
  // Each call's wait(), in issue order, within `timeout` for all.
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override;
  // A single call's Future; else one that completes once every call's has,
  // holding theirs (each orders its waiter's streams after its device work).
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace hca
