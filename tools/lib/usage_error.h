// The error of a bad command-line argument, thrown by the host library where an argument is
// checked (a backend name, a world the backend cannot run) as well as by the CLI's parsers.
#pragma once

#include <string>

namespace tpsim::tools {

// A bad command line: main prints one line plus "Try 'tpsim --help'" and exits 2.
struct UsageError {
  std::string message;
};

}  // namespace tpsim::tools
