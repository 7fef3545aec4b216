#include "host_heap.hpp"

#include <cstdlib>
#include <cstring>
#include <mutex>

#ifdef __GLIBC__
#if __GLIBC_PREREQ(2, 33)  // mallinfo2
#define HCA_GLIBC_HEAP 1
#include <malloc.h>
#endif
#endif

namespace hca {
namespace {

// glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: a freed mapping up to this
// size (its header and page rounding included) moves the threshold.
constexpr size_t kLargestDynamicThreshold = size_t{32} << 20;
constexpr size_t kBlockBytes = kLargestDynamicThreshold - (size_t{8} << 10);
// Twice the dynamic rule's largest: what FSDP2 frees at once on wide-mlp fits.
constexpr size_t kTrimThreshold = size_t{128} << 20;

#ifdef HCA_GLIBC_HEAP
// Whether the environment fixes one of glibc's heap thresholds.
bool environment_fixes_thresholds() {
  for (const char* name : {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"}) {
    if (std::getenv(name)) return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (!tunables) return false;
  for (const char* name : {"glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold", "glibc.malloc.top_pad",
                           "glibc.malloc.mmap_max"}) {
    if (std::strstr(tunables, name)) return true;
  }
  return false;
}

// Whether glibc still moves its thresholds itself (nobody fixed them, a mallopt
// included): after the free of a mapped block of `bytes`, a block that size
// comes from the heap. Another thread mapping a block meanwhile reads as fixed:
// nothing is changed then.
bool thresholds_still_dynamic(size_t bytes) {
  const size_t mapped_before = mallinfo2().hblks;
  void* volatile probe = std::malloc(bytes);
  const bool mapped = mallinfo2().hblks != mapped_before;
  std::free(probe);
  return probe && !mapped;
}
#endif

}  // namespace

void raise_heap_thresholds() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Volatile: a compiler may drop a malloc whose block is only freed.
    void* volatile block = std::malloc(kBlockBytes);
    std::free(block);
#ifdef HCA_GLIBC_HEAP
    if (!environment_fixes_thresholds() && thresholds_still_dynamic(kBlockBytes)) {
      mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThreshold));
    }
#endif
  });
}

}  // namespace hca
