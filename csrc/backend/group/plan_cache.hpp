// Plans and signatures of recent calls, by what determines them (the call's
// kind, tensors, op and root): a loop that repeats its shapes skips planning
// and the formatting of the signature text.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../../plan/plan.h"

namespace hca {

class PlanCache {
 public:
  struct Entry {
    std::shared_ptr<const std::vector<PackPlan>> plan;
    std::string signature;
  };
  // The entry for `key`, made by `make` on a miss; a full cache starts over.
  Entry get(const std::string& key, const std::function<Entry()>& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it != entries_.end()) return it->second;
    if (entries_.size() >= kCapacity) entries_.clear();
    return entries_.emplace(key, make()).first->second;
  }

 private:
  static constexpr size_t kCapacity = 256;
  std::mutex mutex_;
  std::unordered_map<std::string, Entry> entries_;
};

}  // namespace hca
