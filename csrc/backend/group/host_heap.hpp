// The process's C heap, left as it would be beside a backend that frees
// large buffers. glibc serves allocations above its mmap threshold (128 KiB
// at start) with fresh mappings, faulted in page by page, and returns the
// heap's free top above twice that threshold. Freeing a mapped block raises
// both, up to 32 MiB and 64 MiB, for the rest of the process: gloo's own
// buffers do that as a side effect, so under gloo a training step's buffers
// are reused, while hca stages through shared memory, frees nothing large,
// and the step's buffers would be faulted in afresh every step.
#pragma once

namespace hca {

// Once per process: allocates and frees one block just under glibc's largest
// dynamic threshold, untouched (no page is faulted in). Where the user fixed
// the thresholds (MALLOC_MMAP_THRESHOLD_, mallopt) glibc keeps theirs; other C
// libraries ignore it.
void raise_heap_thresholds_as_after_a_large_free();

}  // namespace hca
