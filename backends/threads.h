// Starting a group of threads without std::terminate when the system refuses one.
//
// A std::thread the system cannot create throws std::system_error; one already started and then
// destroyed while joinable calls std::terminate. startThreads starts every thread of a group held at
// a gate, so that no body runs (and none waits for a peer that never came) until all exist.
#pragma once

#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace tpsim {

// `count` threads, thread i running body(i) once all have started. If the system refuses one (a
// thread limit, no memory for a stack), no body runs, the started threads are joined, and
// InvalidArgument says how many of `what` started and why, so that a caller asking for more threads
// than the machine has fails cleanly. The caller joins (or detaches) what it gets back.
std::vector<std::thread> startThreads(int count, std::function<void(int)> body, const std::string& what);

}  // namespace tpsim
