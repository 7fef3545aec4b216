// Host threads standing in for streams: a StreamDevice whose one stream is a
// worker thread that runs the issued operations in order, over staging slots in
// POSIX shared memory. With it the stream executor (deferred waits and writes,
// the watchdog, releasing streams after a failure) runs on CPU tensors, so that
// CI checks the logic the CUDA executor shares with it
// (TORCH_HCA_CPU_EXECUTOR=streams; the shared-memory executor is faster).
#pragma once
#include <memory>

#include "../control/control_block.h"
#include "../executor.h"
#include "../rendezvous.h"
#include "stream_executor.h"

namespace hca {

// run() returns once the collective has finished (Completion::Host).
std::unique_ptr<Executor> make_host_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                                    RingLayout ring);

}  // namespace hca
