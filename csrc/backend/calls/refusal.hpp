// A collective that hca refuses at the call on one rank (bad input: ValueError, TypeError)
// while its peers make theirs would leave them waiting for that rank until the timeout
// (30 minutes by default), as NCCL and gloo leave them. So the refusal takes the call's
// turn among the group's collectives instead, through the backend's own check that
// ranks call alike (the control block's signatures, or the engines' agreement): peers
// that made the call as it should be fail at once, naming the refusal, and where every
// rank refused the same, the refusals match and the group stays usable.
#pragma once
#include <c10/util/Exception.h>

#include <string>

namespace hca {

// This thread's public call, from its first check until it is handed on (`refused_at_the_call`).
struct RefusalScope {
  bool open = false;  // a backend's call is under way (a group across nodes calls its node's group inside its own)
  bool handed_on = false;
};
RefusalScope& refusal_scope();

// Says that this thread's call has been handed on (counted, queued): an error after this is
// not a refusal at the call, and every rank may raise it (an all-to-all's split sizes, exchanged).
inline void mark_handed_on() { refusal_scope().handed_on = true; }

// `call()`; where it raises ValueError or TypeError before it is handed on, `refuse(why)` takes
// its turn first (the outermost backend's, once). `refuse` must not throw.
template <typename Refuse, typename Call>
auto refused_at_the_call(Refuse&& refuse, Call&& call) -> decltype(call()) {
  RefusalScope& scope = refusal_scope();
  if (scope.open) return call();
  struct Open {
    RefusalScope& scope;
    explicit Open(RefusalScope& s) : scope(s) { scope = {true, false}; }
    ~Open() { scope.open = false; }
  } open(scope);
  try {
    return call();
  } catch (const c10::ValueError& e) {
    if (!scope.handed_on) refuse(std::string(e.what_without_backtrace()));
    throw;
  } catch (const c10::TypeError& e) {
    if (!scope.handed_on) refuse(std::string(e.what_without_backtrace()));
    throw;
  }
}

// What a refusal says in place of the call: "refused at the call: <why>".
inline std::string refusal_text(const std::string& why) { return "refused at the call: " + why; }

}  // namespace hca
