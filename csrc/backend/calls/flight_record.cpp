#include "flight_record.hpp"

#include <c10/util/Exception.h>
#include <c10/util/thread_name.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/csrc/distributed/c10d/Utils.hpp>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/version.h>
#include <unistd.h>

#include <string_view>

// The recorder's layout and dump functions hca writes to and calls are those of torch 2.13 on.
#define HCA_FLIGHT_RECORDER (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13))
#if HCA_FLIGHT_RECORDER
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#endif

#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>

namespace hca {
#if HCA_FLIGHT_RECORDER
namespace {

using TorchFlightRecorder = c10d::FlightRecorder<c10::Event>;

// torch's recorder hca enters calls in (nullptr: none), and in words where or why none.
struct Found {
  TorchFlightRecorder* recorder = nullptr;
  std::string text;
};
const Found& torch_recorder();

// This process's rank in the world, which names its dump file (the last group's call says it).
std::atomic<int> g_global_rank{0};

// From torch 2.15 its hook records every custom backend's calls, in a recorder of the backend's own.
#define HCA_TORCH_HOOKS_RECORD (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15))

// Whether a failed call writes this process's dump: the recorder on (torch's rule) and
// dumps on failure not turned off (ProcessGroupNCCL's variables).
bool dumps_on_failure() {
#if HCA_TORCH_HOOKS_RECORD
  const bool recording = c10d::getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000) > 0;
#else
  const bool recording = torch_recorder().recorder != nullptr;
#endif
  return recording && c10d::getCvarBool({"TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"}, true);
}

// The dump of the recorder that holds hca's calls, without stack traces: naming their
// frames takes the GIL, which the failing call's thread may not get.
std::string dump_of_hca_calls() {
#if HCA_TORCH_HOOKS_RECORD
  return c10d::dump_fr_trace(true, false, false, "hca");
#else
  return c10d::dump_fr_trace(true, false, false);
#endif
}

// torch's recorder of c10::Event entries: the static local of FlightRecorder<c10::Event>::get().
constexpr char kRecorderSymbol[] = "_ZZN4c10d14FlightRecorderIN3c105EventEE3getEvE8instance";

// Where the shared object holding `address` was loaded from, and its load bias.
struct LoadedObject {
  std::string path;
  uintptr_t bias = 0;
};

LoadedObject object_holding(const void* address) {
  struct Search {
    uintptr_t address;
    LoadedObject found;
  } search{reinterpret_cast<uintptr_t>(address), {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const auto& segment = info->dlpi_phdr[i];
          const uintptr_t start = info->dlpi_addr + segment.p_vaddr;
          if (segment.p_type == PT_LOAD && s->address >= start && s->address < start + segment.p_memsz) {
            s->found = {info->dlpi_name ? info->dlpi_name : "", info->dlpi_addr};
            return 1;
          }
        }
        return 0;
      },
      &search);
  return search.found;
}

// The value of the pointer-sized data symbol `name` in `path`'s symbol table; nullopt (and
// `why`) where the file has no such table (a stripped build) or no such symbol.
std::optional<uint64_t> pointer_symbol(const std::string& path, const char* name, std::string& why) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0) {
    why = "cannot read " + path + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    return std::nullopt;
  }
  void* mapped = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (mapped == MAP_FAILED) {
    why = "cannot map " + path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  const auto* file = static_cast<const char*>(mapped);
  const auto size = static_cast<size_t>(st.st_size);
  std::optional<uint64_t> value;
  why = path + " has no symbol table (a stripped build)";
  const auto* header = reinterpret_cast<const Elf64_Ehdr*>(file);
  const bool elf64 = size >= sizeof(Elf64_Ehdr) && std::memcmp(header->e_ident, ELFMAG, SELFMAG) == 0 &&
                     header->e_ident[EI_CLASS] == ELFCLASS64 &&
                     header->e_shoff + header->e_shnum * sizeof(Elf64_Shdr) <= size;
  const auto* sections = elf64 ? reinterpret_cast<const Elf64_Shdr*>(file + header->e_shoff) : nullptr;
  for (size_t i = 0; elf64 && i < header->e_shnum && !value; ++i) {
    const auto& table = sections[i];
    if (table.sh_type != SHT_SYMTAB || table.sh_link >= header->e_shnum) continue;
    const auto& names = sections[table.sh_link];
    if (table.sh_offset + table.sh_size > size || names.sh_offset + names.sh_size > size) continue;
    why = std::string("no ") + name + " in " + path;
    const auto* symbols = reinterpret_cast<const Elf64_Sym*>(file + table.sh_offset);
    const size_t count = table.sh_size / sizeof(Elf64_Sym);
    const size_t name_length = std::strlen(name);
    for (size_t k = 0; k < count; ++k) {
      const auto& symbol = symbols[k];
      // The size and kind first: only a few thousand names of the table are read.
      if (ELF64_ST_TYPE(symbol.st_info) != STT_OBJECT || symbol.st_size != sizeof(void*)) continue;
      if (symbol.st_name + name_length >= names.sh_size) continue;
      if (std::strcmp(file + names.sh_offset + symbol.st_name, name) == 0) {
        value = symbol.st_value;
        break;
      }
    }
  }
  munmap(mapped, size);
  return value;
}

