// The Python module torch_hca._C: the backend's constructor for the creator
// that torch_hca registers, and the plan for torch_hca.explain.
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "process_group_hca.hpp"

namespace py = pybind11;

namespace hca {
namespace {

PlanOptions plan_options(const std::string& algorithm, int num_packs, int reduce_to_device, const Groups& groups,
                         long long agg_small_grads_max_bytes, int agg_small_grads_max_group) {
  PlanOptions options;
  options.algorithm = parse_algorithm(algorithm);
  options.packing = {num_packs, agg_small_grads_max_bytes, agg_small_grads_max_group};
  options.reduce_to_device = reduce_to_device;
  options.groups = groups;
  return options;
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

}  // namespace
}  // namespace hca

PYBIND11_MODULE(_C, m) {
  using namespace hca;
  py::module::import("torch.distributed");
  // Plan errors (std::invalid_argument) and c10 value/type errors raised while
  // constructing surface as ValueError/TypeError, as they do from collectives.
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

  py::class_<ProcessGroupHCA, c10d::Backend, c10::intrusive_ptr<ProcessGroupHCA>>(m, "ProcessGroupHCA")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int64_t timeout_ms,
                       const std::string& algorithm, int num_packs, int reduce_to_device, const Groups& groups,
                       long long agg_bytes, int agg_group, size_t chunk_bytes,
                       const c10::intrusive_ptr<c10d::Backend>& cpu_engine,
                       const c10::intrusive_ptr<c10d::Backend>& cuda_engine) {
             return c10::make_intrusive<ProcessGroupHCA>(
                 store, rank, size, std::chrono::milliseconds(timeout_ms),
                 plan_options(algorithm, num_packs, reduce_to_device, groups, agg_bytes, agg_group), chunk_bytes,
                 cpu_engine, cuda_engine);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"), py::arg("algorithm"),
           py::arg("num_packs"), py::arg("reduce_to_device"), py::arg("groups"), py::arg("agg_small_grads_max_bytes"),
           py::arg("agg_small_grads_max_group"), py::arg("chunk_bytes"), py::arg("cpu_engine") = py::none(),
           py::arg("cuda_engine") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("algorithm", [](const ProcessGroupHCA& pg) { return algorithm_name(pg.options().algorithm); });

  m.def("default_groups", &default_groups, py::arg("world_size"));
  m.def(
      "plan",
      [](const std::string& collective, int world, const std::vector<size_t>& numels, const std::string& algorithm,
         int num_packs, int reduce_to_device, const Groups& groups, long long agg_bytes, int agg_group, int root) {
        const PlanOptions options = plan_options(algorithm, num_packs, reduce_to_device, groups, agg_bytes, agg_group);
        if (world < 1) throw std::invalid_argument("world_size: must be >= 1, got " + std::to_string(world));
        validate(options, world);
        if (collective != "allreduce" && (root < 0 || root >= world)) {
          throw std::invalid_argument("root: " + std::to_string(root) + " is outside the world of " +
                                      std::to_string(world) + " ranks");
        }
        std::vector<TensorDesc> tensors;
        for (size_t n : numels) tensors.push_back({DType::F32, n});
        std::vector<PackPlan> plan;
        if (collective == "allreduce") plan = plan_allreduce(tensors, world, options);
        else if (collective == "reduce") plan = plan_reduce(tensors, world, root, options);
        else if (collective == "broadcast") plan = plan_broadcast(tensors, world, root);
        else throw std::invalid_argument("collective: expected allreduce, reduce or broadcast, got '" + collective + "'");
        return py::make_tuple(plan_to_python(plan), explain(plan));
      },
      py::arg("collective"), py::arg("world_size"), py::arg("numels"), py::arg("algorithm"), py::arg("num_packs"),
      py::arg("reduce_to_device"), py::arg("groups"), py::arg("agg_small_grads_max_bytes"),
      py::arg("agg_small_grads_max_group"), py::arg("root"));
}
