# Helpers that give every layer the same shape: one library per folder, one PCH for LibTorch, and
# GoogleTest executables registered with ctest (plain, or under mpirun with the `mpi` label).

include(GoogleTest)

# Unity builds: each target's sources are compiled as batches of up to 16 files in one translation
# unit. Every translation unit pays for loading the LibTorch PCH (~0.7 GB, ~5 s of the 2-core CI
# machine) and instantiates the same fmt/ATen templates; batching cut a clean build's compile time
# to about half (docs/building.md). Names in anonymous namespaces must therefore be unique within a
# folder's target. Files with CUDA-only code (nccl_communicator.cpp, kernels/, train/cuda_graph.cpp)
# stay out of the batches: a CPU build cannot see their CUDA halves' names. OFF compiles file by
# file: quicker incremental rebuilds while editing.
option(PARALLAX_UNITY "Compile each target's sources in unity batches (clean builds ~2x faster)" ON)
if(PARALLAX_UNITY)
  set(CMAKE_UNITY_BUILD ON)
  set(CMAKE_UNITY_BUILD_BATCH_SIZE 16)
endif()

option(PARALLAX_PCH "Precompile LibTorch's headers once and reuse them in every target" ON)

# One precompiled header for the whole tree (core/pch.h). Every target reuses it, so LibTorch's
# headers are parsed once per build instead of once per translation unit.
add_library(parallax_pch OBJECT ${PROJECT_SOURCE_DIR}/core/pch.cpp)
target_link_libraries(parallax_pch PUBLIC torch parallax_fmt)
target_include_directories(parallax_pch PUBLIC ${PROJECT_SOURCE_DIR})
if(PARALLAX_PCH)
  target_precompile_headers(parallax_pch PRIVATE ${PROJECT_SOURCE_DIR}/core/pch.h)
endif()

# LibTorch's shared libraries export their own (statically linked) copies of libstdc++'s
# std::filesystem functions; when LibTorch comes first in the global symbol lookup order, our
# calls bind to those copies, and on the CUDA wheel (torch 2.11+cu130) std::filesystem::remove_all
# from libtorch.so jumps to address 0. Putting libstdc++ first in every executable's DT_NEEDED list
# makes the dynamic linker resolve std:: symbols to the real libstdc++.
function(parallax_executable target)
  target_link_options(${target} BEFORE PRIVATE "LINKER:--push-state,--no-as-needed" "-lstdc++"
                      "LINKER:--pop-state")
  parallax_use_pch(${target})
endfunction()

function(parallax_use_pch target)
  if(PARALLAX_PCH)
    target_precompile_headers(${target} REUSE_FROM parallax_pch)
  endif()
endfunction()

# parallax_add_library(<name> SOURCES ... [DEPS ...])
# A shared library linked with --no-undefined: a layer that uses a symbol of a layer it does not
# list in DEPS fails to link, which is how the layering in ARCHITECTURE.md is enforced.
function(parallax_add_library name)
  cmake_parse_arguments(A "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  if(NOT A_SOURCES)
    # A layer that is still headers only (config structs): an interface target, same name.
    add_library(${name} INTERFACE)
    target_include_directories(${name} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} INTERFACE ${A_DEPS})
    return()
  endif()
  add_library(${name} SHARED ${A_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  target_link_options(${name} PRIVATE "-Wl,--no-undefined")
  parallax_use_pch(${name})
endfunction()

# OMP_NUM_THREADS=1: ctest runs tests side by side (-j) on few cores; one intra-op thread per test
# process avoids oversubscription (the numeric bounds hold for any thread count).
set(PARALLAX_TEST_ENV
    "OMP_NUM_THREADS=1"
    "OMPI_ALLOW_RUN_AS_ROOT=1"
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
    "OMPI_MCA_rmaps_base_oversubscribe=1"
    "OMPI_MCA_btl_vader_single_copy_mechanism=none"
    "NCCL_NVLS_ENABLE=0"
    "TORCH_SYMM_MEM_DISABLE_MULTICAST=1"
    "NVSHMEM_DISABLE_NVLS=1"
    "PARALLAX_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
    "PARALLAX_BINARY_DIR=${PROJECT_BINARY_DIR}")

# parallax_add_gtest(<name> SOURCES ... DEPS ... [LABELS ...] [MAIN gtest|none])
# One executable; every TEST in it becomes its own ctest entry.
function(parallax_add_gtest name)
  cmake_parse_arguments(A "" "MAIN" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${A_SOURCES})
  target_link_libraries(${name} PRIVATE ${A_DEPS} GTest::gtest)
  if(NOT A_MAIN STREQUAL "none")
    target_link_libraries(${name} PRIVATE GTest::gtest_main)
  endif()
  parallax_executable(${name})
  gtest_discover_tests(${name}
    PROPERTIES LABELS "unit;${A_LABELS}" ENVIRONMENT "${PARALLAX_TEST_ENV}" TIMEOUT 300
    DISCOVERY_TIMEOUT 120)
endfunction()

# parallax_add_mpi_test(<name> TARGET <exe> NP <n> [FILTER <gtest filter>] [TIMEOUT s] [COST s]
#                       [LABELS ...])
# Runs the whole executable (or the filtered tests) under `mpirun -np <n> --oversubscribe`. COST:
# seconds alone on a quiet 2-core machine, so ctest starts the long ones first.
function(parallax_add_mpi_test name)
  cmake_parse_arguments(A "" "TARGET;NP;FILTER;TIMEOUT;COST" "LABELS;ARGS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  set(_filter "")
  if(A_FILTER)
    set(_filter "--gtest_filter=${A_FILTER}")
  endif()
  add_test(NAME ${name}
           COMMAND ${PARALLAX_MPIRUN} --oversubscribe --bind-to none -np ${A_NP}
                   $<TARGET_FILE:${A_TARGET}> ${_filter} ${A_ARGS})
  set_tests_properties(${name} PROPERTIES LABELS "mpi;${A_LABELS}" TIMEOUT ${A_TIMEOUT}
                                          ENVIRONMENT "${PARALLAX_TEST_ENV}")
  if(A_COST)
    set_tests_properties(${name} PROPERTIES COST ${A_COST})
  endif()
endfunction()
