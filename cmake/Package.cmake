# shardcast for C++ programs outside this tree: `cmake --install build --prefix P` (not the pip build,
# whose install rules are cmake/Install.cmake's) puts
#
#   P/include/shardcast/...      the public headers (cmake/PublicApi.cmake), nothing internal
#   P/lib/libshardcast.so        the runtime, loaders and allocators in one shared library. Their own
#                                dependencies (xxHash, simdjson, and the CUDA runtime and NCCL in CUDA builds)
#                                are its private DT_NEEDED entries (mimalloc is opened at run time), so a
#                                program links shardcast and torch, nothing else
#   P/lib/cmake/shardcast/       find_package(shardcast) gives the target shardcast::shardcast
#
# The prefix is relocatable (the config finds everything relative to itself). A program finds torch as any
# libtorch program does, with torch.utils.cmake_prefix_path on CMAKE_PREFIX_PATH; the config refuses a torch
# of another release than the one shardcast was built against, because libtorch's C++ ABI changes between
# releases. tests/api/install_consumer.sh builds tests/api/consumer.cc against an installed, moved prefix.
if(SKBUILD)
  return()
endif()
if(CMAKE_VERSION VERSION_LESS 3.24)
  message(STATUS "shardcast: CMake ${CMAKE_VERSION} < 3.24: no C++ install (it needs $<LINK_LIBRARY:WHOLE_ARCHIVE>)")
  return()
endif()
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Every object of the static libraries goes into the shared one (whole archive): a program may use
# any API function, not only those the static link of some tool happened to pull in.
set(_shardcast_archives shardcast_runtime shardcast_engine shardcast_materialize shardcast_comm shardcast_core
    shardcast_stream shardcast_manifest shardcast_options shardcast_agree shardcast_layout
    shardcast_allocators_torch shardcast_loaders shardcast_allocators)  # users first
file(CONFIGURE OUTPUT ${PROJECT_BINARY_DIR}/generated/shardcast_shared.cc
  CONTENT "// libshardcast.so is its static libraries, whole (cmake/Package.cmake).\n")
add_library(shardcast_shared SHARED ${PROJECT_BINARY_DIR}/generated/shardcast_shared.cc)
target_link_libraries(shardcast_shared
  PRIVATE "$<LINK_LIBRARY:WHOLE_ARCHIVE,${_shardcast_archives}>"
  PUBLIC "$<BUILD_INTERFACE:shardcast_torch_cpu>" "$<INSTALL_INTERFACE:shardcast::torch_cpu>")  # made by the config
foreach(_lib ${_shardcast_archives})
  # Each is also a dependency of the others, linked plainly; whole wins.
  set_property(TARGET shardcast_shared PROPERTY LINK_LIBRARY_OVERRIDE_${_lib} WHOLE_ARCHIVE)
endforeach()
target_include_directories(shardcast_shared INTERFACE
  $<BUILD_INTERFACE:${SHARDCAST_PUBLIC_INCLUDE_DIR}>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/shardcast>)
add_dependencies(shardcast_shared shardcast_public_headers)
# Installed, the library finds its torch (and the NCCL/CUDA libraries of a CUDA build) where it was built.
set_target_properties(shardcast_shared PROPERTIES
  OUTPUT_NAME shardcast EXPORT_NAME shardcast
  VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}
  INSTALL_RPATH "${_shardcast_absolute_lib_dirs}")

install(TARGETS shardcast_shared EXPORT shardcast-targets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
foreach(_h ${SHARDCAST_PUBLIC_HEADERS})
  get_filename_component(_dir ${_h} DIRECTORY)
  install(FILES ${SHARDCAST_ROOT}/${_h} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardcast/${_dir} COMPONENT dev)
endforeach()
set(_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/shardcast)
install(EXPORT shardcast-targets NAMESPACE shardcast:: DESTINATION ${_cmake_dir} COMPONENT dev)
configure_package_config_file(${SHARDCAST_ROOT}/cmake/shardcast-config.cmake.in
  ${PROJECT_BINARY_DIR}/generated/shardcast-config.cmake INSTALL_DESTINATION ${_cmake_dir})
# 0.x: a minor release may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/generated/shardcast-config-version.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/generated/shardcast-config.cmake
              ${PROJECT_BINARY_DIR}/generated/shardcast-config-version.cmake
  DESTINATION ${_cmake_dir} COMPONENT dev)
