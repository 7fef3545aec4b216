// The Python module torch_hca._C: the options (validated here, once), the two
// backend classes that torch_hca's creator picks between, and the plan for
// torch_hca.explain.
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include <algorithm>
#include <map>
#include <thread>
#include <tuple>

#include "../plan/rounds.h"
#include "../plan/topology.h"
#include "../transport/control/outside_load.h"
#include "../transport/control/peer_text.h"
#include "../transport/control/segment.h"
#include "../transport/shm/mailbox.h"
#include "../transport/cuda/cuda_executor.h"
#include "../transport/dry_run.h"
#include "../transport/stream/aligned_span.h"
#include "../transport/stream/model_runtime.h"
#include "calls/issue_order.hpp"
#include "engines/node_backend.hpp"
#include "engines/passthrough_backend.hpp"
#include "group/process_group_hca.hpp"
#include "ops/device_kernels.hpp"
#ifdef HCA_WITH_CUDA
#include "../transport/cuda/peer_links.h"
#endif

namespace py = pybind11;

namespace hca {

// The holder of the backends' Python objects: the last Python reference
// destroys the group with the GIL released, as torch's own groups are held.
// Destroying a group joins threads (its own, or a stock engine's) that may
// need the GIL to finish: gloo's run loop, on torch 2.14, frees the tensors of
// the last call it ran (Python's) as it stops, and waited for the GIL for ever
// while the destroying thread held it. One intrusive_ptr and nothing else:
// pybind11 reads torch's holders of c10d::Backend as this one.
template <class T>
class GilFreeDestroy {
 public:
  GilFreeDestroy() = default;
  explicit GilFreeDestroy(T* raw) : ptr_(c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(raw)) {}
  explicit GilFreeDestroy(c10::intrusive_ptr<T> ptr) : ptr_(std::move(ptr)) {}
  GilFreeDestroy(const GilFreeDestroy&) = default;
  GilFreeDestroy(GilFreeDestroy&&) noexcept = default;
  GilFreeDestroy& operator=(const GilFreeDestroy&) = default;
  GilFreeDestroy& operator=(GilFreeDestroy&&) noexcept = default;
  ~GilFreeDestroy() {
    if (ptr_ && PyGILState_Check()) {
      py::gil_scoped_release released;
      ptr_.reset();
    }
  }
  T* get() const { return ptr_.get(); }

 private:
  c10::intrusive_ptr<T> ptr_;
};

}  // namespace hca

PYBIND11_DECLARE_HOLDER_TYPE(T, hca::GilFreeDestroy<T>, true);

