# Decides whether gpu/ (CUDA + cuBLASLt + NCCL) can be built, says why in one configure line, and
# sets TPSIM_HAVE_GPU (tpsim_config.h tells the tools). Included from the top-level CMakeLists.txt
# because enable_language(CUDA) must run in the directory that gpu/ and tests/ share. The CUDA
# toolkit and NCCL are not Debian packages; they are looked for where the toolkit installs them
# (/usr/local/cuda by default). This file builds nothing: gpu/CMakeLists.txt does.
set(_gpu_reason "")
if(TPSIM_GPU STREQUAL "OFF")
  set(_gpu_reason "TPSIM_GPU=OFF")
elseif(TPSIM_SANITIZE)
  # nvcc does not take -fsanitize, device code is not instrumented anyway (compute-sanitizer is the
  # tool for it), and ASan's shadow mapping collides with the CUDA driver's address reservations.
  # The sanitizer builds check the host code (fibers, world), which does not need the GPU.
  set(_gpu_reason "TPSIM_SANITIZE=${TPSIM_SANITIZE}: sanitizer builds leave out CUDA code")
else()
  # CMake 3.25's FindCUDAToolkit marks CUDA::nvToolsExt deprecated without checking that it exists
  # when the project requires CMake 3.25 or later: a hard error with CUDA 13, which has no
  # nvToolsExt. The variable decides nothing else there, so the search sees an older minimum.
  set(_gpu_cmake_minimum "${CMAKE_MINIMUM_REQUIRED_VERSION}")
  set(CMAKE_MINIMUM_REQUIRED_VERSION 3.24)
  find_package(CUDAToolkit QUIET)
  set(CMAKE_MINIMUM_REQUIRED_VERSION "${_gpu_cmake_minimum}")
  if(NOT CUDAToolkit_FOUND)
    set(_gpu_reason "CUDA toolkit not found (set CUDAToolkit_ROOT)")
  else()
    find_path(NCCL_INCLUDE_DIR nccl.h
              HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT}
              PATH_SUFFIXES include)
    find_library(NCCL_LIBRARY nccl
                 HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}
                 PATH_SUFFIXES lib lib64)
    if(NOT EXISTS "${NCCL_INCLUDE_DIR}/nccl.h" OR NOT NCCL_LIBRARY)
      set(_gpu_reason "CUDA ${CUDAToolkit_VERSION} found but NCCL not found (set NCCL_ROOT)")
    elseif(NOT TARGET CUDA::cublasLt)
      set(_gpu_reason "CUDA ${CUDAToolkit_VERSION} found but cuBLASLt not found")
    else()
      file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_defines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
      foreach(_part MAJOR MINOR PATCH)
        string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _match "${_nccl_defines}")
        set(_nccl_${_part} "${CMAKE_MATCH_1}")
      endforeach()
      set(TPSIM_NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
      # ncclAlltoAll (the allToAll of gpu/nccl_transport.cc) first shipped in NCCL 2.28.3.
      if(TPSIM_NCCL_VERSION VERSION_LESS 2.28.3)
        string(CONCAT _gpu_reason "NCCL ${TPSIM_NCCL_VERSION} found at ${NCCL_INCLUDE_DIR}, but ncclAlltoAll needs "
                                  "NCCL 2.28.3 or later (set NCCL_ROOT)")
      endif()
    endif()
  endif()
endif()

if(_gpu_reason STREQUAL "")
  # The toolkit's own nvcc, and the C++ compiler of the rest of the project as its host compiler
  # (one ABI). check_language reads both from the environment, so they go there unless set.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    set(ENV{CUDACXX} "${CUDAToolkit_NVCC_EXECUTABLE}")
  endif()
  if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER AND NOT DEFINED ENV{CUDAHOSTCXX})
    set(ENV{CUDAHOSTCXX} "${CMAKE_CXX_COMPILER}")
  endif()
  set(_gpu_host "$ENV{CUDAHOSTCXX}")
  if(DEFINED CMAKE_CUDA_HOST_COMPILER)
    set(_gpu_host "${CMAKE_CUDA_HOST_COMPILER}")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    string(CONCAT _gpu_reason "CUDA ${CUDAToolkit_VERSION} found but nvcc cannot compile with host compiler "
                              "${_gpu_host} (see CMakeFiles/CMakeError.log; set CMAKE_CUDA_HOST_COMPILER)")
  endif()
endif()

if(_gpu_reason STREQUAL "")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    # 90-real: sm_90 machine code for the H100/H200, the GPUs tpsim is checked on.
    # 90-virtual: compute_90 PTX as well, which the driver JIT-compiles for newer GPUs.
    set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual" CACHE STRING "tpsim: CUDA architectures to build")
  endif()
  enable_language(CUDA)
  target_compile_features(tpsim_options INTERFACE cuda_std_17)
  # --fmad=false: no multiply-add contraction in device code, so elementwise kernels round exactly
  # as the host code that shares their element math (backends/element_math.h); the host half of
  # each .cu file gets the same rule and the project's warnings.
  target_compile_options(
    tpsim_options INTERFACE
    "$<$<COMPILE_LANGUAGE:CUDA>:--fmad=false;-Xcompiler=-ffp-contract=off,-Wall,-Wextra,-Wundef>"
    "$<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${TPSIM_WERROR}>>:-Werror=all-warnings;-Xcompiler=-Werror>")

  add_library(tpsim::nccl UNKNOWN IMPORTED GLOBAL)
  set_target_properties(tpsim::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                               INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")

  set(TPSIM_HAVE_GPU ON)
  message(STATUS "tpsim: gpu backend ON (CUDA ${CUDAToolkit_VERSION_MAJOR}.${CUDAToolkit_VERSION_MINOR}, "
                 "NCCL ${TPSIM_NCCL_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
else()
  set(TPSIM_HAVE_GPU OFF)
  if(TPSIM_GPU STREQUAL "ON")
    message(FATAL_ERROR "tpsim: TPSIM_GPU=ON but the gpu backend cannot be built: ${_gpu_reason}")
  endif()
  message(STATUS "tpsim: gpu backend OFF (${_gpu_reason})")
endif()
