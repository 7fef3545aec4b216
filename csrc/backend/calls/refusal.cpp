#include "refusal.hpp"

namespace hca {

RefusalScope& refusal_scope() {
  thread_local RefusalScope scope;
  return scope;
}

}  // namespace hca
