// Checks that turn a failed CUDA, cuBLASLt or NCCL call into tpsim::BackendError.
//
// The message names the call as written, the error's name and description, and file:line:
//   cudaMallocAsync(&p, bytes, stream_) failed: cudaErrorMemoryAllocation (out of memory) at gpu/...:42
// TPSIM_CUDA_CHECK_LAUNCH follows every kernel launch (launch errors surface only through
// cudaGetLastError). These macros never exit() and never hang; waiting is GpuCompute's business.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "backends/errors.h"

namespace tpsim::gpu::detail {

[[noreturn]] inline void throwFailure(const char* call, const char* name, const char* what, const char* file,
                                      int line) {
  throw BackendError(::tpsim::detail::concat(call, " failed: ", name, " (", what, ") at ", file, ":", line));
}

inline const char* ncclResultName(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult (unknown)";
  }
}

}  // namespace tpsim::gpu::detail

// A failed call also sets the thread's last error; it is cleared here so that the next
// TPSIM_CUDA_CHECK_LAUNCH does not report it again as a launch failure.
#define TPSIM_CUDA_CHECK(call)                                                                        \
  do {                                                                                                \
    const cudaError_t tpsim_err_ = (call);                                                            \
    if (tpsim_err_ != cudaSuccess) {                                                                  \
      cudaGetLastError();                                                                             \
      ::tpsim::gpu::detail::throwFailure(#call, cudaGetErrorName(tpsim_err_), cudaGetErrorString(tpsim_err_), \
                                         __FILE__, __LINE__);                                         \
    }                                                                                                 \
  } while (0)

// After a <<<...>>> launch: `what` names the kernel (a string), e.g. TPSIM_CUDA_CHECK_LAUNCH("axpy").
#define TPSIM_CUDA_CHECK_LAUNCH(what)                                                                 \
  do {                                                                                                \
    const cudaError_t tpsim_err_ = cudaGetLastError();                                                \
    if (tpsim_err_ != cudaSuccess)                                                                    \
      ::tpsim::gpu::detail::throwFailure(::tpsim::detail::concat("kernel launch (", what, ")").c_str(), \
                                         cudaGetErrorName(tpsim_err_), cudaGetErrorString(tpsim_err_), \
                                         __FILE__, __LINE__);                                         \
  } while (0)

#define TPSIM_CUBLAS_CHECK(call)                                                                      \
  do {                                                                                                \
    const cublasStatus_t tpsim_status_ = (call);                                                      \
    if (tpsim_status_ != CUBLAS_STATUS_SUCCESS)                                                       \
      ::tpsim::gpu::detail::throwFailure(#call, cublasLtGetStatusName(tpsim_status_),                 \
                                         cublasLtGetStatusString(tpsim_status_), __FILE__, __LINE__); \
  } while (0)

#define TPSIM_NCCL_CHECK(call)                                                                        \
  do {                                                                                                \
    const ncclResult_t tpsim_result_ = (call);                                                        \
    if (tpsim_result_ != ncclSuccess)                                                                 \
      ::tpsim::gpu::detail::throwFailure(#call, ::tpsim::gpu::detail::ncclResultName(tpsim_result_),  \
                                         ncclGetErrorString(tpsim_result_), __FILE__, __LINE__);      \
  } while (0)
