#include "call_agreement.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "../calls/call_args.hpp"

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

int64_t summed(c10d::Backend& engine, uint64_t value) {
  std::vector<at::Tensor> one{at::full({1}, static_cast<int64_t>(value), at::kLong)};
  engine.allreduce(one, c10d::AllreduceOptions())->wait();  // SUM, the engine's timeout
  return one[0].item<int64_t>();
}

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
      C10_THROW_ERROR(DistBackendError,
                      prefix(op) + member(me) + " called " + text_of(me) + " but " + member(r) + " called " + text_of(r));
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

void agree_on_call(c10d::Backend& engine, const CallTerms& terms, const char* op,
                   const std::function<std::string(int)>& member) {
  const int world = engine.getSize(), me = engine.getRank();
  if (world == 1) return;
  TORCH_INTERNAL_ASSERT(terms.sends.size() == terms.receives.size() &&
                        (terms.sends.empty() || terms.sends.size() == static_cast<size_t>(world)));
  const uint64_t mine = digest(terms.text);
  uint64_t balance = 0;  // an all-to-all's side of each of this rank's pairs
  for (int peer = 0; peer < static_cast<int>(terms.sends.size()); ++peer) {
    balance += pair_weight(me, peer, world) * static_cast<uint64_t>(terms.sends[peer]);
    balance -= pair_weight(peer, me, world) * static_cast<uint64_t>(terms.receives[peer]);
  }
  const uint64_t sum = static_cast<uint64_t>(summed(engine, (mine + balance % kModulus) % kModulus));
  if (sum % kModulus == (static_cast<uint64_t>(world) * mine) % kModulus) return;
  // Every rank is here (but for the chance above): the texts first, then an all-to-all's pairs.
  name_the_texts(engine, terms.text, op, member);
  if (!terms.sends.empty()) name_the_pair(engine, terms, op, member);
  C10_THROW_ERROR(DistBackendError, prefix(op) + member(me) + " called " + fitted_text(terms.text, kTextBytes - 1) +
                                        ", and some rank's call differs beyond what the message shows");
}

}  // namespace hca