Found find_torch_recorder() {
#if HCA_TORCH_HOOKS_RECORD
  return {nullptr, "torch's own hook (its recorder of backend \"hca\")"};
#else
  // libtorch_cpu is the object holding torch's dump function; the dump makes the recorder.
  const auto torch_cpu = object_holding(reinterpret_cast<const void*>(&c10d::dump_fr_trace_json));
  std::string why = "libtorch_cpu was not found among the loaded objects";
  const auto value = torch_cpu.path.empty() ? std::nullopt : pointer_symbol(torch_cpu.path, kRecorderSymbol, why);
  if (!value) return {nullptr, "not recording: " + why};
  (void)c10d::dump_fr_trace_json(false, false);
  auto* recorder = *reinterpret_cast<TorchFlightRecorder* const*>(torch_cpu.bias + *value);
  if (recorder != nullptr && !recorder->enabled_) return {nullptr, "off (TORCH_FR_BUFFER_SIZE=0)"};
  // The layout hca writes is its build's header's: a ring that reads as broken is another's.
  if (recorder == nullptr || recorder->entries_.size() > recorder->max_entries_ ||
      recorder->next_ > recorder->max_entries_) {
    return {nullptr, "not recording: torch's recorder in " + torch_cpu.path + " is not the one hca was built for"};
  }
  return {recorder, "torch's (libtorch_cpu's FlightRecorder<c10::Event>, which torch's dumps read)"};
#endif
}

// Whether the recorder keeps reset epochs (the ring's index of an id depends on them).
template <typename R, typename = void>
struct HasResetEpochs : std::false_type {};
template <typename R>
struct HasResetEpochs<R, std::void_t<decltype(std::declval<R&>().reset_epoch_start_idx_)>> : std::true_type {};

// The ring's slot of the entry `id` of `epoch` (the recorder's lock held).
size_t slot_of(TorchFlightRecorder& recorder, size_t id, size_t epoch) {
  if constexpr (HasResetEpochs<TorchFlightRecorder>::value) {
    const auto start = recorder.reset_epoch_start_idx_.find(epoch);
    return ((start == recorder.reset_epoch_start_idx_.end() ? 0 : start->second) + id) % recorder.max_entries_;
  } else {
    return id % recorder.max_entries_;
  }
}

// The trace analyzer's name of a call (its table of collectives), from ProcessGroupNCCL's trace name.
std::string analyzer_name(const char* op) {
  static const std::vector<std::pair<std::string, std::string>> renamed = {
      {"allreduce", "all_reduce"},
      {"allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced"},
      {"allgather_coalesced", "ALLGATHER_coalesced"},
      {"_allgather_base", "_all_gather_base"},
  };
  for (const auto& [from, to] : renamed) {
    if (from == op) return to;
  }
  return op;
}

const Found& torch_recorder() {
  static const Found found = find_torch_recorder();
  return found;
}

}  // namespace

const FlightRecorderPlace& flight_recorder() {
  static const FlightRecorderPlace place{torch_recorder().recorder != nullptr, torch_recorder().text};
  return place;
}

struct FlightLog::Group {
  TorchFlightRecorder* recorder;
  size_t pg_id;
  bool ranks_recorded = false;  // with the recorder's lock
  std::shared_ptr<c10d::ProcessGroupStatus> status = std::make_shared<c10d::ProcessGroupStatus>();
  std::atomic<size_t> collective_seq{0};
  std::atomic<size_t> p2p_seq{0};
  std::atomic<size_t> op_id{0};
};

FlightLog::FlightLog() {
  static std::atomic<size_t> groups{0};
  if (auto* recorder = torch_recorder().recorder) group_.reset(new Group{recorder, groups++});
}

FlightLog::~FlightLog() = default;

