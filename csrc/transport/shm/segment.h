// One POSIX shared-memory segment for all ranks of a group on this node.
#pragma once
#include <cstddef>
#include <string>

#include "../rendezvous.h"

namespace hca::shm {

class SharedSegment {
 public:
  // Rank 0 creates and sizes the segment and publishes its name; the others
  // attach. Rank 0 unlinks the name as soon as every rank has attached (or on
  // failure), so nothing stays in /dev/shm even if a rank dies later.
  SharedSegment(Rendezvous& rendezvous, int rank, int world, size_t bytes, int timeout_ms);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  char* data() const { return base_; }
  size_t size() const { return bytes_; }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace hca::shm
