# Finds the PyTorch wheel's libtorch through torch.utils.cmake_prefix_path.
execute_process(
  COMMAND ${SHARDCAST_PYTHON} -c "import torch,os;print(torch.utils.cmake_prefix_path);print(torch.__version__);print(os.path.dirname(os.path.dirname(torch.__file__)));print(torch.version.cuda or 'none')"
  OUTPUT_VARIABLE _torch_out ERROR_VARIABLE _torch_err RESULT_VARIABLE _torch_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "shardcast needs torch in the Python it builds for: ${SHARDCAST_PYTHON} cannot import it.\n"
                      "pip install torch (>= 2.6) into that environment first (tools/setup.sh does, for .venv), "
                      "or pass -DSHARDCAST_PYTHON=/path/to/python of an environment that has it.")
endif()
string(REPLACE "\n" ";" _torch_out "${_torch_out}")
list(GET _torch_out 0 _torch_prefix)
list(GET _torch_out 1 SHARDCAST_TORCH_VERSION)
list(GET _torch_out 2 SHARDCAST_SITE_PACKAGES)
list(GET _torch_out 3 SHARDCAST_TORCH_CUDA)   # the CUDA the wheel was built for, or "none"
list(APPEND CMAKE_PREFIX_PATH ${_torch_prefix})
set(SHARDCAST_TORCH_CMAKE_PREFIX ${_torch_prefix})   # recorded in the installed shardcast-config.cmake

# The wheel's libtorch_cuda needs the NCCL/CUDA libraries of the nvidia-* wheels, which are newer than
# the system toolkit's; point the linker at them (the loader finds them through libtorch's own RPATH).
file(GLOB SHARDCAST_NVIDIA_LIB_DIRS LIST_DIRECTORIES true ${SHARDCAST_SITE_PACKAGES}/nvidia/*/lib ${SHARDCAST_SITE_PACKAGES}/nvidia/cu*/lib)
foreach(_d ${SHARDCAST_NVIDIA_LIB_DIRS})
  add_link_options("LINKER:-rpath-link,${_d}")
endforeach()

# TorchConfig probes CUDA for CUDA wheels; keep its chatter but not its failure when no toolkit exists.
find_package(Torch REQUIRED)
message(STATUS "shardcast: torch ${SHARDCAST_TORCH_VERSION} from ${_torch_prefix}")
# torch <= 2.6 wheels are built with the pre-C++11 libstdc++ ABI (TorchConfig puts
# -D_GLIBCXX_USE_CXX11_ABI=0 in TORCH_CXX_FLAGS, on the `torch` target only): every object that passes a
# std::string to libtorch, or to another of our libraries, must use the same one.
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=0)
  message(STATUS "shardcast: torch ${SHARDCAST_TORCH_VERSION} uses the pre-C++11 std::string ABI; building everything with it")
  if(SHARDCAST_BUILD_TESTS OR SHARDCAST_BUILD_BENCH)
    message(WARNING "shardcast: Debian's GoogleTest and Google Benchmark use the C++11 ABI, which this torch "
                    "does not: building without the C++ tests and micro-benchmarks")
    set(SHARDCAST_BUILD_TESTS OFF)
    set(SHARDCAST_BUILD_BENCH OFF)
  endif()
endif()
if(SHARDCAST_TORCH_VERSION VERSION_LESS 2.4)
  message(FATAL_ERROR "shardcast needs torch >= 2.4, found ${SHARDCAST_TORCH_VERSION} in ${SHARDCAST_PYTHON}")
elseif(SHARDCAST_TORCH_VERSION VERSION_LESS 2.6)
  message(WARNING "shardcast: torch ${SHARDCAST_TORCH_VERSION} is older than the tested range (2.6, whose "
                  "torch.distributed.fsdp.fully_shard is public, to 2.15): the command line may work, the "
                  "Python API's FSDP2 flow is untested")
endif()

# Gloo's headers are not in the wheel; ProcessGroupGloo.hpp only holds gloo types by shared_ptr, so the
# system's gloo headers declare them without touching the layout of anything we construct.
find_path(SHARDCAST_GLOO_INCLUDE gloo/algorithm.h PATHS /usr/include /usr/local/include)
if(NOT SHARDCAST_GLOO_INCLUDE)
  shardcast_fail_missing("gloo's headers (the torch wheel ships none)" libgloo-dev)
endif()

# One interface target for "the CPU part of libtorch".
add_library(shardcast_torch_cpu INTERFACE)
target_link_libraries(shardcast_torch_cpu INTERFACE torch_cpu c10)
target_include_directories(shardcast_torch_cpu SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS} ${SHARDCAST_GLOO_INCLUDE})
target_compile_definitions(shardcast_torch_cpu INTERFACE USE_C10D_GLOO)
# shardcast's own code is C++17; targets that include torch headers take the standard the found torch
# demands (torch >= 2.10 declares cxx_std_20 on its `torch` target, older wheels cxx_std_17).
get_target_property(_torch_features torch INTERFACE_COMPILE_FEATURES)
if(_torch_features)
  target_compile_features(shardcast_torch_cpu INTERFACE ${_torch_features})
endif()
