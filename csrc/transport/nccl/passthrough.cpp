#include "passthrough.hpp"

#include <ATen/ATen.h>

namespace hca::nccl {
namespace {

at::Tensor slice(const at::Tensor& tensor, const Segment& seg) {
  return tensor.view(-1).narrow(0, static_cast<int64_t>(seg.offset), static_cast<int64_t>(seg.numel));
}

// A pack that is exactly one whole tensor is reduced in place, without a copy.
bool is_whole_tensor(const Pack& pack, const std::vector<at::Tensor>& tensors) {
  return pack.segments.size() == 1 && pack.segments[0].offset == 0 &&
         static_cast<int64_t>(pack.segments[0].numel) == tensors[pack.segments[0].tensor].numel();
}

}  // namespace

PackedAllreduce::PackedAllreduce(c10d::Backend& engine, std::vector<at::Tensor> tensors, std::vector<Pack> packs,
                                 c10d::ReduceOp op, std::chrono::milliseconds timeout)
    : tensors_(std::move(tensors)), packs_(std::move(packs)), average_(op == c10d::ReduceOp::AVG),
      world_(engine.getSize()) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = average_ ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
  opts.timeout = timeout;
  for (const Pack& pack : packs_) {
    if (is_whole_tensor(pack, tensors_)) {
      flats_.push_back(tensors_[pack.segments[0].tensor].view(-1));
    } else {
      std::vector<at::Tensor> parts;
      for (const Segment& seg : pack.segments) parts.push_back(slice(tensors_[seg.tensor], seg));
      flats_.push_back(at::cat(parts));
    }
    std::vector<at::Tensor> one{flats_.back()};
    works_.push_back(engine.allreduce(one, opts));
  }
}

void PackedAllreduce::finish() {
  for (size_t p = 0; p < packs_.size(); ++p) {
    works_[p]->wait();
    if (average_) flats_[p].div_(world_);
    if (is_whole_tensor(packs_[p], tensors_)) continue;
    int64_t at = 0;
    for (const Segment& seg : packs_[p].segments) {
      slice(tensors_[seg.tensor], seg).copy_(flats_[p].narrow(0, at, static_cast<int64_t>(seg.numel)));
      at += static_cast<int64_t>(seg.numel);
    }
  }
}

}  // namespace hca::nccl
