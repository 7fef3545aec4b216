#include "staging_place.h"

#include <algorithm>

namespace hca {

StagingChoice choose_staging_place(Rendezvous& rendezvous, const std::string& topic, int rank, int world,
                                  const std::string& my_device, const std::function<bool(const std::string&)>& reaches,
                                  bool host_asked, std::chrono::milliseconds timeout) {
  const std::vector<std::string> devices =
      exchange_reports(rendezvous, topic + "_device", rank, world, my_device, timeout);
  bool reaches_all = !host_asked;
  for (int peer = 0; peer < world && reaches_all; ++peer) {
    if (peer != rank && devices[peer] != my_device) reaches_all = reaches(devices[peer]);
  }
  // A second exchange: each rank's verdict, so that every rank decides from all of them.
  const std::vector<std::string> verdicts =
      exchange_reports(rendezvous, topic + "_reaches_all", rank, world, reaches_all ? "1" : "0", timeout);
  const bool everyone = std::all_of(verdicts.begin(), verdicts.end(), [](const std::string& v) { return v == "1"; });
  return {everyone ? StagingPlace::DeviceMemory : StagingPlace::HostMemory, devices};
}

bool share_one_device(const std::vector<std::string>& devices) {
  return devices.size() >= 2 &&
         std::all_of(devices.begin(), devices.end(), [&](const std::string& d) { return d == devices.front(); });
}

bool each_on_its_own(const std::vector<std::string>& devices) {
  std::vector<std::string> sorted = devices;
  std::sort(sorted.begin(), sorted.end());
  return sorted.size() >= 2 && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

size_t ring_slot_bytes(size_t asked, const std::vector<std::string>& devices, size_t spread, size_t one_device) {
  if (asked != 0) return asked;
  return share_one_device(devices) ? one_device : spread;
}

}  // namespace hca