namespace hca {
namespace {

// std::invalid_argument from the plan surfaces as ValueError.
template <class Fn>
auto checked(Fn fn) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

py::list plan_to_python(const std::vector<PackPlan>& plan) {
  py::list packs;
  for (const auto& [pack, schedule] : plan) {
    py::list segments, steps;
    for (const auto& s : pack.segments) segments.append(py::make_tuple(s.tensor, s.offset, s.numel));
    for (const auto& step : schedule.steps) {
      py::list edges;
      for (const auto& e : step) edges.append(py::make_tuple(e.kind == EdgeKind::Reduce ? "reduce" : "copy", e.src, e.dst));
      steps.append(edges);
    }
    py::dict d;
    d["index"] = pack.index;
    d["dtype"] = dtype_name(pack.dtype);
    d["numel"] = pack.numel;
    d["segments"] = segments;
    d["steps"] = steps;
    d["result_ranks"] = schedule.result_ranks;
    packs.append(d);
  }
  return packs;
}

py::list roles_to_python(const std::vector<PackPlan>& plan, int world) {
  py::list ranks;
  for (int r = 0; r < world; ++r) {
    py::list roles;
    for (const Role& role : roles_of(plan, r)) {
      py::dict d;
      d["stages"] = role.stages;
      d["fused_step"] = role.fused_step;
      d["result"] = role.result;
      d["last_in"] = role.last_in;
      d["direct"] = role.direct;
      d["readers"] = role.readers;
      roles.append(d);
    }
    ranks.append(roles);
  }
  return ranks;
}

py::list rounds_to_python(const std::vector<Round>& rounds) {
  py::list out;
  for (const Round& round : rounds) {
    py::list pieces;
    for (const Piece& p : round) pieces.append(py::make_tuple(p.pack, p.begin, p.count, p.offset));
    out.append(pieces);
  }
  return out;
}

// An all-reduce's choice per call as Python passes it: (from bytes, algorithm, a pack per rank).
using ChoiceRows = std::vector<std::tuple<long long, std::string, bool>>;

std::vector<SizeChoice> size_choices(const ChoiceRows& rows) {
  std::vector<SizeChoice> choices;
  for (const auto& [from_bytes, algorithm, pack_per_rank] : rows) {
    choices.push_back({from_bytes, parse_algorithm(algorithm), pack_per_rank});
  }
  return choices;
}

ChoiceRows choice_rows(const std::vector<SizeChoice>& choices) {
  ChoiceRows rows;
  for (const auto& c : choices) rows.emplace_back(c.from_bytes, algorithm_name(c.algorithm), c.pack_per_rank);
  return rows;
}

std::vector<TensorDesc> float32_tensors(const std::vector<size_t>& numels) {
  std::vector<TensorDesc> tensors;
  for (size_t n : numels) tensors.push_back({DType::F32, n});
  return tensors;
}

// The plan `python -m torch_hca.explain` shows: of float32 tensors of `numels`.
std::vector<PackPlan> explained_plan(const std::string& collective, int world, const std::vector<size_t>& numels,
                                     const PlanOptions& options, int root, size_t slot_bytes) {
  if (world < 1) throw std::invalid_argument("world_size: must be >= 1, got " + std::to_string(world));
  validate(options, world);
  if (collective != "allreduce" && (root < 0 || root >= world)) {
    throw std::invalid_argument("root: " + std::to_string(root) + " is outside the world of " + std::to_string(world) +
                                " ranks");
  }
  if (slot_bytes < element_size(DType::F64)) throw std::invalid_argument("slot_bytes: must be >= 8");
  const auto tensors = float32_tensors(numels);
  if (collective == "allreduce") return plan_allreduce(tensors, world, options);
  if (collective == "reduce") return plan_reduce(tensors, world, root, options);
  if (collective == "broadcast") return plan_broadcast(tensors, world, root);
  throw std::invalid_argument("collective: expected allreduce, reduce or broadcast, got '" + collective + "'");
}

}  // namespace
}  // namespace hca

