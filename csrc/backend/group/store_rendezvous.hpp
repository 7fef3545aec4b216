// Adapts the process group's c10d::Store to the transports' Rendezvous.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "../../transport/rendezvous.h"

namespace hca {

class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    const auto bytes = store_->get(key);
    return std::string(bytes.begin(), bytes.end());
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  bool has(const std::string& key) override { return store_->check({key}); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace hca
