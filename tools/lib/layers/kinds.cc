#include "tools/lib/layers/kinds.h"

#include <algorithm>

namespace tpsim::tools {

InitMethod uninitialized() { return initMethodNormal(0.02); }

std::vector<std::pair<std::string, Parameter*>> present(std::vector<std::pair<std::string, Parameter*>> named) {
  named.erase(std::remove_if(named.begin(), named.end(), [](const auto& e) { return e.second == nullptr; }), named.end());
  return named;
}

}  // namespace tpsim::tools
