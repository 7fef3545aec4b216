// hca's calls in torch's Flight Recorder, the ring of each process's last calls
// (TORCH_FR_BUFFER_SIZE, 2000 unless set, 0: off) that torch's dump functions,
// its debug server and `fr_trace` read, and that a failed call dumps through
// torch's writer (TORCH_FR_DUMP_TEMP_FILE<rank>), as ProcessGroupNCCL does.
//
// torch exports no handle to its recorder before 2.15 (the instance is a
// hidden function-local static of libtorch_cpu): hca finds it in libtorch_cpu's
// symbol table and writes entries in the recorder's own layout, from the
// recorder's header of the torch it was built against. From torch 2.15 torch's
// own hook records every custom backend's calls, hca's among them, in a recorder
// of backend "hca": hca records nothing itself there, tells the hook when a call
// ended well (completion hooks, which retire its entry), and dumps that recorder.
// Before torch 2.13 (whose recorder's layout this build was not checked against)
// hca neither records nor dumps.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <exception>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace hca {

// Where hca's calls go: whether hca enters them in torch's recorder itself, and
// in words where they go or why nowhere.
struct FlightRecorderPlace {
  bool recording = false;
  std::string text;
};
// Found once a process, at its first group.
const FlightRecorderPlace& flight_recorder();

// One group's entries: its calls' sequence numbers, name and status, as torch's
// dump and fr_trace read them.
class FlightLog {
 public:
  // A call's entry, for its completion; no id where nothing was recorded.
  struct Ticket {
    std::optional<size_t> id;
    size_t epoch = 0;
    int64_t created = 0;  // c10::getTime()
    int64_t collective_seq = -1;
    bool hooked = false;          // completion hooks want to know when it ends well
    uint64_t completion_key = 0;  // its Work's (c10d::Work::getCompletionKey), for them
    // Whether anyone hears of its end: its entry, or the completion hooks.
    bool awaited() const { return id.has_value() || hooked; }
  };
  FlightLog();
  ~FlightLog();
  // Records a call of `backend` (its group's uid, description, rank and size; `global_ranks`
  // its ranks in the world, empty: the world itself): `op` as ProcessGroupNCCL's trace names it
  // ("allreduce", "send", ...), `peer` a message's (-1: any source).
  Ticket scheduled(const c10d::Backend& backend, const std::vector<int64_t>& global_ranks, const char* op,
                   std::optional<int> peer, const std::vector<at::Tensor>& inputs,
                   const std::vector<at::Tensor>& outputs, std::chrono::milliseconds timeout);
  // The call ended well: completed (with its host time where it ran on the host),
  // retired. `on_device`: its work was issued to a device stream, whose end the
  // host does not see here: the entry says started, not completed (on every rank
  // alike, which the analyzer compares).
  void finished(const Ticket& ticket, bool on_device);

#ifdef C10D_BACKEND_HAS_HOOKS
  // torch 2.15's completion hooks: its own Flight Recorder hook, which enters
  // hca's calls there, retires an entry (completed, with the host's duration of
  // a call the host ran) once hca says the call ended well, so that a call that
  // never ends reads "scheduled" and un-retired. Run outside the table's lock.
  void add_completion_hook(int64_t id, c10d::CompletionHook hook);
  void remove_completion_hook(int64_t id);
  uint64_t completion_key(const c10d::Work& work) const { return work.getCompletionKey(); }
#else
  uint64_t completion_key(const c10d::Work&) const { return 0; }
#endif

 private:
  // The group's place in torch's recorder (flight_record.cpp); null where hca does not record.
  struct Group;
  std::unique_ptr<Group> group_;
#ifdef C10D_BACKEND_HAS_HOOKS
  std::mutex hooks_mutex_;
  std::map<int64_t, c10d::CompletionHook> hooks_;
  std::atomic<bool> hooked_{false};
#endif
};

// `error` (a call's failure) once this process wrote torch's Flight Recorder
// dump through torch's writer, the message then saying where; the first
// failure of a process writes it, later ones name the same file. Unchanged
// where the recorder is off or dumps on failure are (TORCH_FR_DUMP_ON_TIMEOUT=0).
std::exception_ptr with_flight_recorder_dump(std::exception_ptr error);

}  // namespace hca
