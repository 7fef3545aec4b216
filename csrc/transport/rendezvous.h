// What a transport needs from the process group's key-value store to set itself
// up. The c10d glue adapts c10d::Store to it; transports never see torch.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace hca {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists (within the store's timeout).
  virtual std::string get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether the key exists, without waiting.
  virtual bool has(const std::string& key) = 0;
};

// A rank that fails to set up publishes why under this key (the first cause
// only), so that ranks waiting for it raise that cause at once.
constexpr const char* kSetupFailedKey = "hca_setup_failed";
void publish_setup_failure(Rendezvous& rendezvous, int rank, const std::string& cause);
// Throws std::runtime_error with a peer's published setup failure, if any.
void check_setup_failure(Rendezvous& rendezvous);
// Polls `ready` every millisecond until it holds; throws a peer's published
// setup failure at once, and `what` + " within N ms" at the deadline.
void await_setup(Rendezvous& rendezvous, const std::function<bool()>& ready, std::chrono::milliseconds timeout,
                 const std::string& what);

// The key under which `rank` reports on `topic` (exchange_reports).
std::string report_key(const std::string& topic, int rank);
// Every rank's report on `topic` (`mine` on this rank), in rank order: e.g. each
// rank's node identity (equal identities share memory and devices) or its place
// on the node (CPU packages, NUMA nodes, GPU links). `check`, called while it
// waits, may throw to give up sooner (a peer known dead).
std::vector<std::string> exchange_reports(Rendezvous& rendezvous, const std::string& topic, int rank, int world,
                                          const std::string& mine, std::chrono::milliseconds timeout,
                                          const std::function<void()>& check = {});

}  // namespace hca
