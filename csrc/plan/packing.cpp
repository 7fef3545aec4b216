#include "packing.h"

#include <algorithm>
#include <stdexcept>

namespace hca {
namespace {

// Cuts the concatenation of `members` (tensor indices of one dtype) into
// `parts` near-equal packs: the first (total % parts) packs get one extra element.
void split_concatenation(const std::vector<TensorDesc>& tensors, const std::vector<size_t>& members,
                         size_t parts, size_t& next_index, std::vector<Pack>& out) {
  size_t total = 0;
  for (size_t t : members) total += tensors[t].numel;
  size_t member = 0, offset = 0;
  for (size_t p = 0; p < parts; ++p) {
    size_t want = total / parts + (p < total % parts ? 1 : 0);
    Pack pack{next_index++, tensors[members.empty() ? 0 : members[0]].dtype, want, {}};
    while (want > 0) {
      const size_t t = members[member];
      const size_t take = std::min(want, tensors[t].numel - offset);
      if (take > 0) pack.segments.push_back({t, offset, take});
      want -= take;
      offset += take;
      if (offset == tensors[t].numel) {
        ++member;
        offset = 0;
      }
    }
    if (pack.numel > 0) out.push_back(std::move(pack));
  }
}

std::vector<Pack> concat_and_split(const std::vector<TensorDesc>& tensors, size_t num_packs) {
  // One concatenation per dtype, in order of first appearance.
  std::vector<DType> order;
  std::vector<std::vector<size_t>> by_dtype;
  for (size_t t = 0; t < tensors.size(); ++t) {
    size_t d = 0;
    while (d < order.size() && order[d] != tensors[t].dtype) ++d;
    if (d == order.size()) {
      order.push_back(tensors[t].dtype);
      by_dtype.emplace_back();
    }
    by_dtype[d].push_back(t);
  }
  std::vector<Pack> packs;
  size_t next_index = 0;
  for (const auto& members : by_dtype) split_concatenation(tensors, members, num_packs, next_index, packs);
  return packs;
}

std::vector<Pack> aggregate_small(const std::vector<TensorDesc>& tensors, size_t max_bytes, size_t max_group) {
  std::vector<Pack> packs;
  size_t index = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& desc = tensors[t];
    const bool small = desc.numel * element_size(desc.dtype) < max_bytes;
    Pack* last = packs.empty() ? nullptr : &packs.back();
    const bool joins = small && last && last->segments.size() < max_group && last->dtype == desc.dtype &&
                       last->segments.back().tensor == t - 1 && tensors[t - 1].numel * element_size(desc.dtype) < max_bytes;
    if (joins) {
      last->segments.push_back({t, 0, desc.numel});
      last->numel += desc.numel;
    } else {
      packs.push_back({index++, desc.dtype, desc.numel, {{t, 0, desc.numel}}});
    }
  }
  return packs;
}

}  // namespace

std::vector<Pack> make_packs(const std::vector<TensorDesc>& tensors, const PackingOptions& options) {
  std::vector<Pack> packs;
  if (options.num_packs > 0) {
    packs = concat_and_split(tensors, static_cast<size_t>(options.num_packs));
  } else if (options.agg_small_grads_max_bytes > 0 && options.agg_small_grads_max_group > 0) {
    packs = aggregate_small(tensors, static_cast<size_t>(options.agg_small_grads_max_bytes),
                            static_cast<size_t>(options.agg_small_grads_max_group));
  } else {
    for (size_t t = 0; t < tensors.size(); ++t) {
      packs.push_back({t, tensors[t].dtype, tensors[t].numel, {{t, 0, tensors[t].numel}}});
    }
  }
  // Zero-element tensors take part in no pack.
  std::vector<Pack> nonempty;
  for (auto& p : packs) {
    if (p.numel > 0) nonempty.push_back(std::move(p));
  }
  return nonempty;
}

}  // namespace hca
