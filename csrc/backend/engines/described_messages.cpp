#include "described_messages.hpp"

#include <c10/util/Exception.h>

#include <functional>
#include <future>
#include <thread>

#include "../calls/work_hca.hpp"
#include "engine_backend.hpp"

namespace hca {
namespace {

// The description: dtype (c10's number), element count, the message's number.
at::Tensor description(const at::Tensor& tensor, int64_t number) {
  at::Tensor d = at::empty({3}, at::kLong);
  d[0] = static_cast<int64_t>(tensor.scalar_type());
  d[1] = tensor.numel();
  d[2] = number;
  return d;
}

// gloo hands a receive the next message on its (peer, tag) slot, whatever its size: on the
// bytes' own slot, a second receive posted before the first one's bytes would get those bytes
// as its description (gloo aborts the process). Descriptions go on slots of their own: the tag
// plus 2^30, so a tag gloo carries lies in [0, 2^30).
constexpr int kDescriptionTag = 1 << 30;

int description_tag(int tag, const char* op) {
  TORCH_CHECK_VALUE(tag >= 0 && tag < kDescriptionTag, "hca ", op, ": tag ", tag,
                    " is out of range; where gloo carries the message (algorithm=\"nccl\" on CPU tensors, or ",
                    "between nodes), a tag lies in [0, 2^30): hca sends each message's description with its tag ",
                    "plus 2^30");
  return tag + kDescriptionTag;
}

// As Python names it ("float32"), as hca's mailbox does.
std::string dtype_text(at::ScalarType type) { return std::string(c10::getDtypeNames(type).first); }

// A send's two messages as one Work (gloo's sends complete in wait()).
class DescribedSend final : public c10d::Work {
 public:
  DescribedSend(int rank, std::vector<at::Tensor> tensors, c10::intrusive_ptr<c10d::Work> described,
                c10::intrusive_ptr<c10d::Work> bytes)
      : c10d::Work(rank, c10d::OpType::SEND, "hca:send", tensors),
        tensors_(std::move(tensors)),
        described_(std::move(described)),
        bytes_(std::move(bytes)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    described_->wait(timeout);
    const bool done = bytes_->wait(timeout);
    finish();
    return done;
  }
  void abort() override {
    described_->abort();
    bytes_->abort();
  }
  std::vector<at::Tensor> result() override { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
  c10::intrusive_ptr<c10d::Work> described_, bytes_;
};

}  // namespace

struct DescribedMessages::Order {
  using Pair = std::pair<int, int>;  // (peer, tag)
  // Posts the bytes' receive of message `number` from `from` in its turn: at once where every
  // earlier one is posted (and then those that waited for it), else by the receive before it.
  // Only the receives of that pair wait, each for its own turn (waking every waiting receive
  // at each post made many posted receives cost time quadratic in their number).
  void post_in_turn(Pair from, int64_t number, std::function<void()> post) {
    std::lock_guard<std::mutex> lock(mutex);
    Received& pair = received[from];
    pair.waiting.emplace(number, std::move(post));
    for (auto next = pair.waiting.find(pair.posted); next != pair.waiting.end();
         next = pair.waiting.find(pair.posted)) {
      next->second();
      pair.waiting.erase(next);
      ++pair.posted;
    }
  }

  std::mutex mutex;
  std::map<Pair, int64_t> sent;  // messages sent
  struct Received {
    int64_t posted = 0;                                 // bytes' receives posted
    std::map<int64_t, std::function<void()>> waiting;  // by message number, for their turn
  };
  std::map<Pair, Received> received;
};

DescribedMessages::DescribedMessages(int rank) : rank_(rank), order_(std::make_shared<Order>()) {}

c10::intrusive_ptr<c10d::Work> DescribedMessages::send(c10d::Backend& engine, const at::Tensor& tensor, int peer,
                                                       int tag) {
  const int described_tag = description_tag(tag, "send");
  int64_t number;
  {
    std::lock_guard<std::mutex> lock(order_->mutex);
    number = order_->sent[{peer, tag}]++;
  }
  std::vector<at::Tensor> described{description(tensor, number)};
  std::vector<at::Tensor> bytes{engine_bytes(tensor, "send")};
  auto described_work = engine.send(described, peer, described_tag);
  return c10::make_intrusive<DescribedSend>(rank_, std::vector<at::Tensor>{tensor}, std::move(described_work),
                                            engine.send(bytes, peer, tag));
}

c10::intrusive_ptr<c10d::Work> DescribedMessages::recv(c10d::Backend& engine, const at::Tensor& tensor, int peer,
                                                       int tag) {
  const int described_tag = description_tag(tag, "recv");
  auto work = c10::make_intrusive<PointToPointWork>(rank_, peer < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV,
                                                    std::vector<at::Tensor>{tensor});
  std::vector<at::Tensor> described{at::empty({3}, at::kLong)};
  auto described_work =
      peer < 0 ? engine.recvAnysource(described, described_tag) : engine.recv(described, peer, described_tag);
  auto keep_engine = c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(&engine);
  std::thread([work, described, described_work, keep_engine, order = order_, tensor, peer, tag] {
    std::exception_ptr error;
    int source = peer;
    try {
      described_work->wait();  // the engine's timeout
      if (source < 0) source = described_work->sourceRank();
      const auto sent_type = static_cast<at::ScalarType>(described[0][0].item<int64_t>());
      const int64_t sent_numel = described[0][1].item<int64_t>(), number = described[0][2].item<int64_t>();
      const bool fits = sent_type == tensor.scalar_type() && sent_numel == tensor.numel();
      std::vector<at::Tensor> into{engine_bytes(fits ? tensor : at::empty({sent_numel}, sent_type), "recv")};
      // Run here or on the thread of the receive before it; this thread waits for it.
      std::promise<c10::intrusive_ptr<c10d::Work>> posted;
      order->post_in_turn({source, tag}, number, [&] {
        try {
          posted.set_value(keep_engine->recv(into, source, tag));
        } catch (...) {
          posted.set_exception(std::current_exception());
        }
      });
      posted.get_future().get()->wait();
      TORCH_CHECK_VALUE(fits, "hca recv: rank ", source, " sent ", sent_numel, " x ", dtype_text(sent_type),
                        " with tag ", tag, ", but this recv expects ", tensor.numel(), " x ",
                        dtype_text(tensor.scalar_type()));
    } catch (...) {
      error = std::current_exception();
    }
    work->set_source(source);
    work->complete(error);
  }).detach();
  return work;
}

}  // namespace hca
