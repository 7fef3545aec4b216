// One POSIX shared-memory segment for all ranks of a group on this node.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "../rendezvous.h"

namespace hca {

// The kernel's boot id and the device of the filesystem on /dev/shm, e.g.
// "boot 6f1c...-..., /dev/shm 0:25": equal exactly for processes that open one
// another's segments (one host; containers only where they share /dev/shm,
// --ipc=host), whatever their hostnames. "host <name>" stands in for a boot id
// that cannot be read.
std::string shared_memory_identity();

// What /dev/shm has, in bytes: free for this user, and in all; nullopt where it cannot be read.
struct DevShmSpace {
  size_t free;
  size_t total;
};
std::optional<DevShmSpace> dev_shm_space_now();

// a * b * c bytes; throws std::invalid_argument naming `what` if it does not fit a size_t.
size_t product_bytes(size_t a, size_t b, size_t c, const std::string& what);

class SharedSegment {
 public:
  // Rank 0 creates and sizes the segment, fills it with `initialize`, and
  // publishes its name under `key`; the others attach. Rank 0 unlinks the name
  // as soon as every rank has attached (or on failure), so nothing stays in
  // /dev/shm even if a rank dies later. `layout` says how the bytes are cut
  // (e.g. "16 slots of 131072 bytes per rank"); a rank that expects another
  // layout fails with `mismatch_hint` in the message (which setting must agree
  // across ranks): two layouts of the same size would otherwise corrupt silently.
  // Pages are reserved at setup (a full /dev/shm fails there, not with SIGBUS
  // later). With `share_bytes` > 0, rank r owns [r * share_bytes, (r + 1) *
  // share_bytes) and reserves it itself, so its pages come from the memory of
  // the NUMA node it runs on (the kernel places a tmpfs page where the task
  // that allocates it runs); else rank 0 reserves the first `setup_bytes` (all
  // of it by default), and the rest is reserved by `reserve` when it is used.
  SharedSegment(Rendezvous& rendezvous, const std::string& key, int rank, int world, size_t bytes,
                const std::string& layout, std::chrono::milliseconds timeout, const std::function<void(char*)>& initialize,
                const std::string& mismatch_hint, size_t share_bytes = 0, size_t setup_bytes = SIZE_MAX);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  char* data() const { return base_; }
  size_t size() const { return bytes_; }
  // Reserves [offset, offset + bytes) in /dev/shm before its first use (a page
  // never reserved would fault with SIGBUS on a full /dev/shm); throws
  // std::runtime_error naming `what`, the free space and the fix if it cannot.
  void reserve(size_t offset, size_t bytes, const std::string& what) const;
  // Bytes of /dev/shm the segment holds now, whoever reserved them (tests).
  size_t reserved_bytes() const;

  // Open-file-description locks on single bytes of the segment, which the
  // kernel drops when the process ends however it ends, and which every
  // process sharing the segment sees, whatever its pid namespace.
  // Takes the lock on byte `at`; throws if it cannot.
  void lock_byte(int at) const;
  // Whether another open file (another process) holds the lock on byte `at`.
  bool byte_locked_elsewhere(int at) const;

 private:
  void keep(int fd);  // the mapped segment's descriptor, for the locks
  void release();     // unmaps and closes
  char* base_ = nullptr;
  size_t bytes_ = 0;
  // Kept open for the locks; a child forked from this process closes its copy
  // at once (see segment.cpp), so that it does not hold them for its parent.
  std::atomic<int> fd_{-1};
};

}  // namespace hca
