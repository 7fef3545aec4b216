// What moving data between two cores costs on this machine right now, without torch or hca:
// the evidence for why the same benchmark is fast in one launch and slow in another.
//
//   g++ -O2 -o /tmp/coherence_probe benchmarks/coherence_probe.cpp
//   for i in $(seq 20); do /tmp/coherence_probe; sleep 15; done   # one JSON line per launch
//
// Two processes pinned to CPUs 0 and 1 measure
//  - one_way_ns: a cache line passed back and forth (half a round trip);
//  - pattern_us: hca's 2-rank 64 KiB allreduce as plain memory traffic (rank 1 stages its input
//    in its slot, rank 0 adds it to its own input into its slot and its output, rank 1 copies
//    rank 0's slot out), spinning on flags, for rings of 2..64 slots per rank;
//  - memcpy_us: one core copying 64 KiB, for scale.
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kFloats = 16384, kBytes = kFloats * 4;
constexpr int kRings[] = {2, 8, 16, 32, 64};
constexpr int kMaxSlots = 64;

struct Shared {
  alignas(64) std::atomic<uint64_t> flag[2];
  alignas(64) std::atomic<uint64_t> ping;
  alignas(64) double one_way_ns;
  double pattern_us[sizeof(kRings) / sizeof(kRings[0])];
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void wait_at_least(const std::atomic<uint64_t>& a, uint64_t v) {
  while (a.load(std::memory_order_acquire) < v) _mm_pause();
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    perror("sched_setaffinity (this probe needs CPUs 0 and 1)");
    exit(1);
  }
}

double ping_pong(Shared& s, int rank) {
  constexpr uint64_t kTrips = 200000;
  const auto start = Clock::now();
  for (uint64_t i = 0; i < kTrips; ++i) {
    if (rank == 0) {
      s.ping.store(2 * i + 1, std::memory_order_release);
      while (s.ping.load(std::memory_order_acquire) != 2 * i + 2) _mm_pause();
    } else {
      while (s.ping.load(std::memory_order_acquire) != 2 * i + 1) _mm_pause();
      s.ping.store(2 * i + 2, std::memory_order_release);
    }
  }
  return seconds_since(start) / kTrips / 2 * 1e9;
}

// Iterations continue the flags' count from earlier rings, so both ranks pass `first`.
double allreduce_pattern(Shared& s, char* slots, int rank, int ring, uint64_t first, uint64_t iterations) {
  auto slot = [&](int owner, uint64_t it) {
    return reinterpret_cast<float*>(slots + (static_cast<size_t>(owner) * kMaxSlots + it % ring) * kBytes);
  };
  static float in[kFloats] __attribute__((aligned(64))), out[kFloats] __attribute__((aligned(64)));
  for (size_t i = 0; i < kFloats; ++i) in[i] = static_cast<float>(i % 97) + rank;
  const auto start = Clock::now();
  for (uint64_t it = first; it < first + iterations; ++it) {
    if (rank == 1) {
      std::memcpy(slot(1, it), in, kBytes);
      s.flag[1].store(2 * it, std::memory_order_release);
      wait_at_least(s.flag[0], 2 * it);
      std::memcpy(out, slot(0, it), kBytes);
      s.flag[1].store(2 * it + 1, std::memory_order_release);
    } else {
      wait_at_least(s.flag[1], 2 * it);
      const float* theirs = slot(1, it);
      float* mine = slot(0, it);
      for (size_t i = 0; i < kFloats; ++i) mine[i] = out[i] = in[i] + theirs[i];
      s.flag[0].store(2 * it, std::memory_order_release);
      wait_at_least(s.flag[1], 2 * it + 1);
    }
  }
  return seconds_since(start) / iterations * 1e6;
}

double memcpy_us() {
  static char a[kBytes], b[kBytes];
  std::memset(a, 1, kBytes);
  constexpr int kCopies = 100000;
  const auto start = Clock::now();
  for (int i = 0; i < kCopies; ++i) {
    std::memcpy(b, a, kBytes);
    asm volatile("" : : "r"(b) : "memory");
  }
  return seconds_since(start) / kCopies * 1e6;
}

}  // namespace

int main() {
  const size_t region_bytes = 2 * kMaxSlots * kBytes;
  auto* base = static_cast<char*>(
      mmap(nullptr, 4096 + region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  std::memset(base, 0, 4096 + region_bytes);
  auto& shared = *new (base) Shared{};
  char* slots = base + 4096;
  const pid_t child = fork();
  const int rank = child == 0 ? 1 : 0;
  pin(rank);
  const double one_way = ping_pong(shared, rank);
  uint64_t first = 1;
  for (size_t r = 0; r < sizeof(kRings) / sizeof(kRings[0]); ++r) {
    constexpr uint64_t kIterations = 3000;
    const double us = allreduce_pattern(shared, slots, rank, kRings[r], first, kIterations);
    first += kIterations;
    if (rank == 0) shared.pattern_us[r] = us;
  }
  if (rank == 1) return 0;
  waitpid(child, nullptr, 0);
  std::printf("{\"one_way_ns\": %.0f, \"pattern_us\": {", one_way);
  for (size_t r = 0; r < sizeof(kRings) / sizeof(kRings[0]); ++r) {
    std::printf("%s\"%d\": %.1f", r ? ", " : "", kRings[r], shared.pattern_us[r]);
  }
  std::printf("}, \"memcpy_us\": %.2f}\n", memcpy_us());
  return 0;
}
