// allreduce of a sparse COO tensor (SUM), as gloo does it: every rank's
// indices and values are gathered (padded to the largest count), joined and
// coalesced, which adds the values of equal indices. It runs three small
// blocking collectives on the caller's thread, so it blocks even when async.
#include <c10/util/Exception.h>

#include <algorithm>

#include "../group/process_group_hca.hpp"

namespace hca {

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::allreduce_sparse(at::Tensor& tensor,
                                                                 const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(tensor.layout() == at::kSparse, "hca allreduce: ", tensor.layout(),
                    " tensors are not supported (dense and sparse COO tensors only)");
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM, "hca allreduce: sparse tensors support ReduceOp.SUM only");
  TORCH_CHECK_NOT_IMPLEMENTED(tensor.device().is_cpu(), "hca allreduce: sparse tensors on ", tensor.device(),
                              " are not supported (CPU only)");
  const at::Tensor input = tensor.coalesce();
  plan_dtype(input.scalar_type(), "allreduce");
  const auto timeout = timeout_or_default(opts.timeout);
  const int world = getSize();

  // What every rank holds: its count of indices, then the layout, which must agree.
  std::vector<int64_t> mine{input._nnz(), input.sparse_dim(), input.dense_dim()};
  for (int64_t s : input.sizes()) mine.push_back(s);
  const auto all = exchange(mine, timeout);
  const size_t n = mine.size();
  int64_t most = 0;
  for (int r = 0; r < world; ++r) {
    const bool same = std::equal(mine.begin() + 1, mine.end(), all.begin() + r * n + 1);
    TORCH_CHECK_VALUE(same, "hca allreduce: rank ", r, "'s sparse tensor differs from rank ", getRank(),
                      "'s in its sizes or its sparse and dense dimensions (", input.sizes(), ")");
    most = std::max(most, all[r * n]);
  }

  // Indices and values, padded to the largest count, gathered from every rank.
  const int64_t nnz = input._nnz();
  at::Tensor indices = at::zeros({input.sparse_dim(), most}, at::kLong);
  indices.narrow(1, 0, nnz).copy_(input._indices());
  std::vector<int64_t> value_shape{most};
  for (int64_t d = input.sparse_dim(); d < input.dim(); ++d) value_shape.push_back(input.size(d));
  at::Tensor values = at::zeros(value_shape, input._values().options());
  values.narrow(0, 0, nnz).copy_(input._values());
  at::Tensor all_indices = at::empty({world * indices.numel()}, indices.options());
  at::Tensor all_values = at::empty({world * values.numel()}, values.options());
  gather_step(all_indices, indices, timeout, "hca:internal_sparse_gather");
  gather_step(all_values, values, timeout, "hca:internal_sparse_gather");

  std::vector<at::Tensor> index_parts, value_parts;
  auto per_rank_values = value_shape;
  per_rank_values.insert(per_rank_values.begin(), world);
  const at::Tensor gathered_indices = all_indices.view({world, input.sparse_dim(), most});
  const at::Tensor gathered_values = all_values.view(per_rank_values);
  for (int r = 0; r < world; ++r) {
    index_parts.push_back(gathered_indices[r].narrow(1, 0, all[r * n]));
    value_parts.push_back(gathered_values[r].narrow(0, 0, all[r * n]));
  }
  const at::Tensor sum =
      at::sparse_coo_tensor(at::cat(index_parts, 1), at::cat(value_parts, 0), input.sizes()).coalesce();
  tensor.copy_(sum);
  auto work = c10::make_intrusive<WorkHCA>(getRank(), c10d::OpType::ALLREDUCE, std::vector<at::Tensor>{tensor},
                                           nullptr);
  work->complete(nullptr);
  return work;
}

}  // namespace hca
