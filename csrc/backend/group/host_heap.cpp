#include "host_heap.hpp"

#include <cstdlib>
#include <mutex>

namespace hca {
namespace {

// glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: a freed mapping up to this
// size (its header and page rounding included) moves the threshold.
constexpr size_t kLargestDynamicThreshold = size_t{32} << 20;
constexpr size_t kBlockBytes = kLargestDynamicThreshold - (size_t{8} << 10);

}  // namespace

void raise_heap_thresholds_as_after_a_large_free() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Volatile: a compiler may drop a malloc whose block is only freed.
    void* volatile block = std::malloc(kBlockBytes);
    std::free(block);
  });
}

}  // namespace hca
