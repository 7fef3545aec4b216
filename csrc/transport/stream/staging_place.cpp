#include "staging_place.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "../../plan/rounds.h"
#include "../control/segment.h"

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

std::string agree_mapped(Rendezvous& rendezvous, const std::string& topic, int rank, int world,
                         const std::string& mine, std::chrono::milliseconds timeout) {
  // A report of "" reads as missing to some stores: "+" says mapped, "-why" not.
  const auto reports = exchange_reports(rendezvous, topic, rank, world, mine.empty() ? "+" : "-" + mine, timeout);
  for (int r = 0; r < world; ++r) {
    if (reports[r] != "+") return "rank " + std::to_string(r) + " " + reports[r].substr(1);
  }
  return "";
}

namespace {

std::string mib(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

std::string ring_text(RingLayout ring) {
  return std::to_string(ring.slots) + " slots of " + std::to_string(ring.slot_bytes) + " bytes";
}

}  // namespace

FittedRing fit_ring(RingLayout asked, int world, size_t free_bytes) {
  const size_t ranks = static_cast<size_t>(world);
  const auto fits = [&](RingLayout ring) { return ring.bytes() <= free_bytes / ranks; };
  RingLayout ring = asked;
  while (!fits(ring) && ring.slots > 2) --ring.slots;
  while (!fits(ring) && ring.slot_bytes > kLeastSlotBytes) {
    ring.slot_bytes = std::max(kLeastSlotBytes, ring.slot_bytes / 2 / kPieceAlign * kPieceAlign);  // whole pieces
  }
  if (!fits(ring)) {
    throw std::runtime_error("hca: the host staging does not fit in /dev/shm: " + std::to_string(world) +
                             " ranks need at least 2 slots of " + std::to_string(kLeastSlotBytes) + " bytes each (" +
                             mib(2 * kLeastSlotBytes * ranks) + "), and /dev/shm has " + mib(free_bytes) +
                             " free; enlarge it (docker run --shm-size, a Kubernetes emptyDir of medium Memory)");
  }
  if (ring.slots == asked.slots && ring.slot_bytes == asked.slot_bytes) return {ring, ""};
  return {ring, ring_text(ring) + " a rank, not the " + ring_text(asked) + " asked: " + std::to_string(world) +
                    " ranks' rings of those take " + mib(asked.bytes() * ranks) + " and /dev/shm has " +
                    mib(free_bytes) + " free (docker run --shm-size enlarges it)"};
}

FittedRing agree_host_ring(Rendezvous& rendezvous, const std::string& topic, int rank, int world, RingLayout asked,
                           std::chrono::milliseconds timeout) {
  std::string mine = "-";  // only rank 0's report counts: every rank sees one /dev/shm, at different moments
  if (rank == 0) {
    try {
      // No /dev/shm to ask: the segment's creation says what fails.
      const auto space = dev_shm_space_now();
      const FittedRing fitted = fit_ring(asked, world, space ? space->free : SIZE_MAX);
      mine = "+" + std::to_string(fitted.ring.slot_bytes) + " " + std::to_string(fitted.ring.slots) + " " + fitted.note;
      if (!fitted.note.empty()) std::fprintf(stderr, "hca: warning: the host staging has %s\n", fitted.note.c_str());
    } catch (const std::runtime_error& e) {
      mine = std::string("!") + e.what();
    }
  }
  const std::string chosen = exchange_reports(rendezvous, topic, rank, world, mine, timeout)[0];
  if (chosen[0] == '!') throw std::runtime_error(chosen.substr(1));
  FittedRing fitted{asked, ""};
  size_t used = 0;
  std::sscanf(chosen.c_str() + 1, "%zu %d %zn", &fitted.ring.slot_bytes, &fitted.ring.slots, &used);
  fitted.note = chosen.substr(1 + used);
  return fitted;
}

}  // namespace hca