FlightLog::Ticket FlightLog::scheduled(const c10d::Backend& backend, const std::vector<int64_t>& global_ranks,
                                       const char* op, std::optional<int> peer, const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& outputs, std::chrono::milliseconds timeout) {
  // A group torch never named is one of hca's parts (a node's group inside the group across nodes):
  // the call of the group it serves is the entry.
  if (backend.getGroupUid().empty()) return {};
  const int rank = backend.getRank();
  g_global_rank.store(global_ranks.empty() ? rank : static_cast<int>(global_ranks.at(rank)),
                      std::memory_order_relaxed);  // names the dump, also where torch's hook records
  Ticket ticket;
#ifdef C10D_BACKEND_HAS_HOOKS
  ticket.hooked = hooked_.load(std::memory_order_relaxed);
#endif
  if (!group_) {
    if (ticket.hooked) ticket.created = c10::getTime();
    return ticket;
  }
  auto& g = *group_;
  const int size = backend.getSize();
  const std::tuple<std::string, std::string> name{backend.getGroupUid(), backend.getGroupDesc()};
  TorchFlightRecorder::Entry entry{};
  entry.pg_id_ = g.pg_id;
  entry.pg_name_ = name;
  const bool p2p = peer.has_value();
  entry.isP2P_ = p2p;
  entry.collective_seq_id_ = p2p ? g.collective_seq.load() : ++g.collective_seq;
  entry.p2p_seq_id_ = p2p ? ++g.p2p_seq : g.p2p_seq.load();
  entry.op_id_ = ++g.op_id;
  entry.profiling_name_ = "hca:" + analyzer_name(op);
  if (p2p) {
    const bool send = std::strcmp(op, "send") == 0;
    entry.profiling_name_ += " " + std::to_string(rank) + (send ? "->" : "<-") + std::to_string(*peer);
  }
  entry.traceback_ = torch::CapturedTraceback::gather(true, true, g.recorder->capture_cpp_stack_);
  entry.start_ = entry.end_ = nullptr;
  entry.time_created_ = c10::getTime();
  entry.timeout_ms_ = timeout.count();
  // An in-place call's inputs are its outputs: the same list, entered twice. A list of one tensor
  // a rank is entered as that one stacked (gloo's and ProcessGroupNCCL's shape, which the analyzer
  // checks: an all-gather's output holds the input's elements times the group's size).
  const std::string_view name_of_op = op;
  const bool inputs_listed = name_of_op == "reduce_scatter" || name_of_op == "scatter";
  const bool outputs_listed = name_of_op == "all_gather" || name_of_op == "gather";
  for (const bool in : {true, false}) {
    auto& dims = in ? entry.input_dims_ : entry.output_dims_;
    auto& dtypes = in ? entry.input_dtypes_ : entry.output_dtypes_;
    const auto& tensors = in ? inputs : outputs;
    const bool stacked = (in ? inputs_listed : outputs_listed) && tensors.size() > 1 &&
                         std::all_of(tensors.begin(), tensors.end(), [&](const auto& t) {
                           return t.defined() && t.sizes() == tensors[0].sizes() &&
                                  t.scalar_type() == tensors[0].scalar_type();
                         });
    if (stacked) {
      dtypes.push_back(tensors[0].scalar_type());
      dims.push_back(tensors[0].dim() + 1);
      entry.sizes_.push_back(static_cast<int64_t>(tensors.size()));
      entry.sizes_.insert(entry.sizes_.end(), tensors[0].sizes().begin(), tensors[0].sizes().end());
      continue;
    }
    for (const auto& tensor : tensors) {
      if (!tensor.defined()) continue;
      dtypes.push_back(tensor.scalar_type());
      dims.push_back(tensor.dim());
      entry.sizes_.insert(entry.sizes_.end(), tensor.sizes().begin(), tensor.sizes().end());
    }
  }
  // Asked of the system once a thread (a call of its own each time costs more than the entry).
  thread_local const std::string thread_name = c10::getThreadName();
  entry.thread_name_ = thread_name;
  ticket.created = entry.time_created_;
  ticket.collective_seq = p2p ? -1 : static_cast<int64_t>(entry.collective_seq_id_);
  std::lock_guard<std::mutex> lock(g.recorder->mutex_);
  if (!g.ranks_recorded) {
    std::vector<uint64_t> ranks;
    for (int r = 0; r < size; ++r) ranks.push_back(global_ranks.empty() ? r : global_ranks.at(r));
    g.recorder->pg_name_to_ranks_[name] = std::move(ranks);
    g.recorder->all_pg_status_[g.pg_id] = g.status;
    g.ranks_recorded = true;
  }
  if constexpr (HasResetEpochs<TorchFlightRecorder>::value) {
    entry.reset_epoch_ = ticket.epoch = g.recorder->reset_epoch_;
  }
  ticket.id = entry.id_ = g.recorder->id_++;
  if (g.recorder->entries_.size() < g.recorder->max_entries_) {
    g.recorder->entries_.emplace_back(std::move(entry));
  } else {
    g.recorder->entries_[g.recorder->next_] = std::move(entry);
  }
  if (++g.recorder->next_ == g.recorder->max_entries_) g.recorder->next_ = 0;
  if (ticket.collective_seq >= 0) g.status->lastEnqueuedSeq = ticket.collective_seq;
  return ticket;
}

