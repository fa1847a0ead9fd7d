# The compiler cache (ccache, installed by scripts/setup.sh). A second clean clone on the same
# machine then compiles nothing that an earlier build compiled, whatever folder it is cloned into:
#   - base_dir: absolute paths under the source folder become relative on the command line;
#   - the unity batches include their sources by relative paths (UNITY_BUILD_RELOCATABLE);
#   - only core/build_info.cpp carries the source folder's path (core/CMakeLists.txt);
#   - the precompiled header: ccache hashes the .gch it includes (sloppiness pch_defines and
#     time_macros, as ccache's manual asks for GCC's precompiled headers); a fresh clone's files
#     all have new mtimes, hence include_file_mtime/ctime.
# PARALLAX_CCACHE=OFF (or no ccache on PATH) compiles without it. `ccache -s` shows the hits.
option(PARALLAX_CCACHE "Compile through ccache when it is installed" ON)
if(PARALLAX_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(PARALLAX_CCACHE_EXE ccache)
  if(PARALLAX_CCACHE_EXE)
    set(_ccache_env
        "CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}"
        "CCACHE_NOHASHDIR=1"
        "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
        "CCACHE_COMPRESS=1")
    if(NOT DEFINED ENV{CCACHE_MAXSIZE})
      list(APPEND _ccache_env "CCACHE_MAXSIZE=12G")
    endif()
    set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env ${_ccache_env} ${PARALLAX_CCACHE_EXE})
    set(CMAKE_C_COMPILER_LAUNCHER ${CMAKE_CXX_COMPILER_LAUNCHER})
    if(NOT CMAKE_VERSION VERSION_LESS 3.32)
      set(CMAKE_UNITY_BUILD_RELOCATABLE ON)
    endif()
    message(STATUS "Parallax: compiling through ${PARALLAX_CCACHE_EXE}")
  endif()
endif()
