#include "issue_order.hpp"

#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <utility>

namespace hca {
namespace {

struct Line {
  uint64_t next = 0;                 // the next ticket to give
  uint64_t served = 0;               // every ticket below it has passed
  std::set<uint64_t> early;          // tickets passed before an earlier one
  std::map<uint64_t, int> unpassed;  // shares of each ticket not passed yet
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

// The turn the calling thread is inside (IssueTicket::Held), if any.
thread_local const IssueTicket* held_turn = nullptr;

}  // namespace

IssueTicket::IssueTicket(const void* runtime, int device) : runtime_(runtime), device_(device) {
  Lines& all = lines();
  std::lock_guard<std::mutex> lock(all.mutex);
  Line& line = all.of_device[{runtime_, device_}];
  const IssueTicket* outer = held_turn;
  const bool share = outer && !outer->passed_ && outer->runtime_ == runtime_ && outer->device_ == device_;
  number_ = share ? outer->number_ : line.next++;
  ++line.unpassed[number_];
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
  Lines& all = lines();
  {
    std::lock_guard<std::mutex> lock(all.mutex);
    passed_ = true;  // under the lock: a call made in this turn on another thread reads it
    Line& line = all.of_device[{runtime_, device_}];
    const auto shares = line.unpassed.find(number_);
    if (--shares->second > 0) return;  // a call made in this turn has not issued yet
    line.unpassed.erase(shares);
    line.early.insert(number_);
    while (line.early.erase(line.served)) ++line.served;
  }
  all.changed.notify_all();
}

IssueTicket::Held::Held(const IssueTicket* ticket) : outer_(held_turn) {
  if (ticket) held_turn = ticket;
}

IssueTicket::Held::~Held() { held_turn = outer_; }

}  // namespace hca
