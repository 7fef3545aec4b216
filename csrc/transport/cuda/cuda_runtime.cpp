#include "cuda_runtime.h"

#include <cuda_runtime_api.h>

#include <string>

#include "check.h"
#include "stream_ops.h"

namespace hca::cuda {
namespace {

cudaStream_t as_stream(DeviceRuntime::Stream stream) { return static_cast<cudaStream_t>(stream); }
cudaEvent_t as_event(DeviceRuntime::Event event) { return static_cast<cudaEvent_t>(event); }

// An error of a call that waits for or asks about the device: a sticky one
// means the device faulted, and every later call fails the same way.
[[noreturn]] void device_fault(cudaError_t err) {
  cudaGetLastError();
  throw Failure(FailureKind::DeviceFault, "CUDA", -1,
                std::string("the GPU faulted while running hca's stream: ") + cudaGetErrorString(err));
}

class CudaRuntime final : public DeviceRuntime {
 public:
  int current_device() override {
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    return device;
  }
  void set_device(int device) override { check(cudaSetDevice(device), "cudaSetDevice"); }
  bool has_context(int device) override { return has_primary_context(device); }

  Stream create_stream() override {
    int least = 0, greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest), "cudaStreamCreateWithPriority");
    return stream;
  }
  Event create_event() override {
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    return event;
  }
  void destroy_event(Event event) override { cudaEventDestroy(as_event(event)); }
  void record(Event event, Stream stream) override { check(cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord"); }
  void wait(Stream stream, Event event) override {
    check(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0), "cudaStreamWaitEvent");
  }
  // In thread-local capture mode, as ProcessGroupNCCL's watchdog queries: in
  // the default (global) mode a query from this thread would invalidate a
  // graph the user is capturing on another.
  bool query(Event event) override {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
    cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t state = cudaEventQuery(as_event(event));
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (state == cudaSuccess) return true;
    if (state == cudaErrorNotReady) return false;
    device_fault(state);
  }
  void synchronize(Event event) override {
    const cudaError_t state = cudaEventSynchronize(as_event(event));
    if (state != cudaSuccess) device_fault(state);
  }
  bool capturing(Stream stream) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(as_stream(stream), &status), "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }
};

}  // namespace

DeviceRuntime& runtime() {
  static CudaRuntime* cuda_runtime = new CudaRuntime();  // never destroyed: no CUDA calls at exit
  return *cuda_runtime;
}

std::string uuid_text(const char* uuid) {
  static const char* hex = "0123456789abcdef";
  std::string text = "GPU-";
  for (int i = 0; i < 16; ++i) {
    text += hex[(uuid[i] >> 4) & 15];
    text += hex[uuid[i] & 15];
  }
  return text;
}

std::string device_uuid(int device) {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return uuid_text(prop.uuid.bytes);
}

}  // namespace hca::cuda
