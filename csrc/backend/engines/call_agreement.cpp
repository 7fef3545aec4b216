#include "call_agreement.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "../../transport/control/control_block.h"
#include "../calls/call_args.hpp"
#include "../group/owning_process.hpp"
#include "../group/store_rendezvous.hpp"

namespace hca {
namespace {

// gloo's all-reduce of one element is its fastest collective by far (a few elements already
// take it several times longer on a small VM: 120 us against 390 for two, 2 ranks), so the
// ranks agree through one such sum, and exchange the calls themselves only to say how they
// differ. Each rank adds a digest of its call (and, in an all-to-all, its side of the split
// sizes): where every rank called the same, the sum is the ranks' count times any rank's digest.
// Every rank checks that against its own: a rank whose call differs sees it differ, and so does
// every other rank, unless the digests happen to be in a linear relation (a chance of about
// 2^-40), in which case gloo gets the call as it would unchecked.
constexpr int kDigestBits = 40;
constexpr uint64_t kModulus = uint64_t{1} << kDigestBits;  // the ranks' sum of such values cannot overflow

// Every rank's `row`, in rank order.
at::Tensor gathered(c10d::Backend& engine, const at::Tensor& row) {
  at::Tensor every = at::empty({row.numel() * engine.getSize()}, row.options());
  at::Tensor mine = row;
  engine._allgather_base(every, mine, c10d::AllgatherOptions())->wait();
  return every;
}

// FNV-1a: the same digest of a text in every process, whatever its build.
uint64_t digest(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h % kModulus;
}

// A weight per ordered pair of ranks (splitmix64): the ranks' sum of their sides of every pair
// (sent minus received, weighted by the pair) is 0 where each pair agrees, and another value
// otherwise (but for a chance of about 2^-40).
uint64_t pair_weight(int from, int to, int world) {
  uint64_t z = static_cast<uint64_t>(from) * static_cast<uint64_t>(world) + static_cast<uint64_t>(to) +
               0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr size_t kTextBytes = 256;  // a call's text in the exchange that names a mismatch

std::string prefix(const char* op) {
  return "hca " + std::string(op) + ": mismatched calls, refused before gloo got them: ";
}

// Raises naming the ranks whose calls' texts differ, if any do.
void name_the_texts(c10d::Backend& engine, const std::string& text, const char* op,
                    const std::function<std::string(int)>& member) {
  at::Tensor row = at::zeros({static_cast<int64_t>(kTextBytes)}, at::kByte);
  const std::string fitted = fitted_text(text, kTextBytes - 1);
  std::memcpy(row.data_ptr<uint8_t>(), fitted.data(), fitted.size());
  const at::Tensor every = gathered(engine, row);
  auto text_of = [&](int r) {
    return std::string(reinterpret_cast<const char*>(every.data_ptr<uint8_t>() + kTextBytes * r));
  };
  const int me = engine.getRank();
  for (int r = 0; r < engine.getSize(); ++r) {
    if (text_of(r) != text_of(me)) {
      C10_THROW_ERROR(DistBackendError, prefix(op) + member(me) + " called " + text_of(me) + " but " + member(r) +
                                            " called " + text_of(r));
    }
  }
}

[[noreturn]] void name_the_pair(c10d::Backend& engine, const CallTerms& terms, const char* op,
                                const std::function<std::string(int)>& member) {
  const int world = engine.getSize();
  at::Tensor row = at::empty({2 * world}, at::kLong);
  for (int r = 0; r < world; ++r) {
    row[2 * r] = terms.sends[r];
    row[2 * r + 1] = terms.receives[r];
  }
  const at::Tensor every = gathered(engine, row);
  const int64_t* counts = every.data_ptr<int64_t>();  // [rank][peer][sends, receives]
  for (int from = 0; from < world; ++from) {
    for (int to = 0; to < world; ++to) {
      const int64_t sent = counts[(from * world + to) * 2], received = counts[(to * world + from) * 2 + 1];
      if (sent == received) continue;
      C10_THROW_ERROR(DistBackendError, prefix(op) + member(from) + " sends " + std::to_string(sent) + " elements to " +
                                            member(to) + ", which receives " + std::to_string(received) +
                                            " from it, in " + terms.text);
    }
  }
  C10_THROW_ERROR(DistBackendError, prefix(op) + "the ranks' split sizes do not pair up in " + terms.text);
}

}  // namespace

PendingAgreement::PendingAgreement(c10d::Backend& engine, CallTerms terms, const char* op,
                                   std::function<std::string(int)> member)
    : engine_(&engine), terms_(std::move(terms)), op_(op), member_(std::move(member)) {
  const int world = engine.getSize(), me = engine.getRank();
  if (world == 1) return;
  TORCH_INTERNAL_ASSERT(terms_.sends.size() == terms_.receives.size() &&
                        (terms_.sends.empty() || terms_.sends.size() == static_cast<size_t>(world)));
  digest_ = digest(terms_.text);
  uint64_t balance = 0;  // an all-to-all's side of each of this rank's pairs
  for (int peer = 0; peer < static_cast<int>(terms_.sends.size()); ++peer) {
    balance += pair_weight(me, peer, world) * static_cast<uint64_t>(terms_.sends[peer]);
    balance -= pair_weight(peer, me, world) * static_cast<uint64_t>(terms_.receives[peer]);
  }
  sum_ = {at::full({1}, static_cast<int64_t>((digest_ + balance % kModulus) % kModulus), at::kLong)};
  work_ = engine.allreduce(sum_, c10d::AllreduceOptions());  // SUM, the engine's timeout
}

void PendingAgreement::settle() {
  if (!work_) return;  // one rank, or settled already
  const auto work = std::move(work_);
  work->wait();
  const uint64_t sum = static_cast<uint64_t>(sum_[0].item<int64_t>());
  const uint64_t world = static_cast<uint64_t>(engine_->getSize());
  if (sum % kModulus == (world * digest_) % kModulus) return;
  // Every rank is here (but for the chance above): the texts first, then an all-to-all's pairs.
  name_the_texts(*engine_, terms_.text, op_, member_);
  if (!terms_.sends.empty()) name_the_pair(*engine_, terms_, op_, member_);
  C10_THROW_ERROR(DistBackendError, prefix(op_) + member_(engine_->getRank()) + " called " +
                                        fitted_text(terms_.text, kTextBytes - 1) +
                                        ", and some rank's call differs beyond what the message shows");
}

void agree_on_call(c10d::Backend& engine, CallTerms terms, const char* op, std::function<std::string(int)> member) {
  PendingAgreement(engine, std::move(terms), op, std::move(member)).settle();
}

SharedAgreements::SharedAgreements(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   std::chrono::milliseconds timeout) {
  StoreRendezvous rendezvous(store);
  try {
    control_ = std::make_unique<ControlBlock>(rendezvous, rank, size, timeout);
  } catch (const std::exception& e) {
    publish_setup_failure(rendezvous, rank, e.what());  // the peers raise it at once
    throw;
  }
}

SharedAgreements::~SharedAgreements() = default;

void SharedAgreements::agree(const std::string& text, const char* op, std::chrono::milliseconds timeout) {
  const size_t room = kSignatureBytes - 1;
  std::string posted = text;
  if (posted.size() > room) {
    const std::string tail = " ~" + std::to_string(digest(text));
    posted = fitted_text(text, room - tail.size()) + tail;
  }
  try {
    control_->start(posted, control_->begin(posted, timeout));
  } catch (const Failure& failure) {
    if (failure.kind() == FailureKind::Mismatch) {  // found by every rank, before anything moved
      const std::string& cause = failure.cause();  // worded as the gloo route words it, under its prefix
      const size_t said = cause.rfind(kMismatchedCalls, 0) == 0 ? std::strlen(kMismatchedCalls) : 0;
      C10_THROW_ERROR(DistBackendError, prefix(op) + cause.substr(said));
    }
    if (failure.kind() != FailureKind::Unusable) control_->publish_failure(failure);
    C10_THROW_ERROR(DistBackendError, "hca " + std::string(op) +
                                          " (the ranks agreeing on the call before gloo gets it): " + failure.cause());
  }
}

void SharedAgreements::abort(int rank) {
  control_->publish_failure(
      Failure(FailureKind::Aborted, "", rank, "rank " + std::to_string(rank) + " aborted its process group"));
}

void SharedAgreements::leave() { control_->mark_left(); }

uint32_t SharedAgreements::failure_word(int rank) const { return control_->failure_word(rank).load(); }

void SharedAgreements::leave_in_child() { hca::leave_in_child(control_); }

}  // namespace hca
