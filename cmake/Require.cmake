# shardcast_require(<package> DEBIAN <debian-package> [find_package args...])
#
# find_package(<package>) that fails with one line naming the Debian package to install, instead of
# CMake's backtrace through the package's config files. Any extra arguments go to find_package.
function(shardcast_fail_missing what debian)
  message(FATAL_ERROR "shardcast needs ${what}: apt install ${debian}\n"
                      "(tools/setup.sh installs every Debian package shardcast needs)")
endfunction()

macro(shardcast_require package)
  cmake_parse_arguments(_req "" "DEBIAN" "" ${ARGN})
  find_package(${package} ${_req_UNPARSED_ARGUMENTS} QUIET)
  if(NOT ${package}_FOUND)
    shardcast_fail_missing(${package} ${_req_DEBIAN})
  endif()
endmacro()

# pkg-config modules (xxHash ships no CMake config). Where pkg-config does not find the module, the
# header and library are looked for along CMAKE_PREFIX_PATH (a prefix of unpacked .deb files on a machine
# with no package mirror, tools/gpu_check.sh's SHARDCAST_DEB_DIR), giving the same PkgConfig::<prefix>.
macro(shardcast_require_pkgconfig prefix module what debian header library)
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(${prefix} QUIET IMPORTED_TARGET ${module})
  endif()
  if(NOT ${prefix}_FOUND)
    find_path(${prefix}_HEADER_DIR ${header})
    find_library(${prefix}_LIBRARY ${library})
    if(NOT ${prefix}_HEADER_DIR OR NOT ${prefix}_LIBRARY)
      shardcast_fail_missing(${what} ${debian})
    endif()
    add_library(PkgConfig::${prefix} UNKNOWN IMPORTED)
    set_target_properties(PkgConfig::${prefix} PROPERTIES IMPORTED_LOCATION ${${prefix}_LIBRARY}
                          INTERFACE_INCLUDE_DIRECTORIES ${${prefix}_HEADER_DIR})
    set(${prefix}_FOUND TRUE)
  endif()
endmacro()
