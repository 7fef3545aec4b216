#include "transport.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "kernels.h"

namespace hca::shm {

namespace {

constexpr size_t kAlign = 64;

uint64_t progress_value(uint64_t round, size_t steps_done) { return (round << 4) | steps_done; }

// Calls fn(in, out, at, elements) for the parts of the pack's segments that fall
// in [begin, begin + count), in order; `at` counts elements from `begin`.
template <class Fn>
void for_each_span(const Pack& pack, const std::vector<TensorSpan>& tensors, size_t begin, size_t count, Fn fn) {
  const size_t es = element_size(pack.dtype);
  size_t seg_start = 0;
  for (const Segment& seg : pack.segments) {
    const size_t lo = std::max(begin, seg_start), hi = std::min(begin + count, seg_start + seg.numel);
    if (lo < hi) {
      const size_t at = (seg.offset + lo - seg_start) * es;
      const auto& t = tensors[seg.tensor];
      fn(static_cast<const char*>(t.in) + at, static_cast<char*>(t.out) + at, lo - begin, hi - lo);
    }
    seg_start += seg.numel;
    if (seg_start >= begin + count) break;
  }
}

// Cuts the packs into rounds that fit one buffer half. Every pack gets a piece
// in each round where it can, so the packs' leaders work side by side.
std::vector<std::vector<Transport::Piece>> cut_rounds(const std::vector<PackPlan>& plan, size_t half_bytes) {
  size_t total = 0;
  for (const auto& p : plan) total += round_up(p.pack.numel * element_size(p.pack.dtype), kAlign);
  const size_t target_rounds = std::max<size_t>(1, (total + half_bytes - 1) / half_bytes);
  std::vector<size_t> piece(plan.size()), done(plan.size(), 0);
  for (size_t p = 0; p < plan.size(); ++p) {
    const size_t es = element_size(plan[p].pack.dtype);
    piece[p] = std::min(half_bytes / es, (plan[p].pack.numel + target_rounds - 1) / target_rounds);
  }
  std::vector<std::vector<Transport::Piece>> rounds(1);
  size_t used = 0;
  for (bool more = true; more;) {
    more = false;
    for (size_t p = 0; p < plan.size(); ++p) {
      const size_t left = plan[p].pack.numel - done[p];
      if (left == 0) continue;
      const size_t es = element_size(plan[p].pack.dtype);
      const size_t count = std::min(piece[p], left);
      if (used + count * es > half_bytes) {
        rounds.emplace_back();
        used = 0;
      }
      rounds.back().push_back({p, done[p], count, used});
      used = round_up(used + count * es, kAlign);
      done[p] += count;
      more = more || done[p] < plan[p].pack.numel;
    }
  }
  if (rounds.back().empty()) rounds.pop_back();
  return rounds;
}

Transport::Role role_of(const Schedule& schedule, int rank) {
  Transport::Role role;
  role.result = std::find(schedule.result_ranks.begin(), schedule.result_ranks.end(), rank) !=
                schedule.result_ranks.end();
  int first = -1, last_out = -1;
  bool first_is_src = false, first_is_reduce = false, last_in_is_copy = false;
  for (size_t s = 0; s < schedule.steps.size(); ++s) {
    for (const Edge& e : schedule.steps[s]) {
      if (e.src != rank && e.dst != rank) continue;
      if (first < 0) first = static_cast<int>(s);
      if (first == static_cast<int>(s)) {
        first_is_src = first_is_src || e.src == rank;
        first_is_reduce = first_is_reduce || (e.dst == rank && e.kind == EdgeKind::Reduce);
      }
      if (e.src == rank) last_out = static_cast<int>(s);
      if (e.dst == rank) {
        role.last_in = static_cast<int>(s);
        last_in_is_copy = e.kind == EdgeKind::Copy;
      }
    }
  }
  // Data others read first must be staged; a rank that first reduces can read
  // its own input in that pass; one that first receives a Copy needs nothing.
  role.stages = first_is_src;
  if (!first_is_src && first_is_reduce) role.fused_step = first;
  role.direct = role.result && last_in_is_copy && last_out < role.last_in;
  return role;
}

}  // namespace

Transport::Transport(Rendezvous& rendezvous, int rank, int world, size_t chunk_bytes,
                     std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), layout_(world, round_up(std::max<size_t>(chunk_bytes, 4096), kAlign)) {
  segment_ = std::make_unique<SharedSegment>(rendezvous, rank, world, layout_.total_bytes, static_cast<int>(timeout.count()));
  if (rank == 0) {
    auto* header = reinterpret_cast<Header*>(segment_->data());
    header->magic = kMagic;
    header->world = world;
    header->half_bytes = layout_.half_bytes;
  }
  slot(rank).pid = static_cast<int32_t>(getpid());
}

RankSlot& Transport::slot(int rank) const {
  return reinterpret_cast<RankSlot*>(segment_->data() + layout_.slots_offset)[rank];
}

char* Transport::buffer(int rank, uint64_t round) const {
  return segment_->data() + layout_.buffers_offset + (static_cast<size_t>(rank) * 2 + round % 2) * layout_.half_bytes;
}

template <class Ready>
void Transport::await(int peer, Ready ready, const WaitContext& ctx) {
  RankSlot& theirs = slot(peer);
  wait_for([&] { return ready() || theirs.failed.load(std::memory_order_acquire); }, ctx, peer, theirs.pid);
  if (!ready()) {
    throw std::runtime_error("hca " + ctx.operation + ": rank " + std::to_string(peer) + " failed: " +
                             std::string(theirs.failure, strnlen(theirs.failure, kSignatureBytes)));
  }
}

void Transport::wait_progress(int peer, uint64_t at_least, const WaitContext& ctx) {
  auto& word = slot(peer).progress;
  await(peer, [&] { return word.load(std::memory_order_acquire) >= at_least; }, ctx);
}

void Transport::start(const Collective& collective, const WaitContext& ctx) {
  const uint64_t n = ++collectives_;
  RankSlot& mine = slot(rank_);
  std::strncpy(mine.signature[n % 2], collective.signature.c_str(), kSignatureBytes - 1);
  mine.signature[n % 2][kSignatureBytes - 1] = '\0';
  mine.started.store(n, std::memory_order_release);
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    RankSlot& theirs = slot(peer);
    await(peer, [&] { return theirs.started.load(std::memory_order_acquire) >= n; }, ctx);
    if (std::strncmp(theirs.signature[n % 2], mine.signature[n % 2], kSignatureBytes) != 0) {
      throw std::runtime_error("hca collective #" + std::to_string(n) + ": mismatched calls: rank " +
                               std::to_string(rank_) + " called " + mine.signature[n % 2] + " but rank " +
                               std::to_string(peer) + " called " + theirs.signature[n % 2]);
    }
  }
}

