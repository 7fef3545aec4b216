// Packing: how the tensors of one call are cut into packs, each reduced as a
// unit with its own leader. Sizes and offsets count elements, never bytes.
#pragma once
#include <cstddef>
#include <vector>

#include "types.h"

namespace hca {

struct TensorDesc {
  DType dtype;
  size_t numel;
};

// A contiguous run of one tensor's elements.
struct Segment {
  size_t tensor;
  size_t offset;
  size_t numel;
};

// A pack: one dtype, its elements being the segments laid end to end.
// `index` is the pack's position in the packing (it picks the leader); it
// counts empty packs that were dropped, so the rotation matches the request.
struct Pack {
  size_t index;
  DType dtype;
  size_t numel;
  std::vector<Segment> segments;
};

struct PackingOptions {
  int num_packs = 1;
  long long agg_small_grads_max_bytes = 0;
  int agg_small_grads_max_group = 10;
};

// The seed's rule: num_packs > 0 concatenates the tensors of each dtype and
// splits them into num_packs near-equal packs; else, with both aggregation
// options > 0, runs of consecutive small tensors of one dtype (bytes below
// agg_small_grads_max_bytes) form packs of at most agg_small_grads_max_group;
// else every tensor is its own pack. Packs never mix dtypes; empty packs are
// dropped.
std::vector<Pack> make_packs(const std::vector<TensorDesc>& tensors, const PackingOptions& options);

}  // namespace hca
