// CUDA events as rendezvous tokens (backends/world/rendezvous.h): how both GPU transports order a
// collective after the work its members issued before it, and the members' later work after it.
//
// A token owns one event and destroys it when the last holder lets go; an event may be destroyed
// while work that records or waits on it is still pending. Not a general event pool.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "backends/world/rendezvous.h"
#include "gpu/check.h"

namespace tpsim::gpu {

// Records an event on `stream` (of `device`) capturing everything enqueued there so far.
inline world::TransportToken recordEvent(int device, cudaStream_t stream) {
  TPSIM_CUDA_CHECK(cudaSetDevice(device));
  cudaEvent_t event = nullptr;
  TPSIM_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  std::shared_ptr<CUevent_st> token(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
  TPSIM_CUDA_CHECK(cudaEventRecord(event, stream));
  return token;
}

inline cudaEvent_t eventOf(const world::TransportToken& token) { return static_cast<cudaEvent_t>(token.get()); }

// Makes `stream` (of `device`) wait for the work an event token captured; the host does not wait.
inline void streamWaitToken(int device, cudaStream_t stream, const world::TransportToken& token) {
  TPSIM_CUDA_CHECK(cudaSetDevice(device));
  TPSIM_CUDA_CHECK(cudaStreamWaitEvent(stream, eventOf(token), 0));
}

}  // namespace tpsim::gpu
