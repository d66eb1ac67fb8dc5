# Locates the project's Python: SHARDCAST_PYTHON if given, else .venv/bin/python, else python3.
# The wheel's libtorch is the one users have, so it is the one we build against.
if(NOT SHARDCAST_PYTHON)
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python)
    set(SHARDCAST_PYTHON ${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python)
  else()
    find_program(SHARDCAST_PYTHON python3)
  endif()
endif()
set(SHARDCAST_PYTHON ${SHARDCAST_PYTHON} CACHE FILEPATH "Python interpreter whose torch we build against")
message(STATUS "shardcast: python ${SHARDCAST_PYTHON}")
