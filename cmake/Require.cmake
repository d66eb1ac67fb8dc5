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

# pkg-config modules (xxHash ships no CMake config).
macro(shardcast_require_pkgconfig prefix module what debian)
  find_package(PkgConfig QUIET)
  if(NOT PKG_CONFIG_FOUND)
    shardcast_fail_missing(pkg-config pkg-config)
  endif()
  pkg_check_modules(${prefix} QUIET IMPORTED_TARGET ${module})
  if(NOT ${prefix}_FOUND)
    shardcast_fail_missing(${what} ${debian})
  endif()
endmacro()
