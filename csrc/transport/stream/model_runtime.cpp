#include "model_runtime.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>

#include "../control/failure.h"

namespace hca {
namespace {

thread_local std::map<int, DeviceRuntime::Stream> current_streams_of_thread;
thread_local DeviceRuntime::Stream capture_of_thread = nullptr;  // the stream this thread captures on

struct ModelEvent {
  int device;
  std::shared_ptr<HostStream> stream;  // null until recorded
  uint64_t mark = 0;
};

ModelEvent& model_event(DeviceRuntime::Event event) { return *static_cast<ModelEvent*>(event); }

int env_int(const char* name, int fallback) {
  const char* text = std::getenv(name);
  return text && *text ? std::atoi(text) : fallback;
}

[[noreturn]] void cuda_error(const std::string& call, const std::string& why) {
  throw Failure(FailureKind::Setup, "CPU model of the device", -1, call + " failed: " + why);
}

}  // namespace

ModelRuntime& ModelRuntime::instance() {
  static ModelRuntime* runtime = new ModelRuntime();
  return *runtime;
}

ModelRuntime::ModelRuntime() {
  tensor_device_ = env_int("TORCH_HCA_MODEL_DEVICE", 0);
  if (const char* visible = std::getenv("TORCH_HCA_MODEL_VISIBLE"); visible && *visible) {
    std::stringstream list(visible);
    for (std::string id; std::getline(list, id, ',');) visible_.push_back(std::atoi(id.c_str()));
  } else {
    for (int d = 0; d < env_int("TORCH_HCA_MODEL_DEVICES", tensor_device_ + 1); ++d) visible_.push_back(d);
  }
  if (const char* folder = std::getenv("TORCH_HCA_MODEL_EXCLUSIVE")) exclusive_folder_ = folder;
  host_runs_ahead_ = env_int("TORCH_HCA_MODEL_RUN_AHEAD", 0) != 0;
  if (tensor_device_ < 0 || tensor_device_ >= devices()) {
    cuda_error("the model's set-up", "TORCH_HCA_MODEL_DEVICE=" + std::to_string(tensor_device_) + " is not one of " +
                                         std::to_string(devices()) +
                                         " devices (TORCH_HCA_MODEL_DEVICES, TORCH_HCA_MODEL_VISIBLE)");
  }
}

bool ModelRuntime::sees_physical(int physical) const {
  return std::find(visible_.begin(), visible_.end(), physical) != visible_.end();
}

void ModelRuntime::check_device(int device) const {
  if (device < 0 || device >= devices()) {
    cuda_error("cudaSetDevice", "invalid device ordinal " + std::to_string(device) + " (" +
                                    std::to_string(devices()) + " devices)");
  }
}

int& ModelRuntime::current_device_of_thread() {
  thread_local int device = 0;
  return device;
}

int ModelRuntime::current_device() { return current_device_of_thread(); }

void ModelRuntime::set_device(int device) {
  check_device(device);
  create_context(device);  // as cudaSetDevice does from CUDA 12 on
  current_device_of_thread() = device;
}

bool ModelRuntime::has_context(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return contexts_.count(device) > 0;
}

std::vector<int> ModelRuntime::contexts() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {contexts_.begin(), contexts_.end()};
}

int ModelRuntime::with_context() {
  const int device = current_device_of_thread();
  create_context(device);
  return device;
}

void ModelRuntime::create_context(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (contexts_.count(device)) return;
  if (!exclusive_folder_.empty()) {
    const std::string path = exclusive_folder_ + "/device" + std::to_string(physical(device));
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (fd >= 0) close(fd);
      cuda_error("creating a context on device " + std::to_string(device),
                 "all CUDA-capable devices are busy or unavailable (device " + std::to_string(device) +
                     " is EXCLUSIVE_PROCESS and another process has a context on it)");
    }
    exclusive_locks_.push_back(fd);
  }
  contexts_.insert(device);
}

