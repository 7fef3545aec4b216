#include "round_runner.h"

#include <algorithm>
#include <stdexcept>

namespace hca {
namespace {

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

}  // namespace

RoundRunner::RoundRunner(Medium& medium, int rank, int world)
    : medium_(medium),
      rank_(rank),
      world_(world),
      slot_round_(static_cast<size_t>(medium.slots()), 0),
      slot_readers_(static_cast<size_t>(medium.slots())) {
  for (int peer = 0; peer < world; ++peer) {
    if (peer != rank) every_peer_.push_back(peer);
  }
}

struct RoundRunner::RoundState {
  const Collective& collective;
  const Round& pieces;
  const std::vector<Role>& roles;
  uint64_t round;
  char* mine;  // this rank's slot for the round
  int divisor;
};

void RoundRunner::read_plan(const Collective& collective) {
  if (collective.plan == read_plan_) return;
  for (const auto& p : *collective.plan) {
    if (p.schedule.steps.size() > kMaxSteps) throw std::logic_error("hca: a schedule has too many steps");
  }
  roles_ = roles_of(*collective.plan, rank_);
  cut_ = cut_rounds(*collective.plan, medium_.slot_bytes());
  round_readers_.assign(cut_.size(), {});
  for (size_t i = 0; i < cut_.size(); ++i) {
    auto& readers = round_readers_[i];
    for (const Piece& piece : cut_[i]) {
      const auto& more = roles_[piece.pack].readers;
      readers.insert(readers.end(), more.begin(), more.end());
    }
    std::sort(readers.begin(), readers.end());
    readers.erase(std::unique(readers.begin(), readers.end()), readers.end());
  }
  read_plan_ = collective.plan;  // held, so that its address cannot name another plan
}

size_t RoundRunner::stage_ahead(const Collective& collective, const std::function<bool()>& waiting) {
  read_plan(collective);
  size_t staged = 0;
  // Rounds past the ring's length would reuse a slot of this very call, whose readers are not known yet.
  const size_t most = std::min(cut_.size(), static_cast<size_t>(medium_.slots()));
  while (staged < most && waiting() && slot_free_now(rounds_ + staged + 1)) {
    const uint64_t round = rounds_ + staged + 1;
    stage_inputs({collective, cut_[staged], roles_, round, medium_.staging(rank_, round), 1});
    ++staged;
  }
  return staged;
}

void RoundRunner::run(const Collective& collective, const WaitContext& ctx, size_t staged) {
  const auto& plan = *collective.plan;
  read_plan(collective);
  const int divisor = collective.op == ReduceOp::Avg ? world_ : 1;
  for (size_t i = 0; i < cut_.size(); ++i) {
    const Round& pieces = cut_[i];
    const uint64_t round = ++rounds_;
    const RoundState state{collective, pieces, roles_, round, medium_.staging(rank_, round), divisor};
    if (i >= staged) {
      reuse_slot(round, ctx);
      stage_inputs(state);
    }
    note_readers(round, i);
    medium_.signal(progress_value(round, 1));
    size_t steps = 0;
    for (const Piece& piece : pieces) steps = std::max(steps, plan[piece.pack].schedule.steps.size());
    for (size_t s = 0; s < steps; ++s) {
      run_step(state, s, ctx);
      medium_.signal(progress_value(round, s + 2));
    }
    finish_round(state);
  }
}

uint32_t RoundRunner::slot_released_at(uint64_t round) const {
  // Our slot for this round last held round - slots, which peers read until
  // they staged the round after it.
  const uint64_t slots = static_cast<uint64_t>(medium_.slots());
  return round <= slots ? 0 : progress_value(round - slots + 1, 1);
}

const std::vector<int>& RoundRunner::slot_readers(uint64_t round) const {
  const uint64_t slots = static_cast<uint64_t>(medium_.slots()), last = round - slots;
  const size_t slot = static_cast<size_t>(round % slots);
  if (slot_round_[slot] == last) return slot_readers_[slot];
  return every_peer_;  // not noted (cannot happen in order): wait for everyone
}

void RoundRunner::note_readers(uint64_t round, size_t index) {
  const size_t slot = static_cast<size_t>(round % static_cast<uint64_t>(medium_.slots()));
  slot_readers_[slot] = round_readers_[index];  // reuses the slot's capacity
  slot_round_[slot] = round;
}

void RoundRunner::reuse_slot(uint64_t round, const WaitContext& ctx) {
  const uint32_t released = slot_released_at(round);
  if (released == 0) return;
  for (int peer : slot_readers(round)) medium_.wait(peer, released, ctx);
}

bool RoundRunner::slot_free_now(uint64_t round) const {
  const uint32_t released = slot_released_at(round);
  if (released == 0) return true;
  for (int peer : slot_readers(round)) {
    if (!medium_.reached_now(peer, released)) return false;
  }
  return true;
}

void RoundRunner::stage_inputs(const RoundState& state) {
  const auto& plan = *state.collective.plan;
  for (const Piece& piece : state.pieces) {
    if (!state.roles[piece.pack].stages) continue;
    const Pack& pack = plan[piece.pack].pack;
    const size_t es = element_size(pack.dtype);
    for_each_span(pack, state.collective.tensors, piece.begin, piece.count,
                  [&](const char* in, char*, size_t at, size_t n) {
                    medium_.copy(state.mine + piece.offset + at * es, in, n * es);
                  });
  }
}

void RoundRunner::run_step(const RoundState& state, size_t s, const WaitContext& ctx) {
  const auto& plan = *state.collective.plan;
  const ReduceOp op = state.collective.op;
  for (const Piece& piece : state.pieces) {
    const auto& [pack, schedule] = plan[piece.pack];
    if (s >= schedule.steps.size()) continue;
    const Role& role = state.roles[piece.pack];
    const size_t es = element_size(pack.dtype);
    const bool final_step = role.result && role.last_in == static_cast<int>(s);
    char* staged = state.mine + piece.offset;
    sources_.clear();
    source_ranks_.clear();
    int copy_from = -1;
    bool read_here = false;  // a peer reads this rank's slot in this very step
    for (const Edge& e : schedule.steps[s]) {
      read_here = read_here || e.src == rank_;
      if (e.dst != rank_) continue;
      medium_.wait(e.src, progress_value(state.round, s + 1), ctx);
      if (e.kind == EdgeKind::Reduce) {
        sources_.push_back(medium_.staging(e.src, state.round) + piece.offset);
        source_ranks_.push_back(e.src);
      } else {
        copy_from = e.src;
      }
    }
    if (!sources_.empty() && read_here) {
      reduce_beside_readers(state, piece, final_step);
    } else if (!sources_.empty()) {
      const bool fused = role.fused_step == static_cast<int>(s);
      if (!fused && !final_step) {
        medium_.reduce(pack.dtype, op, staged, staged, sources_.data(), sources_.size(), piece.count, nullptr, 1);
      } else {
        // Per span of the caller's tensors: read the input and/or write the output in the same pass.
        at_span_.resize(sources_.size());
        for_each_span(pack, state.collective.tensors, piece.begin, piece.count,
                      [&](const char* in, char* out, size_t at, size_t n) {
                        for (size_t i = 0; i < sources_.size(); ++i) {
                          at_span_[i] = static_cast<const char*>(sources_[i]) + at * es;
                        }
                        medium_.reduce(pack.dtype, op, staged + at * es, fused ? in : staged + at * es,
                                       at_span_.data(), at_span_.size(), n, final_step ? out : nullptr,
                                       final_step ? state.divisor : 1);
                      });
      }
    }
    if (copy_from < 0) continue;
    const char* from = medium_.staging(copy_from, state.round) + piece.offset;
    if (!role.direct) medium_.copy(staged, from, piece.count * es);
    if (final_step) {
      // The result as the last reducer left it (an AVG already divided there).
      for_each_span(pack, state.collective.tensors, piece.begin, piece.count,
                    [&](const char*, char* out, size_t at, size_t n) {
                      medium_.copy(out, (role.direct ? from : staged) + at * es, n * es);
                    });
    }
  }
}

void RoundRunner::reduce_beside_readers(const RoundState& state, const Piece& piece, bool final_step) {
  // Its own slot must stay as staged while peers read it, so the sum goes to
  // the output alone; every rank folds the same slots in rank order, its own
  // among them, so that every rank ends with the same bits.
  if (!final_step) throw std::logic_error("hca: a rank reduces beside its readers in a step before its last");
  const Pack& pack = (*state.collective.plan)[piece.pack].pack;
  const size_t es = element_size(pack.dtype);
  source_ranks_.push_back(rank_);
  std::sort(source_ranks_.begin(), source_ranks_.end());
  sources_.clear();
  for (int r : source_ranks_) sources_.push_back(medium_.staging(r, state.round) + piece.offset);
  at_span_.resize(sources_.size() - 1);
  for_each_span(pack, state.collective.tensors, piece.begin, piece.count,
                [&](const char*, char* out, size_t at, size_t n) {
                  for (size_t i = 1; i < sources_.size(); ++i) {
                    at_span_[i - 1] = static_cast<const char*>(sources_[i]) + at * es;
                  }
                  medium_.reduce(pack.dtype, state.collective.op, out, static_cast<const char*>(sources_[0]) + at * es,
                                 at_span_.data(), at_span_.size(), n, nullptr, state.divisor);
                });
}

void RoundRunner::finish_round(const RoundState& state) {
  // A result rank that received nothing (broadcast's src, a world of one: no divisor) outputs its input.
  const auto& plan = *state.collective.plan;
  for (const Piece& piece : state.pieces) {
    const Role& role = state.roles[piece.pack];
    if (!role.result || role.last_in >= 0) continue;
    if (state.divisor != 1) throw std::logic_error("hca: a rank of an AVG outputs its input unreduced");
    const Pack& pack = plan[piece.pack].pack;
    const size_t es = element_size(pack.dtype);
    for_each_span(pack, state.collective.tensors, piece.begin, piece.count,
                  [&](const char* in, char* out, size_t, size_t n) {
                    if (out != in) medium_.copy(out, in, n * es);
                  });
  }
}

}  // namespace hca
