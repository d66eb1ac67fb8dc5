# Locates the Python whose torch we build against:
#   pip install (scikit-build-core): the interpreter running pip, always (its torch is the one the
#                                    installed package will import);
#   otherwise: SHARDCAST_PYTHON if given, else .venv/bin/python, else python3.
# The wheel's libtorch is the one users have, so it is the one we build against. A cached interpreter
# that no longer exists (a throwaway venv that configured this build dir) is picked again.
if(SKBUILD)
  set(SHARDCAST_PYTHON ${Python_EXECUTABLE} CACHE FILEPATH "Python interpreter whose torch we build against" FORCE)
elseif(NOT SHARDCAST_PYTHON OR NOT EXISTS "${SHARDCAST_PYTHON}")
  unset(SHARDCAST_PYTHON CACHE)
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python)
    set(SHARDCAST_PYTHON ${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python)
  else()
    find_program(SHARDCAST_PYTHON_FOUND python3)
    set(SHARDCAST_PYTHON ${SHARDCAST_PYTHON_FOUND})
  endif()
  set(SHARDCAST_PYTHON ${SHARDCAST_PYTHON} CACHE FILEPATH "Python interpreter whose torch we build against" FORCE)
endif()
if(NOT SHARDCAST_PYTHON)
  message(FATAL_ERROR "shardcast needs Python 3 with torch: apt install python3-venv, then run tools/setup.sh")
endif()
message(STATUS "shardcast: python ${SHARDCAST_PYTHON}")