HostStream& ModelRuntime::legacy(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& stream = legacy_[device];
  if (!stream) stream = std::make_unique<HostStream>(device);
  return *stream;
}

HostStream& ModelRuntime::stream_on(int device, Stream stream) {
  return stream ? *static_cast<HostStream*>(stream) : legacy(device);
}

HostStream& ModelRuntime::launch_on(Stream stream) {
  const int device = with_context();
  HostStream& target = stream_on(device, stream);
  if (target.device() != device) {
    cuda_error("a kernel launch", "invalid resource handle (the stream is of device " +
                                      std::to_string(target.device()) + ", the current device is " +
                                      std::to_string(device) + ")");
  }
  return target;
}

DeviceRuntime::Stream ModelRuntime::create_stream() {
  refuse_while_capturing("cudaStreamCreate");
  auto stream = std::make_shared<HostStream>(with_context());
  std::lock_guard<std::mutex> lock(mutex_);
  streams_[stream.get()] = stream;
  return stream.get();
}

DeviceRuntime::Stream ModelRuntime::current_stream(int device) {
  check_device(device);
  auto found = current_streams_of_thread.find(device);
  return found == current_streams_of_thread.end() ? nullptr : found->second;
}

void ModelRuntime::set_current_stream(int device, Stream stream) {
  check_device(device);
  current_streams_of_thread[device] = stream;
}

DeviceRuntime::Event ModelRuntime::create_event() {
  refuse_while_capturing("cudaEventCreate");
  return new ModelEvent{with_context()};
}

bool ModelRuntime::capturing(Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return stream && capturing_.count(stream) > 0;
}

void ModelRuntime::capture(bool active) {
  Stream stream = current_stream(tensor_device_);
  if (!stream) cuda_error("cudaStreamBeginCapture", "operation not permitted on the legacy stream");
  std::lock_guard<std::mutex> lock(mutex_);
  if (active) {
    capturing_.insert(stream);
  } else {
    capturing_.erase(stream);
  }
  capture_of_thread = active ? stream : nullptr;
}

void ModelRuntime::refuse_while_capturing(const char* call) {
  if (capture_of_thread) {
    cuda_error(call, "operation not permitted when stream is capturing (the model refuses every device call of "
                     "a capturing thread)");
  }
}

void ModelRuntime::destroy_event(Event event) {
  refuse_while_capturing("cudaEventDestroy");
  with_context();
  delete static_cast<ModelEvent*>(event);
}

void ModelRuntime::record(Event event, Stream stream) {
  refuse_while_capturing("cudaEventRecord");
  HostStream& target = resolve(stream);
  ModelEvent& e = model_event(event);
  if (target.device() != e.device) {
    cuda_error("cudaEventRecord", "invalid resource handle (an event of device " + std::to_string(e.device) +
                                      " recorded on a stream of device " + std::to_string(target.device()) + ")");
  }
  std::shared_ptr<HostStream> owner;
  if (stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    owner = streams_.at(&target);
  } else {
    owner = std::shared_ptr<HostStream>(&target, [](HostStream*) {});  // the legacy streams live for good
  }
  e.mark = target.record();
  e.stream = std::move(owner);
}

void ModelRuntime::wait(Stream stream, Event event) {
  refuse_while_capturing("cudaStreamWaitEvent");
  HostStream& waiter = resolve(stream);
  const ModelEvent& e = model_event(event);
  if (!e.stream) return;  // never recorded: nothing to wait for
  waiter.issue([stream = e.stream, mark = e.mark] { stream->wait_passed(mark); });
}

bool ModelRuntime::query(Event event) {
  refuse_while_capturing("cudaEventQuery");
  with_context();
  const ModelEvent& e = model_event(event);
  return !e.stream || e.stream->passed(e.mark);
}

void ModelRuntime::synchronize(Event event) {
  refuse_while_capturing("cudaEventSynchronize");
  with_context();
  const ModelEvent& e = model_event(event);
  if (e.stream) e.stream->synchronize(e.mark);
}

}  // namespace hca
