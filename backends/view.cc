#include "backends/view.h"

namespace tpsim {

const char* deviceName(Device device) { return device == Device::kHost ? "host" : "cuda"; }

}  // namespace tpsim
