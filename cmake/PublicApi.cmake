# shardcast's C++ API: the headers a program outside this tree may include, and the target it links.
#
# The API is load.h, save.h and their options, the communicator (and its c10d constructor) and the
# materializer; the list below is those and every header they include, nothing else. The stream, the
# agreement, the manifest and its wire format, the routes and sinks stay internal: a change to them
# never changes what a user compiles against.
#
# The listed headers are copied, at build time, into ${SHARDCAST_PUBLIC_INCLUDE_DIR} (same relative
# paths: "runtime/load.h"), and shardcast::shardcast puts only that directory on its users' include
# path. Code in this tree sees the whole tree instead (the top-level include_directories), so none of
# its -I flags change. tests/api/ compiles each API header with the public directory alone, so an
# internal header that an API header starts to include fails the build, and checks that
# runtime/engine/stream.h cannot be reached from there.
set(SHARDCAST_PUBLIC_HEADERS
  runtime/load.h
  runtime/save.h
  runtime/load_options.h
  runtime/agree/communicator.h
  runtime/comm/c10d_communicator.h
  runtime/materialize/materializer.h
  # what they include
  runtime/manifest/key_mapping.h
  runtime/stream/progress.h
  runtime/layout/target.h
  runtime/layout/plan.h
  runtime/layout/layout.h
  runtime/layout/layout_inl.h
  loaders/model_spec.h
  loaders/key_index.h
  loaders/quant/dequant.h
  loaders/quant/block_size.h
  loaders/dtype.h
  allocators/error.h
  allocators/memory_probe.h
  allocators/lazy_zero.h
)
# The headers a program includes first (the others come with them); tests/api/ compiles each alone.
set(SHARDCAST_API_HEADERS
  runtime/load.h runtime/save.h runtime/load_options.h
  runtime/agree/communicator.h runtime/comm/c10d_communicator.h runtime/materialize/materializer.h)
set(SHARDCAST_PUBLIC_INCLUDE_DIR ${CMAKE_BINARY_DIR}/include/shardcast)
# Made anew at each configure: a header that left the list (or moved) must not linger there, where the
# API checks of tests/api/ would still find it.
file(REMOVE_RECURSE ${SHARDCAST_PUBLIC_INCLUDE_DIR})

set(_copies)
foreach(_h ${SHARDCAST_PUBLIC_HEADERS})
  add_custom_command(OUTPUT ${SHARDCAST_PUBLIC_INCLUDE_DIR}/${_h}
    COMMAND ${CMAKE_COMMAND} -E copy_if_different ${SHARDCAST_ROOT}/${_h} ${SHARDCAST_PUBLIC_INCLUDE_DIR}/${_h}
    DEPENDS ${SHARDCAST_ROOT}/${_h}
    COMMENT "" VERBATIM)
  list(APPEND _copies ${SHARDCAST_PUBLIC_INCLUDE_DIR}/${_h})
endforeach()
add_custom_target(shardcast_public_headers ALL DEPENDS ${_copies})

# What a program links: the runtime (and through it the loaders, the allocators and libtorch's CPU
# part), with the public headers, and only them, on its include path.
add_library(shardcast_api INTERFACE)
add_library(shardcast::shardcast ALIAS shardcast_api)
target_link_libraries(shardcast_api INTERFACE shardcast_runtime)
target_include_directories(shardcast_api INTERFACE
  $<BUILD_INTERFACE:${SHARDCAST_PUBLIC_INCLUDE_DIR}>
  $<INSTALL_INTERFACE:include/shardcast>)
add_dependencies(shardcast_api shardcast_public_headers)
