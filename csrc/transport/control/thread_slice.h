// A rank's collective makes progress only while its peers run too. Beside compute
// on the same CPUs (DDP's buckets all-reduced while the backward pass runs), a
// rank woken by its peer waits for its turn on the CPU, up to a time slice (1.4 ms
// here), and its peers wait with it: a 16 MiB bucket all-reduced during the
// backward pass took 19-35 ms, against 2.3 ms alone. Linux's EEVDF scheduler
// (6.12 and later) lets a thread ask for a shorter slice: it then runs sooner when
// woken (an earlier deadline), with no more CPU time than before. hca's worker
// threads, which run the async collectives, ask for one; the caller's threads are
// left as they are.
#pragma once

namespace hca {

// Gives the calling thread the shortest slice the kernel allows, unless its
// policy is not a fair one (real-time, idle) or its slice is as short already.
// Does nothing where the kernel has no such setting.
void prefer_prompt_wakeups();

}  // namespace hca
