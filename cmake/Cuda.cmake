# CUDA/NCCL host code (pinned staging, device copies, NCCL communicator) is built wherever the toolkit is
# found, so CI compiles and links it; it runs only where a GPU is present.
set(SHARDCAST_HAVE_CUDA 0)
if(NOT SHARDCAST_CUDA STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  # NCCL: prefer the nvidia-nccl wheel's library, the one libtorch_cuda itself loads, so that one process
  # never holds two NCCLs.
  find_path(SHARDCAST_NCCL_INCLUDE nccl.h
    PATHS ${SHARDCAST_SITE_PACKAGES}/nvidia/nccl/include ${SHARDCAST_SITE_PACKAGES}/nvidia/cu13/include
          ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include NO_DEFAULT_PATH)
  find_library(SHARDCAST_NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR
    PATHS ${SHARDCAST_SITE_PACKAGES}/nvidia/nccl/lib ${SHARDCAST_SITE_PACKAGES}/nvidia/cu13/lib
          ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64 NO_DEFAULT_PATH)
  # A toolkit of another CUDA major than the wheel's (a cu124 torch on a CUDA 13 machine) would put two
  # CUDA runtimes in one process: AUTO builds without CUDA then, ON stops.
  set(_cuda_mismatch "")
  if(CUDAToolkit_FOUND AND NOT SHARDCAST_TORCH_CUDA STREQUAL "none")
    string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${SHARDCAST_TORCH_CUDA}")
    if(NOT _torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
      set(_cuda_mismatch "torch ${SHARDCAST_TORCH_VERSION} is built for CUDA ${SHARDCAST_TORCH_CUDA}, the toolkit is ${CUDAToolkit_VERSION}")
    endif()
  endif()
  if(_cuda_mismatch)
    if(SHARDCAST_CUDA STREQUAL "ON")
      message(FATAL_ERROR "shardcast: SHARDCAST_CUDA=ON but ${_cuda_mismatch}: point CUDAToolkit_ROOT at a CUDA ${SHARDCAST_TORCH_CUDA} toolkit")
    endif()
    message(STATUS "shardcast: building without CUDA (${_cuda_mismatch})")
  elseif(CUDAToolkit_FOUND AND TARGET torch_cuda AND SHARDCAST_NCCL_INCLUDE AND SHARDCAST_NCCL_LIBRARY)
    set(SHARDCAST_HAVE_CUDA 1)
    add_library(shardcast_cuda_deps INTERFACE)
    target_link_libraries(shardcast_cuda_deps INTERFACE torch_cuda c10_cuda CUDA::cudart ${SHARDCAST_NCCL_LIBRARY})
    target_include_directories(shardcast_cuda_deps SYSTEM INTERFACE ${SHARDCAST_NCCL_INCLUDE} ${CUDAToolkit_INCLUDE_DIRS})
    message(STATUS "shardcast: CUDA ${CUDAToolkit_VERSION}, NCCL ${SHARDCAST_NCCL_LIBRARY}")
  elseif(SHARDCAST_CUDA STREQUAL "ON")
    message(FATAL_ERROR "shardcast: SHARDCAST_CUDA=ON but CUDA toolkit / torch_cuda / NCCL not found")
  else()
    message(STATUS "shardcast: building without CUDA (toolkit, torch_cuda or NCCL not found)")
  endif()
endif()
