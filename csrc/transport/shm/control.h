// Layout of the shared segment: a header, one control slot per rank, then two
// staging halves per rank (double buffering by round parity).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace hca::shm {

constexpr uint64_t kMagic = 0x7463685f6863615full;  // "_ach_hct"
constexpr size_t kSignatureBytes = 240;
constexpr size_t kCacheLine = 128;  // covers adjacent-line prefetch too

// One writer per slot (its rank); everyone else only reads it.
struct alignas(kCacheLine) RankSlot {
  // Progress through the data rounds: (round << 4) | steps completed.
  std::atomic<uint64_t> progress;
  char pad0[kCacheLine - sizeof(std::atomic<uint64_t>)];
  // Collectives started; the description of collective n sits in signature[n % 2].
  std::atomic<uint64_t> started;
  int32_t pid;
  char signature[2][kSignatureBytes];
  // Set once this rank gave up on a collective; `failure` says why, so ranks
  // waiting on it report the cause rather than a second-hand timeout.
  std::atomic<uint32_t> failed;
  char failure[kSignatureBytes];
};

struct alignas(kCacheLine) Header {
  uint64_t magic;
  int32_t world;
  uint64_t half_bytes;
};

inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

struct Layout {
  size_t slots_offset, buffers_offset, half_bytes, total_bytes;
  Layout(int world, size_t half) : half_bytes(half) {
    slots_offset = round_up(sizeof(Header), 4096);
    buffers_offset = round_up(slots_offset + sizeof(RankSlot) * static_cast<size_t>(world), 4096);
    total_bytes = buffers_offset + 2 * half * static_cast<size_t>(world);
  }
};

}  // namespace hca::shm
