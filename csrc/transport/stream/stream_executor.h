// The executor for media whose operations run on streams (CUDA; host threads in
// CI): the same plans and round runner as shared memory, each operation issued
// on the collective's stream so that no host thread waits for the device. Ranks
// order each other through their stream progress words in the node's control
// block. A watchdog thread notices dead or failed peers and expired deadlines,
// and releases the streams waiting on them by writing their words from the host.
#pragma once
#include <chrono>
#include <functional>
#include <memory>

#include "../control/control_block.h"
#include "../executor.h"
#include "../rendezvous.h"
#include "stream_device.h"

namespace hca {

// Opens the device of `device_index` (every rank takes part: staging is shared).
using OpenStreamDevice =
    std::function<std::unique_ptr<StreamDevice>(Rendezvous&, int device_index, std::chrono::milliseconds timeout)>;

// run() returns once the collective is issued on its stream; the caller orders
// itself after the stream, and learns the outcome from Collective::issued once
// end_call has marked the call's end. Nothing is opened until the first
// collective, on its device, once every rank has posted it (so a missing rank
// or a mismatched call is named as such). A rank whose device fails to open
// publishes why through `rendezvous`.
std::unique_ptr<Executor> make_stream_executor(ControlBlock& control, std::shared_ptr<Rendezvous> rendezvous,
                                               OpenStreamDevice open);

}  // namespace hca
