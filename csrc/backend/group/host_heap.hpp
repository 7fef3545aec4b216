// The process's C heap, kept for reuse as training steps need it. glibc serves
// allocations above its mmap threshold (128 KiB at start) with fresh mappings,
// faulted in page by page, and returns the heap's free top above its trim
// threshold (twice the mmap threshold). Freeing a mapped block raises both, up
// to 32 MiB and 64 MiB: gloo's own buffers do that as a side effect, and its
// heap is not trimmed between steps. hca stages through shared memory and frees
// nothing large, so a step's buffers would be faulted in afresh every step:
// FSDP2 frees more than 64 MiB at once on a 12.6 M-parameter model.
#pragma once

namespace hca {

// Once per process: raises glibc's mmap threshold to 32 MiB as a freed mapped
// block would, then its trim threshold to 128 MiB, unless the user fixed a
// threshold (MALLOC_*_ or GLIBC_TUNABLES in the environment, or mallopt: glibc
// then keeps theirs). Other C libraries, and glibc before 2.33 (no mallinfo2),
// get the free only.
void raise_heap_thresholds();

}  // namespace hca
