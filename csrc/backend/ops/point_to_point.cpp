// send, recv and recvAnysource: each posts one message to the mailbox and
// returns at once; the mailbox's thread completes the Work.
#include <c10/util/Exception.h>

#include "../group/process_group_hca.hpp"

namespace hca {
namespace {

const char* op_text(c10d::OpType type) { return type == c10d::OpType::SEND ? "send" : "recv"; }

// The mailbox's errors as the Python exceptions torch users expect.
std::exception_ptr as_torch_error(const std::exception_ptr& error, const char* op) {
  try {
    std::rethrow_exception(error);
  } catch (const std::invalid_argument& e) {
    try {
      TORCH_CHECK_VALUE(false, "hca ", op, ": ", e.what());
    } catch (...) {
      return std::current_exception();
    }
  } catch (const std::exception& e) {
    try {
      C10_THROW_ERROR(DistBackendError, e.what());
    } catch (...) {
      return std::current_exception();
    }
  }
  return error;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return calls_(*this, CommsCall::message("send", tensors, dst), true,
                [&] { return post_message(c10d::OpType::SEND, tensors, dst, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return calls_(*this, CommsCall::message("recv", tensors, src), true,
                [&] { return post_message(c10d::OpType::RECV, tensors, src, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return calls_(*this, CommsCall::message("recv", tensors, -1), true,
                [&] { return post_message(c10d::OpType::RECVANYSOURCE, tensors, -1, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::post_message(c10d::OpType type, std::vector<at::Tensor>& tensors,
                                                             int peer, int tag) {
  const char* op = op_text(type);
  const auto call = life_.enter(op);  // held while this thread uses the group's parts
  TORCH_CHECK_VALUE(tensors.size() == 1, "hca ", op, ": expects one tensor, got ", tensors.size());
  if (type != c10d::OpType::RECVANYSOURCE) {
    const char* role = type == c10d::OpType::SEND ? "dst" : "src";
    check_rank(peer, getSize(), role, op);
    TORCH_CHECK_VALUE(peer != getRank(), "hca ", op, ": ", role, " ", peer, " is this rank itself");
  }
  auto args = std::make_shared<const CallArgs>(op, tensors);
  TORCH_CHECK_NOT_IMPLEMENTED(args->device().is_cpu(), "hca ", op, ": point-to-point on ", args->device(),
                              " tensors is not supported yet (CPU tensors only)");
  try {
    control_->begin(op, timeout_.load());  // refuses a group that failed before
  } catch (const Failure& e) {
    C10_THROW_ERROR(DistBackendError, e.what());
  }
  auto work = c10::make_intrusive<PointToPointWork>(getRank(), type, tensors);
  const at::Tensor& dense = args->dense()[0];
  const bool receives = type != c10d::OpType::SEND;
  shm::Message message{peer, tag, args->descs()[0].dtype, dense.data_ptr(), dense.nbytes(), timeout_.load(),
                       [work, args, receives, op](int from, std::exception_ptr error) {
                         if (!error && receives) {
                           try {
                             args->write_back();
                           } catch (...) {
                             error = std::current_exception();
                           }
                         }
                         work->set_source(from);
                         work->complete(error ? as_torch_error(error, op) : nullptr);
                       }};
  if (receives) {
    mailbox_->recv(std::move(message));
  } else {
    mailbox_->send(std::move(message));
  }
  return work;
}

}  // namespace hca
