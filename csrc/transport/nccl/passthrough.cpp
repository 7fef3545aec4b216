#include "passthrough.hpp"

#include <ATen/ATen.h>

#include <algorithm>

namespace hca::nccl {
namespace {

at::Tensor slice(const at::Tensor& tensor, const Segment& seg) {
  return tensor.view(-1).narrow(0, static_cast<int64_t>(seg.offset), static_cast<int64_t>(seg.numel));
}

}  // namespace

at::Tensor packed(const std::vector<at::Tensor>& tensors, const Pack& pack) {
  if (pack.segments.size() == 1) return slice(tensors[pack.segments[0].tensor], pack.segments[0]);
  std::vector<at::Tensor> parts;
  for (const Segment& seg : pack.segments) parts.push_back(slice(tensors[seg.tensor], seg));
  return at::cat(parts);
}

void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, const Pack& pack) {
  if (pack.segments.size() == 1) return;
  int64_t at = 0;
  for (const Segment& seg : pack.segments) {
    slice(tensors[seg.tensor], seg).copy_(flat.narrow(0, at, static_cast<int64_t>(seg.numel)));
    at += static_cast<int64_t>(seg.numel);
  }
}

c10d::ReduceOp engine_op(const c10d::ReduceOp& op) {
  return op == c10d::ReduceOp::AVG ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
}

bool engine_averages(const std::vector<at::Tensor>& tensors) {
  return !tensors.empty() && tensors[0].is_cuda() && at::isFloatingType(tensors[0].scalar_type());
}

PackedAllreduce::PackedAllreduce(c10d::Backend& engine, std::vector<at::Tensor> tensors, std::vector<Pack> packs,
                                 c10d::ReduceOp op, std::chrono::milliseconds timeout)
    : tensors_(std::move(tensors)), packs_(std::move(packs)),
      average_(op == c10d::ReduceOp::AVG && !engine_averages(tensors_)),
      world_(engine.getSize()) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = average_ ? engine_op(op) : op;
  opts.timeout = timeout;
  for (const Pack& pack : packs_) {
    flats_.push_back(packed(tensors_, pack));
    std::vector<at::Tensor> one{flats_.back()};
    works_.push_back(engine.allreduce(one, opts));
  }
}

void PackedAllreduce::finish() {
  for (size_t p = 0; p < packs_.size(); ++p) {
    works_[p]->wait();
    if (average_) flats_[p].div_(world_);
    unpack(flats_[p], tensors_, packs_[p]);
  }
}

bool PackedAllreduce::writes_tensors() const {
  return average_ || std::any_of(packs_.begin(), packs_.end(), [](const Pack& pack) { return pack.segments.size() > 1; });
}

}  // namespace hca::nccl