PYBIND11_MODULE(_C, m) {
  using namespace hca;
  py::module::import("torch.distributed");
  // c10 value/type errors raised while constructing surface as ValueError/TypeError,
  // as they do from collectives.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  py::class_<PackingOptions>(m, "PackingOptions")
      .def(py::init([](int num_packs, long long agg_bytes, int agg_group) {
             PackingOptions packing{num_packs, agg_bytes, agg_group};
             validate(packing);
             return packing;
           }),
           py::arg("num_packs"), py::arg("agg_small_grads_max_bytes"), py::arg("agg_small_grads_max_group"))
      .def_readonly("num_packs", &PackingOptions::num_packs)
      .def_readonly("agg_small_grads_max_bytes", &PackingOptions::agg_small_grads_max_bytes)
      .def_readonly("agg_small_grads_max_group", &PackingOptions::agg_small_grads_max_group);

  py::class_<PlanOptions>(m, "PlanOptions")
      .def(py::init([](const std::string& algorithm, const PackingOptions& packing,
                       std::optional<int> reduce_to_device, const Groups& groups,
                       const ChoiceRows& by_size) {
             PlanOptions options;
             options.algorithm = parse_algorithm(algorithm);
             options.packing = packing;
             options.by_size = size_choices(by_size);
             if (reduce_to_device && *reduce_to_device < 0) {
               throw std::invalid_argument("reduce_to_device: must be a rank (>= 0), got " +
                                           std::to_string(*reduce_to_device));
             }
             options.reduce_to_device = reduce_to_device.value_or(-1);
             options.groups = groups;
             validate(options);
             return options;
           }),
           py::arg("algorithm"), py::arg("packing"), py::arg("reduce_to_device"), py::arg("groups"),
           py::arg("by_size") = ChoiceRows{})
      .def("validate_for", [](const PlanOptions& o, int world) { validate(o, world); }, py::arg("world_size"))
      .def(
          "validate_across_nodes",
          [](const PlanOptions& o, const std::vector<std::string>& identities) {
            checked([&] { validate_across_nodes(o, group_by_node(identities)); });
          },
          py::arg("node_identities"))
      .def_property_readonly("algorithm", [](const PlanOptions& o) { return algorithm_name(o.algorithm); })
      .def_readonly("packing", &PlanOptions::packing)
      .def_property_readonly("by_size", [](const PlanOptions& o) { return choice_rows(o.by_size); });

  py::class_<ProcessGroupHCA, c10d::Backend, GilFreeDestroy<ProcessGroupHCA>>(m, "ProcessGroupHCA")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int64_t timeout_ms,
                       const PlanOptions& options, size_t shm_slot_bytes, int shm_slots, size_t cuda_slot_bytes,
                       int cuda_slots, bool cuda_host_staging, const std::string& cpu_executor,
                       const Groups& cuda_groups,
                       const std::map<std::pair<int, bool>, std::pair<ChoiceRows, std::string>>& cpu_tables,
                       const std::vector<std::vector<int>>& cpus_of_ranks,
                       const std::map<int, std::pair<ChoiceRows, std::string>>& cuda_tables_sharing_one_gpu,
                       const std::map<int, std::pair<ChoiceRows, std::string>>& cuda_tables_gpu_per_rank) {
             CpuExecutor cpu = CpuExecutor::SharedMemory;
             if (cpu_executor == "streams") {
               cpu = CpuExecutor::HostStreams;
             } else if (cpu_executor != "shm") {
               throw py::value_error("TORCH_HCA_CPU_EXECUTOR='" + cpu_executor +
                                    "': expected 'shm' (the default) or 'streams' (the stream executor on host threads)");
             }
             ProcessGroupHCA::ChoiceTables tables;
             for (const auto& [key, table] : cpu_tables) {
               tables.cpu[key] = {size_choices(table.first), table.second};
             }
             tables.cpus_of_ranks = cpus_of_ranks;
             for (const auto& [world, table] : cuda_tables_sharing_one_gpu) {
               tables.cuda_sharing_one_gpu[world] = {size_choices(table.first), table.second};
             }
             for (const auto& [world, table] : cuda_tables_gpu_per_rank) {
               tables.cuda_gpu_per_rank[world] = {size_choices(table.first), table.second};
             }
             return GilFreeDestroy(c10::make_intrusive<ProcessGroupHCA>(
                 store, rank, size, std::chrono::milliseconds(timeout_ms), options, shm_slot_bytes, shm_slots,
                 cuda::CudaConfig{cuda_slot_bytes, cuda_slots, cuda_host_staging}, cpu, cuda_groups,
                 std::move(tables)));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"), py::arg("options"),
           py::arg("shm_slot_bytes"), py::arg("shm_slots"), py::arg("cuda_slot_bytes"), py::arg("cuda_slots"),
           py::arg("cuda_host_staging") = false, py::arg("cpu_executor") = "shm", py::arg("cuda_groups") = Groups{},
           py::arg("cpu_tables") = std::map<std::pair<int, bool>, std::pair<ChoiceRows, std::string>>{},
           py::arg("cpus_of_ranks") = std::vector<std::vector<int>>{},
           py::arg("cuda_tables_sharing_one_gpu") = std::map<int, std::pair<ChoiceRows, std::string>>{},
           py::arg("cuda_tables_gpu_per_rank") = std::map<int, std::pair<ChoiceRows, std::string>>{},
           py::call_guard<py::gil_scoped_release>())
      .def_static("self_test_wanted", &ProcessGroupHCA::self_test_wanted)
      // torch's Options (name, timeout), which Python cannot copy: torch_hca.backend wraps it as `options`.
      .def("_backend_options", &ProcessGroupHCA::getBackendOptions)
      .def_property_readonly("algorithm",
                             [](const ProcessGroupHCA& pg) -> std::string {
                               return pg.options().by_size.empty() ? algorithm_name(pg.options().algorithm)
                                                                   : "chosen per call";
                             })
      .def_property("hierarchy", &ProcessGroupHCA::hierarchy, &ProcessGroupHCA::set_hierarchy)
      .def_property_readonly("cpu_cost_model", &ProcessGroupHCA::cpu_cost_model)
      .def_property_readonly("cuda_cost_model", &ProcessGroupHCA::cuda_cost_model)
      .def("groups", &ProcessGroupHCA::groups, py::arg("cuda"))
      .def(
          "by_size",
          [](const ProcessGroupHCA& pg, bool cuda) { return choice_rows(pg.by_size(cuda)); }, py::arg("cuda"))
      .def(
          "_settle_cuda_choice",
          [](ProcessGroupHCA& pg, const std::string& gpu) { pg.settle_cuda_choice([&] { return gpu; }); },
          py::arg("gpu"),
           py::call_guard<py::gil_scoped_release>())
      .def("staging", &ProcessGroupHCA::staging, py::arg("cuda"), py::call_guard<py::gil_scoped_release>())
      .def("staging_slot_bytes", &ProcessGroupHCA::staging_slot_bytes, py::arg("cuda"),
           py::call_guard<py::gil_scoped_release>())
      .def("_peer_waits", &ProcessGroupHCA::peer_waits, py::arg("cuda"), py::call_guard<py::gil_scoped_release>())
      .def("_scribble_for_test", &ProcessGroupHCA::scribble_for_test, py::arg("seed"))
      .def("_p2p_reserved_bytes", &ProcessGroupHCA::p2p_reserved_bytes)
      .def("_cpu_said_by", &ProcessGroupHCA::cpu_said_by, py::arg("rank"))
      // Backend.get_error from torch 2.14 on; here for older torch too.
      .def("get_error", &ProcessGroupHCA::getError)
      .def_property("_global_ranks", [](ProcessGroupHCA& pg) { return pg.calls().global_ranks(); },
                    [](ProcessGroupHCA& pg, const std::vector<int64_t>& ranks) { pg.calls().set_global_ranks(ranks); });

  py::class_<PassthroughBackend, c10d::Backend, GilFreeDestroy<PassthroughBackend>>(m, "PassthroughBackend")
      .def(py::init([](int rank, int size, int64_t timeout_ms, const PackingOptions& packing,
                       const c10::intrusive_ptr<c10d::Backend>& cpu_engine,
                       const c10::intrusive_ptr<c10d::Backend>& cuda_engine,
                       const c10::intrusive_ptr<c10d::Store>& one_node_store) {
             return GilFreeDestroy(c10::make_intrusive<PassthroughBackend>(
                 rank, size, std::chrono::milliseconds(timeout_ms), packing, Engines{cpu_engine, cuda_engine},
                 one_node_store));
           }),
           py::arg("rank"), py::arg("size"), py::arg("timeout_ms"), py::arg("packing"), py::arg("cpu_engine"),
           py::arg("cuda_engine") = py::none(), py::arg("one_node_store") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("algorithm", [](const PassthroughBackend&) { return "nccl"; })
      .def_property_readonly("agreements", &PassthroughBackend::agreements)
      // Backend.get_error from torch 2.14 on; here for older torch too.
      .def("get_error", &PassthroughBackend::getError)
      .def_property("_global_ranks", [](PassthroughBackend& pg) { return pg.calls().global_ranks(); },
                    [](PassthroughBackend& pg, const std::vector<int64_t>& ranks) {
                      pg.calls().set_global_ranks(ranks);
                    });

  using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
  py::class_<NodeBackend, c10d::Backend, GilFreeDestroy<NodeBackend>>(m, "NodeBackend")
      .def(py::init([](int rank, int size, int64_t timeout_ms, const PlanOptions& options,
                       const std::vector<std::string>& node_identities, ProcessGroupHCA& local,
                       const std::map<int, BackendPtr>& leader_cpu, const std::map<int, BackendPtr>& leader_cuda,
                       const BackendPtr& world_cpu, const BackendPtr& world_cuda) {
             std::map<int, Engines> leaders;
             for (const auto& [position, engine] : leader_cpu) leaders[position].cpu = engine;
             for (const auto& [position, engine] : leader_cuda) leaders[position].cuda = engine;
             return GilFreeDestroy(c10::make_intrusive<NodeBackend>(
                 rank, size, std::chrono::milliseconds(timeout_ms), options,
                 checked([&] { return group_by_node(node_identities); }),
                 c10::intrusive_ptr<ProcessGroupHCA>::unsafe_reclaim_from_nonowning(&local), std::move(leaders),
                 Engines{world_cpu, world_cuda}));
           }),
           py::arg("rank"), py::arg("size"), py::arg("timeout_ms"), py::arg("options"), py::arg("node_identities"),
           py::arg("local"), py::arg("leader_cpu"), py::arg("leader_cuda"), py::arg("world_cpu"),
           py::arg("world_cuda") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("algorithm", [](const NodeBackend& pg) { return algorithm_name(pg.options().algorithm); })
      .def_property_readonly("nodes", [](const NodeBackend& pg) { return pg.nodes().members; })
      .def_property_readonly("local", &NodeBackend::local)
      .def("get_error", &NodeBackend::getError)  // as ProcessGroupHCA's
      .def_property("_global_ranks", [](NodeBackend& pg) { return pg.calls().global_ranks(); },
                    [](NodeBackend& pg, const std::vector<int64_t>& ranks) { pg.calls().set_global_ranks(ranks); });

  m.def(
      "nodes",
      [](const std::vector<std::string>& identities) {
        return checked([&] {
          const Nodes nodes = group_by_node(identities);
          std::vector<std::vector<int>> leaders;
          for (int p = 0; p < nodes.positions(); ++p) leaders.push_back(nodes.leaders(p));
          return py::make_tuple(nodes.members, leaders);
        });
      },
      py::arg("node_identities"));
  m.def(
      "exchange_reports",
      [](const c10::intrusive_ptr<c10d::Store>& store, const std::string& topic, int rank, int size,
         const std::string& mine, int64_t timeout_ms) {
        StoreRendezvous rendezvous(store);
        return exchange_reports(rendezvous, topic, rank, size, mine, std::chrono::milliseconds(timeout_ms));
      },
      py::arg("store"), py::arg("topic"), py::arg("rank"), py::arg("size"), py::arg("mine"), py::arg("timeout_ms"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_flight_recorder", [] { return flight_recorder().text; },
      "Where hca's calls are entered in torch's Flight Recorder, or why they are not");
  m.def("_mailbox_ring_bytes", &shm::Mailbox::ring_bytes_for, py::arg("world"),
        "Bytes of each point-to-point channel's ring in a group of `world` ranks");
  m.def("_stashed_bytes_in_process", &shm::stashed_bytes_in_process,
        "Bytes of early point-to-point messages this process holds, over all its groups (tests)");
  m.def(
      "_outside_cores",
      [](const std::vector<int>& group, double seconds) {
        std::vector<ProcessId> processes;
        for (int pid : group) processes.push_back({pid, process_start_time(pid)});
        const auto from = sample_cpu(processes);
        std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
        const auto to = sample_cpu(processes);
        if (!from || !to) throw std::runtime_error("hca: /proc/stat cannot be read here");
        return outside_cores(*from, *to);
      },
      py::arg("group"), py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
      "Tests: the cores' worth of CPU that processes other than `group` (pids) used over `seconds`, "
      "as a wait judges a late yield");
  m.def(
      "_peer_text",
      [](const py::bytes& text, size_t capacity) {
        const std::string bytes = text;
        return peer_text(bytes.c_str(), std::min(capacity, bytes.size() + 1));
      },
      py::arg("text"), py::arg("capacity"),
      "Tests: how hca shows `text` (at most `capacity` bytes) that a peer wrote into shared memory");
  m.def("shared_memory_identity", &shared_memory_identity,
        "This process's kernel (boot id) and /dev/shm (its device): equal for ranks that share memory");
  // Tests: joins the segment the store names under `key` as `rank` (rank 0 creates it and
  // waits for the others to attach, the others attach), then leaves it.
  m.def(
      "_join_shared_segment",
      [](const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank, int world, size_t bytes,
         const std::string& layout, int64_t timeout_ms, size_t share_bytes) {
        StoreRendezvous rendezvous(store);
        SharedSegment(rendezvous, key, rank, world, bytes, layout, std::chrono::milliseconds(timeout_ms),
                      [](char*) {}, "", share_bytes);
      },
      py::arg("store"), py::arg("key"), py::arg("rank"), py::arg("world"), py::arg("bytes"), py::arg("layout"),
      py::arg("timeout_ms"), py::arg("share_bytes") = 0, py::call_guard<py::gil_scoped_release>());
  m.def(
      "publish_setup_failure",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::string& cause) {
        StoreRendezvous rendezvous(store);
        publish_setup_failure(rendezvous, rank, cause);
      },
      py::arg("store"), py::arg("rank"), py::arg("cause"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "explain_nodes",
      [](const std::vector<size_t>& numels, const std::vector<std::string>& identities, const PlanOptions& options) {
        return checked([&] {
          const Nodes nodes = group_by_node(identities);
          validate_across_nodes(options, nodes);
          py::list packs;
          for (const Pack& pack : make_packs(float32_tensors(numels), options.packing)) {
            const int position = pack_position(nodes, options, pack.index);
            py::dict d;
            d["index"] = pack.index;
            d["numel"] = pack.numel;
            d["position"] = position;
            d["leaders"] = nodes.leaders(position);
            packs.append(d);
          }
          return py::make_tuple(packs, explain_nodes(float32_tensors(numels), nodes, options));
        });
      },
      py::arg("numels"), py::arg("node_identities"), py::arg("options"));

  m.def("default_groups", &default_groups, py::arg("world_size"));
  m.def(
      "groups_from_places",
      [](const std::vector<Place>& places, const std::vector<std::string>& level_names) {
        const Hierarchy h = groups_from_places(places, level_names);
        return py::make_tuple(h.groups, h.level, h.reason);
      },
      py::arg("places"), py::arg("level_names"));
  m.def("link_cliques", [](const std::vector<std::vector<bool>>& linked) { return checked([&] { return link_cliques(linked); }); },
        py::arg("linked"));
  // The CPU model of the device (TORCH_HCA_CPU_EXECUTOR=streams), driven by tests as torch.cuda
  // drives a GPU: the calling thread's current device, the caller's current stream of the device
  // the process's CPU tensors stand for, and kernels of "the user" queued on it.
  auto model = m.def_submodule("_model", "the CPU model of the device, for tests");
  model.def("set_device", [](int device) { ModelRuntime::instance().set_device(device); });
  model.def("current_device", [] { return ModelRuntime::instance().current_device(); });
  model.def("tensor_device", [] { return ModelRuntime::instance().tensor_device(); });
  model.def("contexts", [] { return ModelRuntime::instance().contexts(); });
  model.def(
      "use_side_stream",
      [](bool side) {
        ModelRuntime& rt = ModelRuntime::instance();
        DeviceGuard guard(rt, rt.tensor_device());
        rt.set_current_stream(rt.tensor_device(), side ? rt.create_stream() : nullptr);
      },
      py::arg("side"));
  model.def(
      "capture", [](bool active) { ModelRuntime::instance().capture(active); }, py::arg("active"),
      "the calling thread starts (ends) capturing a graph on its current stream, a side stream");
  model.def(
      "enqueue_copy",
      [](at::Tensor dst, at::Tensor src, double delay_ms) {
        ModelRuntime& rt = ModelRuntime::instance();
        DeviceGuard guard(rt, rt.tensor_device());
        rt.launch_on(rt.current_stream(rt.tensor_device())).issue([dst, src, delay_ms]() mutable {
          std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(delay_ms));
          dst.copy_(src);
        });
      },
      py::arg("dst"), py::arg("src"), py::arg("delay_ms") = 0.0,
      "a kernel of the caller: on its current stream, after `delay_ms`, dst.copy_(src)");
  model.def(
      "synchronize",
      [] {
        ModelRuntime& rt = ModelRuntime::instance();
        HostStream& current = rt.stream_on(rt.tensor_device(), rt.current_stream(rt.tensor_device()));
        current.synchronize(current.record());
      },
      py::call_guard<py::gil_scoped_release>(), "the host waits for the caller's current stream");
  model.def(
      "in_device_turn",
      [](const py::function& fn) {
        DeviceRuntime& runtime = ModelRuntime::instance();
        const auto turn = std::make_unique<IssueTicket>(&runtime, ModelRuntime::instance().tensor_device());
        {
          py::gil_scoped_release released;
          turn->await();
        }
        const IssueTicket::Held held(turn.get());
        fn();
      },
      py::arg("fn"),
      "fn() in a turn of the tensors' device, taken now, as a call across nodes runs its stages: "
      "the calls it makes on the device issue in that turn, which ends once they have");
  m.def(
      "_aligned_span",
      [](uintptr_t dst, uintptr_t src, size_t bytes) {
        const AlignedSpan span = aligned_span(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), bytes);
        return py::make_tuple(span.head, span.unit, span.units, span.tail);
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"));
  auto kernels = m.def_submodule("_kernels", "The kernels of the data operations, alone (torch_hca.bench --kernels)");
  kernels.def("sum", &kernel_sum, py::arg("out"), py::arg("inputs"), py::call_guard<py::gil_scoped_release>(),
              "out = inputs[0] + inputs[1] + ...: CUDA tensors on the current stream, CPU tensors at once");
  kernels.def("copy", &kernel_copy, py::arg("dst"), py::arg("src"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "_fit_host_ring",
      [](size_t slot_bytes, int slots, int world, size_t free_bytes) {
        const FittedRing fitted = fit_ring({slot_bytes, slots}, world, free_bytes);
        return py::make_tuple(fitted.ring.slot_bytes, fitted.ring.slots, fitted.note);
      },
      py::arg("slot_bytes"), py::arg("slots"), py::arg("world"), py::arg("free_bytes"),
      "The ring host staging takes where `world` rings of the one asked do not fit in `free_bytes` of /dev/shm");
  m.def("share_one_device", &share_one_device, py::arg("devices"),
        "Whether ranks that report these devices are two or more sharing one (the rule of the CUDA table and slot)");
  m.def(
      "cuda_slot_bytes",
      [](size_t asked, const std::vector<std::string>& devices) {
        return ring_slot_bytes(asked, devices, cuda::kSlotBytesSpread, cuda::kSlotBytesOneGpu);
      },
      py::arg("asked"), py::arg("devices"),
      "The CUDA staging slot of a group whose ranks report these GPUs, TORCH_HCA_CUDA_CHUNK_BYTES being `asked` "
      "(0: unset)");
#ifdef HCA_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("peer_performance_rank", &cuda::peer_performance_rank, py::arg("src"), py::arg("dst"));
#else
  m.attr("has_cuda") = false;
#endif
  m.def(
      "plan",
      [](const std::string& collective, int world, const std::vector<size_t>& numels, const PlanOptions& options,
         int root, size_t slot_bytes) {
        return checked([&] {
          const auto plan = explained_plan(collective, world, numels, options, root, slot_bytes);
          const auto rounds = cut_rounds(plan, slot_bytes);
          const std::string text = explain(plan) + roles_text(plan, world) + "rounds of a " +
                                   std::to_string(slot_bytes) + "-byte slot:\n" + rounds_text(rounds);
          return py::make_tuple(plan_to_python(plan), text, roles_to_python(plan, world), rounds_to_python(rounds));
        });
      },
      py::arg("collective"), py::arg("world_size"), py::arg("numels"), py::arg("options"), py::arg("root"),
      py::arg("slot_bytes"));
  m.def(
      "peer_waits_of_call",
      [](const std::string& collective, int world, const std::vector<size_t>& numels, const PlanOptions& options,
         int root, size_t slot_bytes, int slots) {
        return checked([&] {
          if (slots < 1) throw std::invalid_argument("slots: must be >= 1, got " + std::to_string(slots));
          const auto plan = explained_plan(collective, world, numels, options, root, slot_bytes);
          return peer_waits_of_call(plan, world, RingLayout{slot_bytes, slots});
        });
      },
      py::arg("collective"), py::arg("world_size"), py::arg("numels"), py::arg("options"), py::arg("root"),
      py::arg("slot_bytes"), py::arg("slots"),
      "Per rank, the waits on peers' words a stream issues for one such call, every slot of the ring used before");
  m.def(
      "packs",
      [](const std::vector<size_t>& numels, const PackingOptions& packing) {
        std::vector<PackPlan> plan;
        for (auto& pack : make_packs(float32_tensors(numels), packing)) plan.push_back({std::move(pack), {}});
        return py::make_tuple(plan_to_python(plan), explain(plan));
      },
      py::arg("numels"), py::arg("packing"));
}
