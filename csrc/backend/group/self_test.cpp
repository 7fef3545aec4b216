// The self-test a group runs at its first collective on a stream transport
// (CUDA, or the CPU model of the device). Until hca's CUDA path has run on a
// GPU, its first user is its first test: better to refuse at once, naming
// what came out wrong, than to let a job train on wrong gradients.
//
// Each algorithm's all-reduce and broadcast of a known pattern, both issued
// before either is waited (two calls in flight on the group's stream), with
// inputs written and outputs read by the caller's stream and one element off
// the allocation's alignment (the copies' odd head and tail). Every rank
// checks its results against values computed on the host, and the ranks tell
// each other their verdicts through the store, so that all of them raise.
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#include "process_group_hca.hpp"

namespace hca {
namespace {

// Several staging rounds at the default slot sizes, and a tail of odd length.
constexpr int64_t kElements = (1 << 18) + 3;

// (i % 251 + 1) * scale + shift, exact in float32 for the sums here.
at::Tensor pattern(double scale, double shift) {
  auto i = at::arange(kElements, at::TensorOptions().dtype(at::kDouble));
  return (at::remainder(i, 251) + 1).mul(scale).add(shift).to(at::kFloat);
}

// A float32 tensor on `device` holding `values`, one element past its allocation's start.
at::Tensor misaligned_copy(const at::Tensor& values, const at::Device& device) {
  auto buffer = at::empty({kElements + 1}, values.options().device(device));
  auto view = buffer.narrow(0, 1, kElements);
  view.copy_(values);
  return view;
}

// Empty if `got` equals `want` everywhere, else where and how it differs.
std::string difference(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  const auto host = got.cpu();
  const auto wrong = host.ne(want).nonzero();
  if (wrong.size(0) == 0) return "";
  const int64_t at = wrong[0][0].item<int64_t>();
  return what + " differs at " + std::to_string(wrong.size(0)) + " of " + std::to_string(kElements) +
         " elements (first at " + std::to_string(at) + ": got " + std::to_string(host[at].item<float>()) +
         ", want " + std::to_string(want[at].item<float>()) + ")";
}

}  // namespace

bool ProcessGroupHCA::self_test_wanted() {
  const char* set = std::getenv("TORCH_HCA_SELF_TEST");
  const std::string value = set ? set : "";
  // Anything else (a "false", a "no") would leave the test running unnoticed.
  TORCH_CHECK_VALUE(value.empty() || value == "0" || value == "1", "TORCH_HCA_SELF_TEST='", value,
                    "': expected '0' (skip the self-test) or '1' (run it, the default)");
  return value != "0";
}

void ProcessGroupHCA::self_test_once(const at::Device& device) {
  if (!self_test_wanted_) return;
  // Held while it runs: another thread's first call waits for it, not races it.
  std::lock_guard<std::recursive_mutex> lock(self_test_mutex_);
  if (!self_tested_.insert(device.type()).second) return;

  const int world = getSize(), root = world - 1;
  const double ranks_sum = world * (world + 1) / 2.0;
  std::string found;
  for (Algorithm mode : {Algorithm::HierarchicalCopy, Algorithm::ReduceToOneDevice, Algorithm::Direct}) {
    PlanOptions options = options_for(device);
    options.algorithm = mode;
    options.by_size.clear();  // a table would choose for every mode alike
    const std::string name = std::string(algorithm_name(mode));
    auto summed = misaligned_copy(pattern(getRank() + 1, 0), device);
    auto broadcast = misaligned_copy(getRank() == root ? pattern(-1, -0.25) : pattern(getRank() + 1, 0), device);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      CallArgs args("allreduce", {summed});
      Collective c{std::make_shared<const std::vector<PackPlan>>(plan_allreduce(args.descs(), world, options)),
                   args.in_place(0, 1), ReduceOp::Sum, "self-test " + name + " allreduce(" + args.text(0, 1) + ", SUM)"};
      works.push_back(launch(c10d::OpType::ALLREDUCE, std::move(args), {std::move(c)}, {summed}, timeout_.load(), true,
                             "hca:internal_self_test"));
    }
    {
      CallArgs args("broadcast", {broadcast});
      Collective c{std::make_shared<const std::vector<PackPlan>>(plan_broadcast(args.descs(), world, root)),
                   args.in_place(0, 1), ReduceOp::Sum, "self-test " + name + " broadcast(" + args.text(0, 1) + ")"};
      works.push_back(launch(c10d::OpType::BROADCAST, std::move(args), {std::move(c)}, {broadcast}, timeout_.load(),
                             true, "hca:internal_self_test"));
    }
    for (auto& work : works) work->wait();
    // The host reads them: on the model of the device, whose host may run ahead of the caller's stream, after it.
    if (device.is_cpu() && cpu_call_streams_) cpu_call_streams_->synchronize_caller(device);
    for (const std::string& wrong : {difference(name + "'s all-reduce", summed, pattern(ranks_sum, 0)),
                                     difference(name + "'s broadcast", broadcast, pattern(-1, -0.25))}) {
      if (!wrong.empty() && found.empty()) found = wrong;
    }
  }

  // Every rank's verdict, so that each raises where any one saw a wrong value.
  const std::string key = std::string("hca_self_test/") + c10::DeviceTypeName(device.type()) + "/";
  store_->set(key + std::to_string(getRank()), std::vector<uint8_t>(found.begin(), found.end()));
  std::string report;
  for (int r = 0; r < world; ++r) {
    store_->wait({key + std::to_string(r)}, timeout_.load());
    const auto verdict = store_->get(key + std::to_string(r));
    if (!verdict.empty()) report += "; rank " + std::to_string(r) + ": " + std::string(verdict.begin(), verdict.end());
  }
  if (report.empty()) return;
  const std::string message =
      "hca: the self-test at this group's first collective on " + c10::DeviceTypeName(device.type(), true) +
      " tensors found wrong results" + report +
      ". hca's stream transport is not to be trusted on this machine: use torch_hca.Options(algorithm=\"nccl\") "
      "(stock NCCL) and report this (TORCH_HCA_SELF_TEST=0 skips the test)";
  fail(FailureKind::Setup, message);  // the group refuses every later call
  C10_THROW_ERROR(DistBackendError, message);
}

}  // namespace hca
