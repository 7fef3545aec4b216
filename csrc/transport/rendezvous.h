// What a transport needs from the process group's key-value store to set itself
// up. The c10d glue adapts c10d::Store to it; transports never see torch.
#pragma once
#include <cstdint>
#include <string>

namespace hca {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists (within the store's timeout).
  virtual std::string get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

}  // namespace hca
