// send, recv and recvAnysource: each posts one message to the mailbox and
// returns at once; the mailbox's thread completes the Work.
#include <c10/util/Exception.h>

#include "../group/process_group_hca.hpp"

namespace hca {
namespace {

const char* op_text(c10d::OpType type) { return type == c10d::OpType::SEND ? "send" : "recv"; }

// Ends a message's Work: from `from`, with the mailbox's error (if any) as the Python exception
// torch users expect. A failure writes a Flight Recorder dump, but this rank's own ending of the
// group (messages pending at its destroy).
void ended(PointToPointWork& work, int from, const std::exception_ptr& error, const char* op) {
  work.set_source(from);
  if (!error) return work.complete(nullptr);
  bool dump = true;
  std::exception_ptr torch_error = error;
  try {
    std::rethrow_exception(error);
  } catch (const std::invalid_argument& e) {
    torch_error = std::make_exception_ptr(
        c10::ValueError({__func__, __FILE__, __LINE__}, std::string("hca ") + op + ": " + e.what()));
  } catch (const std::exception& e) {
    const auto* failure = dynamic_cast<const Failure*>(&e);
    dump = !failure || failure->kind() != FailureKind::Unusable;
    torch_error = std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, __LINE__}, e.what()));
  } catch (...) {
  }
  work.complete(torch_error, dump);
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
  }
  CallArgs args(op, tensors, type == c10d::OpType::SEND ? inputs_from(0) : nullptr);
  CallStreams* streams = message_streams(args.device());
  TORCH_CHECK_NOT_IMPLEMENTED(args.device().is_cpu() || streams, "hca ", op, ": tensors on ", args.device(),
                              " are not supported by this build (it has no executor for ", args.device().type(), ")");
  try {
    control_->begin(op, timeout_.load());  // refuses a group that failed before
  } catch (const Failure& e) {
    C10_THROW_ERROR(DistBackendError, e.what());
  }
  if (streams) return post_stream_message(type, *streams, std::move(args), tensors, peer, tag);
  auto work = c10::make_intrusive<PointToPointWork>(getRank(), type, tensors);
  auto kept = std::make_shared<const CallArgs>(std::move(args));
  const at::Tensor& dense = kept->dense()[0];
  const bool receives = type != c10d::OpType::SEND;
  shm::Message message{peer, tag, kept->descs()[0].dtype, dense.data_ptr(), dense.nbytes(), timeout_.load(),
                       [work, kept, receives, op](int from, std::exception_ptr error) {
                         if (!error && receives) {
                           try {
                             kept->write_back();
                           } catch (...) {
                             error = std::current_exception();
                           }
                         }
                         ended(*work, from, error, op);
                       }};
  if (receives) {
    mailbox_->recv(std::move(message));
  } else {
    mailbox_->send(std::move(message));
  }
  return work;
}

// Device tensors travel through host staging, in stream order: a send's bytes
// are copied to the host after the caller's current stream's work, and the
// mailbox sends them once that copy has passed; a receive's bytes arrive on the
// host, then are copied to the tensor after the caller's stream's work at the
// call. wait() blocks the host until the message has arrived (its bytes are
// on the host: a receive's copy is issued then), then orders the caller's
// stream after the copy, as a collective's wait() does.
c10::intrusive_ptr<c10d::Work> ProcessGroupHCA::post_stream_message(c10d::OpType type, CallStreams& streams,
                                                                    CallArgs args, std::vector<at::Tensor>& tensors,
                                                                    int peer, int tag) {
  const char* op = op_text(type);
  const DType dtype = args.descs()[0].dtype;
  const at::Device device = args.device();
  std::shared_ptr<StreamCall> call = streams.call(device);  // marks the caller's stream
  at::Tensor staging = call->host_staging(args.dense()[0]);
  std::vector<at::Tensor> touched(tensors);
  touched.push_back(staging);  // last
  auto kept = call->keep(CallTensors{std::move(args), std::move(touched)});
  auto work = c10::make_intrusive<PointToPointWork>(getRank(), type, tensors, call);
  // Issues `copy` on the call's stream after the caller's work; the call waits
  // on no peer, so nothing can release it: it is settled as it ends.
  auto issue = [call, kept](void (*copy)(const CallTensors&)) {
    DeviceGuard guard(call->runtime(), call->device_index());
    call->begin();
    call->on_stream([tensors = kept.get(), copy] { copy(*tensors); });
    call->end();
    call->issued()->settle();
    call->keep_until_passed(kept);
  };
  shm::Message message{peer, tag, dtype, staging.data_ptr(), staging.nbytes(), timeout_.load(), nullptr};
  if (type == c10d::OpType::SEND) {
    issue([](const CallTensors& t) { t.outputs.back().copy_(t.args.dense()[0], /*non_blocking=*/true); });
    message.ready = [call] { return call->passed_end(); };
    message.done = [work, kept, op](int from, std::exception_ptr error) {  // kept: the mailbox reads its staging
      ended(*work, from, error, op);
    };
    mailbox_->send(std::move(message));
  } else {
    message.done = [work, kept, issue, op](int from, std::exception_ptr error) {
      if (!error) {
        try {
          issue([](const CallTensors& t) {
            t.args.dense()[0].copy_(t.outputs.back(), /*non_blocking=*/true);
            t.args.write_back();
          });
        } catch (...) {
          error = std::current_exception();
        }
      }
      ended(*work, from, error, op);
    };
    mailbox_->recv(std::move(message));
  }
  return work;
}

}  // namespace hca
