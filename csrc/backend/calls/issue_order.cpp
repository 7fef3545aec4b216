#include "issue_order.hpp"

#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <utility>

namespace hca {
namespace {

struct Line {
  uint64_t next = 0;        // the next ticket to give
  uint64_t served = 0;      // every ticket below it has passed
  std::set<uint64_t> early;  // tickets passed before an earlier one
};

struct Lines {
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::pair<const void*, int>, Line> of_device;
};

Lines& lines() {
  static auto* shared = new Lines();  // never destroyed: workers may pass tickets at exit
  return *shared;
}

}  // namespace

IssueTicket::IssueTicket(const void* runtime, int device) : runtime_(runtime), device_(device) {
  Lines& all = lines();
  std::lock_guard<std::mutex> lock(all.mutex);
  number_ = all.of_device[{runtime_, device_}].next++;
}

IssueTicket::~IssueTicket() { pass(); }

void IssueTicket::await() const {
  Lines& all = lines();
  std::unique_lock<std::mutex> lock(all.mutex);
  const Line& line = all.of_device[{runtime_, device_}];
  all.changed.wait(lock, [&] { return line.served == number_; });
}

void IssueTicket::pass() {
  if (passed_) return;
  passed_ = true;
  Lines& all = lines();
  {
    std::lock_guard<std::mutex> lock(all.mutex);
    Line& line = all.of_device[{runtime_, device_}];
    line.early.insert(number_);
    while (line.early.erase(line.served)) ++line.served;
  }
  all.changed.notify_all();
}

}  // namespace hca
