# What `pip install .` puts in site-packages (scikit-build-core installs into the wheel's platlib):
#
#   shardcast/__init__.py, _*.py              pure Python, copied by scikit-build-core (wheel.packages)
#   shardcast/_shardcast.<soabi>.so           the extension
#   shardcast/bin/shardcast                   the command; the `shardcast` console script
#                                             (shardcast._cli:main) execs it
#
# Both link the torch wheel's libtorch. They find it with no LD_LIBRARY_PATH through their RUNPATH:
#   1. relative to the package, for the usual layout where shardcast and torch are siblings in one
#      site-packages:   $ORIGIN/../torch/lib  (the extension)   $ORIGIN/../../torch/lib  (the command)
#      and the same for the NCCL wheel's library in CUDA builds;
#   2. then the same directories as absolute paths (and the CUDA runtime's, in CUDA builds): the torch
#      that pip built against, which is the installed one with --no-build-isolation, even where the
#      package lands in another site directory than torch (a venv layered over another one).

set(_shardcast_runtime_lib_dirs ${SHARDCAST_SITE_PACKAGES}/torch/lib)
set(_shardcast_absolute_lib_dirs ${SHARDCAST_SITE_PACKAGES}/torch/lib)
if(SHARDCAST_HAVE_CUDA)
  get_filename_component(_nccl_dir ${SHARDCAST_NCCL_LIBRARY} DIRECTORY)
  list(APPEND _shardcast_runtime_lib_dirs ${_nccl_dir})
  list(APPEND _shardcast_absolute_lib_dirs ${_nccl_dir} ${CUDAToolkit_LIBRARY_DIR})
endif()

# shardcast_relative_rpath(<out-var> <install dir relative to site-packages>)
function(shardcast_relative_rpath out where)
  set(_rpath)
  foreach(_dir ${_shardcast_runtime_lib_dirs})
    string(FIND "${_dir}/" "${SHARDCAST_SITE_PACKAGES}/" _at)
    if(_at EQUAL 0)   # inside torch's site-packages: relative, so the install stays relocatable
      file(RELATIVE_PATH _rel ${SHARDCAST_SITE_PACKAGES}/${where} ${_dir})
      list(APPEND _rpath "$ORIGIN/${_rel}")
    endif()
  endforeach()
  set(${out} ${_rpath} ${_shardcast_absolute_lib_dirs} PARENT_SCOPE)
endfunction()

shardcast_relative_rpath(_ext_rpath shardcast)
shardcast_relative_rpath(_bin_rpath shardcast/bin)
set_target_properties(_shardcast PROPERTIES INSTALL_RPATH "${_ext_rpath}")
set_target_properties(shardcast PROPERTIES INSTALL_RPATH "${_bin_rpath}")

if(SKBUILD)
  install(TARGETS _shardcast LIBRARY DESTINATION shardcast)
  install(TARGETS shardcast RUNTIME DESTINATION shardcast/bin)
endif()
