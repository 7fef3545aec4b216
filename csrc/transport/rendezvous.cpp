#include "rendezvous.h"

#include <chrono>
#include <stdexcept>
#include <thread>

#include "control/wait.h"

namespace hca {

void publish_setup_failure(Rendezvous& rendezvous, int rank, const std::string& cause) {
  if (rendezvous.add(std::string(kSetupFailedKey) + "_count", 1) == 1) {
    rendezvous.set(kSetupFailedKey, "rank " + std::to_string(rank) + " failed to set up the process group: " + cause);
  }
}

void check_setup_failure(Rendezvous& rendezvous) {
  if (rendezvous.has(kSetupFailedKey)) throw std::runtime_error("hca: " + rendezvous.get(kSetupFailedKey));
}

void await_setup(Rendezvous& rendezvous, const std::function<bool()>& ready, std::chrono::milliseconds timeout,
                 const std::string& what) {
  const auto deadline = deadline_after(timeout);
  while (!ready()) {
    check_setup_failure(rendezvous);
    if (Clock::now() > deadline) {
      throw std::runtime_error(what + " within " + std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string report_key(const std::string& topic, int rank) { return "hca_" + topic + "/" + std::to_string(rank); }

std::vector<std::string> exchange_reports(Rendezvous& rendezvous, const std::string& topic, int rank, int world,
                                          const std::string& mine, std::chrono::milliseconds timeout,
                                          const std::function<void()>& check) {
  rendezvous.set(report_key(topic, rank), mine);
  std::vector<std::string> identities;
  for (int r = 0; r < world; ++r) {
    const std::string key = report_key(topic, r);
    await_setup(
        rendezvous,
        [&] {
          if (rendezvous.has(key)) return true;
          if (check) check();
          return false;
        },
        timeout, "hca: rank " + std::to_string(r) + " did not report its " + topic);
    identities.push_back(rendezvous.get(key));
  }
  return identities;
}

}  // namespace hca