void FlightLog::finished(const Ticket& ticket, bool on_device) {
  const auto now = c10::getTime();
#ifdef C10D_BACKEND_HAS_HOOKS
  if (ticket.hooked) {
    std::vector<c10d::CompletionHook> hooks;
    {
      std::lock_guard<std::mutex> lock(hooks_mutex_);
      for (const auto& [id, hook] : hooks_) hooks.push_back(hook);
    }
    c10d::CompletionHookArgs args;
    args.completionKey = ticket.completion_key;
    if (!on_device) args.duration_ms = static_cast<float>(now - ticket.created) / 1e6f;
    for (const auto& hook : hooks) hook(args);
  }
#endif
  if (!group_ || !ticket.id) return;
  auto& g = *group_;
  std::lock_guard<std::mutex> lock(g.recorder->mutex_);
  if (g.recorder->entries_.empty()) return;
  auto& entry = g.recorder->entries_.at(slot_of(*g.recorder, *ticket.id, ticket.epoch));
  if (entry.id_ != *ticket.id) return;  // the ring has moved past it
  if constexpr (HasResetEpochs<TorchFlightRecorder>::value) {
    if (entry.reset_epoch_ != ticket.epoch) return;
  }
  entry.time_discovered_started_ = now;
  if (!on_device) {
    entry.time_discovered_completed_ = now;
    entry.duration_ = static_cast<float>(now - ticket.created) / 1e6f;
    if (ticket.collective_seq >= 0) g.status->lastCompletedSeq = ticket.collective_seq;
  }
  if (ticket.collective_seq >= 0) g.status->lastStartedSeq = ticket.collective_seq;
  entry.retired_ = true;
}

#ifdef C10D_BACKEND_HAS_HOOKS
void FlightLog::add_completion_hook(int64_t id, c10d::CompletionHook hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  hooks_[id] = std::move(hook);
  hooked_ = true;
}

void FlightLog::remove_completion_hook(int64_t id) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  hooks_.erase(id);
  hooked_ = !hooks_.empty();
}
#endif

std::exception_ptr with_flight_recorder_dump(std::exception_ptr error) {
  if (!error || !dumps_on_failure()) return error;
  static std::once_flag once;
  static std::string written_to;
  std::call_once(once, [] {
    try {
      auto& writer = c10d::DebugInfoWriter::getWriter(g_global_rank.load());
      writer.write(dump_of_hca_calls());
      written_to = writer.getWriterTarget();
    } catch (const std::exception& e) {
      TORCH_WARN("hca: the Flight Recorder dump was not written: ", e.what());
    }
  });
  if (written_to.empty()) return error;
  try {
    std::rethrow_exception(error);
  } catch (c10::Error& e) {
    constexpr char kSaid[] = "Flight Recorder dump of this rank: ";
    if (std::string(e.what()).find(kSaid) != std::string::npos) return error;  // one failure, several Works
    const auto folder = written_to.substr(0, written_to.find_last_of('/') + 1);
    e.add_context(kSaid + written_to + "; python -m torch_hca.fr_trace " + folder +
                  " reads every rank's and names the first call where they differ");
  } catch (...) {
  }
  return error;
}

#else  // torch before 2.13: no entries, no dumps

const FlightRecorderPlace& flight_recorder() {
  static const FlightRecorderPlace place{false, "not recording: torch before 2.13"};
  return place;
}

struct FlightLog::Group {};
FlightLog::FlightLog() = default;
FlightLog::~FlightLog() = default;
FlightLog::Ticket FlightLog::scheduled(const c10d::Backend&, const std::vector<int64_t>&, const char*,
                                       std::optional<int>, const std::vector<at::Tensor>&,
                                       const std::vector<at::Tensor>&, std::chrono::milliseconds) {
  return {};
}
void FlightLog::finished(const Ticket&, bool) {}
std::exception_ptr with_flight_recorder_dump(std::exception_ptr error) { return error; }

#endif
}  // namespace hca