void Transport::run(const Collective& collective) {
  if (!broken_.empty()) throw std::runtime_error("hca: this process group is unusable after an earlier error: " + broken_);
  const auto& plan = *collective.plan;
  WaitContext ctx{Clock::now() + collective.timeout, "collective #" + std::to_string(collectives_ + 1) + " " + collective.signature,
                  collective.timeout};
  try {
    start(collective, ctx);
    std::vector<Role> roles;
    for (const auto& p : plan) roles.push_back(role_of(p.schedule, rank_));
    for (const auto& round : cut_rounds(plan, layout_.half_bytes)) run_round(collective, round, roles, ctx);
  } catch (const std::exception& e) {
    broken_ = e.what();
    RankSlot& mine = slot(rank_);
    if (!mine.failed.load(std::memory_order_relaxed)) {
      // The first cause only, without our own "hca collective #n ...:" prefix.
      const char* cause = std::strstr(e.what(), "): ");
      std::strncpy(mine.failure, cause ? cause + 3 : e.what(), kSignatureBytes - 1);
      mine.failed.store(1, std::memory_order_release);
    }
    throw;
  }
}

void Transport::run_round(const Collective& collective, const std::vector<Piece>& round,
                          const std::vector<Role>& roles, const WaitContext& ctx) {
  const auto& plan = *collective.plan;
  const uint64_t r = ++rounds_;
  const int divisor = collective.op == ReduceOp::Avg ? world_ : 1;
  // Our half of round r was read in round r - 2: wait until every rank has moved past it.
  if (r >= 2) {
    for (int peer = 0; peer < world_; ++peer) {
      if (peer != rank_) wait_progress(peer, progress_value(r - 1, 1), ctx);
    }
  }
  char* mine = buffer(rank_, r);
  size_t steps = 0;
  for (const Piece& piece : round) {
    const Pack& pack = plan[piece.pack].pack;
    steps = std::max(steps, plan[piece.pack].schedule.steps.size());
    if (!roles[piece.pack].stages) continue;
    for_each_span(pack, collective.tensors, piece.begin, piece.count, [&](const char* in, char*, size_t at, size_t n) {
      const size_t es = element_size(pack.dtype);
      std::memcpy(mine + piece.offset + at * es, in, n * es);
    });
  }
  slot(rank_).progress.store(progress_value(r, 1), std::memory_order_release);

  std::vector<const void*> sources, at_span;
  for (size_t s = 0; s < steps; ++s) {
    for (const Piece& piece : round) {
      const auto& [pack, schedule] = plan[piece.pack];
      if (s >= schedule.steps.size()) continue;
      const Role& role = roles[piece.pack];
      const size_t es = element_size(pack.dtype);
      const bool final_step = role.result && role.last_in == static_cast<int>(s);
      char* staged = mine + piece.offset;
      sources.clear();
      int copy_from = -1;
      for (const Edge& e : schedule.steps[s]) {
        if (e.dst != rank_) continue;
        wait_progress(e.src, progress_value(r, s + 1), ctx);
        if (e.kind == EdgeKind::Reduce) {
          sources.push_back(buffer(e.src, r) + piece.offset);
        } else {
          copy_from = e.src;
        }
      }
      if (!sources.empty()) {
        const bool fused = role.fused_step == static_cast<int>(s);
        if (!fused && !final_step) {
          reduce_into(pack.dtype, collective.op, staged, staged, sources.data(), sources.size(), piece.count);
        } else {
          // Per span of the caller's tensors: read the input and/or write the output in the same pass.
          at_span.resize(sources.size());
          for_each_span(pack, collective.tensors, piece.begin, piece.count, [&](const char* in, char* out, size_t at, size_t n) {
            for (size_t i = 0; i < sources.size(); ++i) at_span[i] = static_cast<const char*>(sources[i]) + at * es;
            reduce_into(pack.dtype, collective.op, staged + at * es, fused ? in : staged + at * es, at_span.data(),
                        at_span.size(), n, final_step ? out : nullptr, divisor);
          });
        }
      }
      if (copy_from < 0) continue;
      const char* from = buffer(copy_from, r) + piece.offset;
      if (!role.direct) std::memcpy(staged, from, piece.count * es);
      if (final_step) {
        for_each_span(pack, collective.tensors, piece.begin, piece.count, [&](const char*, char* out, size_t at, size_t n) {
          scale_copy(pack.dtype, out, (role.direct ? from : staged) + at * es, n, divisor);
        });
      }
    }
    slot(rank_).progress.store(progress_value(r, s + 2), std::memory_order_release);
  }

  // A result rank that received nothing (broadcast's src, a world of one) outputs its input.
  for (const Piece& piece : round) {
    const Role& role = roles[piece.pack];
    if (!role.result || role.last_in >= 0) continue;
    const Pack& pack = plan[piece.pack].pack;
    for_each_span(pack, collective.tensors, piece.begin, piece.count, [&](const char* in, char* out, size_t, size_t n) {
      scale_copy(pack.dtype, out, in, n, divisor);
    });
  }
}

}  // namespace hca::shm
