# Finds every third-party dependency once, for all layer targets.
#
# Required: LibTorch, MPI (OpenMPI), HDF5 (C library), fmt, yaml-cpp, GoogleTest.
# Optional, detected: CUDA + NCCL (only when LibTorch was built with CUDA), libonnx + protobuf.
#
# LibTorch is looked up, in order, from TORCH_DIR, CMAKE_PREFIX_PATH, and finally from the Python
# `torch` package (`torch.utils.cmake_prefix_path`) of PARALLAX_PYTHON (default: python3 on PATH).

set(PARALLAX_PYTHON "python3" CACHE STRING "Python interpreter whose torch package provides LibTorch")

# ---- LibTorch ---------------------------------------------------------------------------------
if(NOT TORCH_DIR AND NOT DEFINED ENV{TORCH_DIR})
  execute_process(
    COMMAND ${PARALLAX_PYTHON} -c "import torch; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _parallax_torch_prefix
    OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET
    RESULT_VARIABLE _parallax_torch_rc)
  if(_parallax_torch_rc EQUAL 0 AND _parallax_torch_prefix)
    list(APPEND CMAKE_PREFIX_PATH "${_parallax_torch_prefix}")
  endif()
endif()

# Torch's CUDA config needs the CUDA toolkit and, on recent versions, cuDNN/NVTX locations that
# the wheel ships under site-packages/nvidia. Point the finders at them before find_package(Torch).
execute_process(
  COMMAND ${PARALLAX_PYTHON} -c
          "import torch, os, sys; print(int(torch.version.cuda is not None)); print(os.path.dirname(os.path.dirname(torch.__file__)))"
  OUTPUT_VARIABLE _parallax_torch_info
  OUTPUT_STRIP_TRAILING_WHITESPACE
  ERROR_QUIET)
string(REPLACE "\n" ";" _parallax_torch_info "${_parallax_torch_info}")
list(LENGTH _parallax_torch_info _n)
set(PARALLAX_TORCH_HAS_CUDA OFF)
set(PARALLAX_SITE_PACKAGES "")
if(_n EQUAL 2)
  list(GET _parallax_torch_info 0 _has_cuda)
  list(GET _parallax_torch_info 1 PARALLAX_SITE_PACKAGES)
  if(_has_cuda)
    set(PARALLAX_TORCH_HAS_CUDA ON)
  endif()
endif()

if(PARALLAX_TORCH_HAS_CUDA)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(EXISTS "${PARALLAX_SITE_PACKAGES}/nvidia/cudnn")
    set(CUDNN_ROOT "${PARALLAX_SITE_PACKAGES}/nvidia/cudnn" CACHE PATH "")
  endif()
  if(NOT CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "52")
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  if(NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
endif()

find_package(Torch REQUIRED)
message(STATUS "Parallax: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} (CUDA: ${PARALLAX_TORCH_HAS_CUDA})")

# Torch's CMake only adds -D_GLIBCXX_USE_CXX11_ABI through TORCH_CXX_FLAGS; apply it to every
# target so our objects and LibTorch's agree on std::string's layout.
if(TORCH_CXX_FLAGS)
  separate_arguments(_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  add_compile_options(${_torch_flags})
endif()

# ---- MPI, HDF5, fmt, yaml-cpp, GoogleTest ------------------------------------------------------
find_package(MPI REQUIRED COMPONENTS C)
find_package(HDF5 REQUIRED COMPONENTS C)
# fmt: LibTorch ships fmt's headers in its include folder, which comes before /usr/include on the
# command line, so `#include <fmt/format.h>` always sees LibTorch's copy. Linking a different
# libfmt against those headers fails (v12 headers, v9 library), so when LibTorch ships fmt we use
# those headers in header-only mode; otherwise the system fmt (libfmt-dev) is used and linked.
add_library(parallax_fmt INTERFACE)
if(EXISTS "${TORCH_INSTALL_PREFIX}/include/fmt/format.h")
  target_compile_definitions(parallax_fmt INTERFACE FMT_HEADER_ONLY=1)
  target_link_libraries(parallax_fmt INTERFACE torch)
  message(STATUS "Parallax: fmt from LibTorch's headers (header-only)")
else()
  find_package(fmt REQUIRED)
  target_link_libraries(parallax_fmt INTERFACE fmt::fmt)
endif()
find_package(yaml-cpp REQUIRED)
find_package(GTest REQUIRED)
find_package(Threads REQUIRED)

# yaml-cpp 0.7 (Debian 12) exports `yaml-cpp`, 0.8 (Ubuntu 24.04) exports `yaml-cpp::yaml-cpp`.
if(TARGET yaml-cpp::yaml-cpp)
  set(PARALLAX_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(PARALLAX_YAML_TARGET yaml-cpp)
endif()

# HDF5's CMake module gives variables, not a target, on older CMake/HDF5 combinations.
if(NOT TARGET parallax_hdf5)
  add_library(parallax_hdf5 INTERFACE)
  if(TARGET hdf5::hdf5)
    target_link_libraries(parallax_hdf5 INTERFACE hdf5::hdf5)
  else()
    target_include_directories(parallax_hdf5 SYSTEM INTERFACE ${HDF5_C_INCLUDE_DIRS} ${HDF5_INCLUDE_DIRS})
    target_link_libraries(parallax_hdf5 INTERFACE ${HDF5_C_LIBRARIES})
    target_compile_definitions(parallax_hdf5 INTERFACE ${HDF5_DEFINITIONS})
  endif()
endif()

find_program(PARALLAX_MPIRUN NAMES mpirun mpiexec HINTS ${MPI_HOME}/bin REQUIRED)
# OpenMPI derives its prefix from an absolute argv[0]; /bin/mpirun (merged /usr) yields "/", which
# mpirun rejects ("a prefix ... only contained slashes"). The resolved path yields /usr.
get_filename_component(PARALLAX_MPIRUN "${PARALLAX_MPIRUN}" REALPATH)

# ---- CUDA + NCCL (optional) --------------------------------------------------------------------
set(PARALLAX_WITH_NCCL OFF)
if(PARALLAX_TORCH_HAS_CUDA)
  set(_nccl_hints "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${PARALLAX_SITE_PACKAGES}/nvidia/nccl"
                  "${PARALLAX_SITE_PACKAGES}/nvidia/cu13" "${CUDAToolkit_LIBRARY_ROOT}")
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(PARALLAX_WITH_NCCL ON)
    add_library(parallax_nccl INTERFACE)
    target_include_directories(parallax_nccl SYSTEM INTERFACE ${NCCL_INCLUDE_DIR})
    target_link_libraries(parallax_nccl INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
    message(STATUS "Parallax: NCCL at ${NCCL_LIBRARY}")
  else()
    message(WARNING "Parallax: LibTorch has CUDA but NCCL was not found; set NCCL_ROOT")
  endif()
endif()

# ---- ONNX (optional, for export) ---------------------------------------------------------------
set(PARALLAX_WITH_ONNX OFF)
set(ONNX_ROOT "" CACHE PATH "Prefix holding include/onnx and lib*/libonnx.so (e.g. an unpacked .deb)")
find_path(ONNX_INCLUDE_DIR onnx/onnx_pb.h HINTS ${ONNX_ROOT} ${ONNX_ROOT}/usr PATH_SUFFIXES include)
find_library(ONNX_LIBRARY NAMES onnx HINTS ${ONNX_ROOT} ${ONNX_ROOT}/usr
             PATH_SUFFIXES lib lib/x86_64-linux-gnu)
find_library(ONNX_PROTO_LIBRARY NAMES onnx_proto HINTS ${ONNX_ROOT} ${ONNX_ROOT}/usr
             PATH_SUFFIXES lib lib/x86_64-linux-gnu)
# libonnx links libprotobuf; an unpacked .deb prefix holds both (scripts/gpu_build.sh).
if(ONNX_ROOT AND NOT Protobuf_ROOT)
  set(Protobuf_ROOT "${ONNX_ROOT}")
endif()
find_package(Protobuf QUIET)
if(ONNX_INCLUDE_DIR AND ONNX_LIBRARY AND ONNX_PROTO_LIBRARY AND Protobuf_FOUND)
  set(PARALLAX_WITH_ONNX ON)
  add_library(parallax_onnx INTERFACE)
  target_include_directories(parallax_onnx SYSTEM INTERFACE ${ONNX_INCLUDE_DIR})
  # The library file, not protobuf::libprotobuf: LibTorch's CMake config defines a target of that
  # name for its own bundled protobuf, and FindProtobuf then keeps it.
  target_link_libraries(parallax_onnx INTERFACE ${ONNX_LIBRARY} ${ONNX_PROTO_LIBRARY} ${Protobuf_LIBRARIES})
  # LibTorch's include folder (an -isystem path, so searched before /usr/include) ships an older
  # protobuf's headers, and libonnx's generated code must see the protobuf it was built with. Links
  # to the two header trees in one folder given as -I (searched before every -isystem path) put
  # them first for the targets that use libonnx (checkpoint/export) and no other.
  set(_onnx_shim ${PROJECT_BINARY_DIR}/onnx-include)
  file(MAKE_DIRECTORY ${_onnx_shim})
  file(CREATE_LINK ${ONNX_INCLUDE_DIR}/onnx ${_onnx_shim}/onnx SYMBOLIC)
  file(CREATE_LINK ${Protobuf_INCLUDE_DIR}/google ${_onnx_shim}/google SYMBOLIC)
  target_include_directories(parallax_onnx BEFORE INTERFACE ${_onnx_shim})
  # Debian's libonnx is built with the ONNX_NAMESPACE=onnx and ONNX_ML=1 defaults.
  target_compile_definitions(parallax_onnx INTERFACE ONNX_NAMESPACE=onnx ONNX_ML=1)
  message(STATUS "Parallax: ONNX at ${ONNX_LIBRARY} (protobuf ${Protobuf_VERSION})")
else()
  message(STATUS "Parallax: libonnx + protobuf not found: ONNX export (parallax export --format onnx) is not "
                 "built. Install libonnx-dev libprotobuf-dev, or pass -DONNX_ROOT=<prefix> (an unpacked .deb; "
                 "scripts/gpu_build.sh does this from .debs/)")
endif()

# ---- libjpeg-turbo (optional, for JPEG-compressed image shards) -------------------------------
set(PARALLAX_WITH_TURBOJPEG OFF)
set(TURBOJPEG_ROOT "" CACHE PATH "Prefix holding include/turbojpeg.h and lib*/libturbojpeg.so (e.g. an unpacked .deb)")
find_path(TURBOJPEG_INCLUDE_DIR turbojpeg.h HINTS ${TURBOJPEG_ROOT} ${TURBOJPEG_ROOT}/usr PATH_SUFFIXES include)
find_library(TURBOJPEG_LIBRARY NAMES turbojpeg HINTS ${TURBOJPEG_ROOT} ${TURBOJPEG_ROOT}/usr
             PATH_SUFFIXES lib lib/x86_64-linux-gnu)
add_library(parallax_turbojpeg INTERFACE)
if(TURBOJPEG_INCLUDE_DIR AND TURBOJPEG_LIBRARY)
  set(PARALLAX_WITH_TURBOJPEG ON)
  target_include_directories(parallax_turbojpeg SYSTEM INTERFACE ${TURBOJPEG_INCLUDE_DIR})
  target_link_libraries(parallax_turbojpeg INTERFACE ${TURBOJPEG_LIBRARY})
  target_compile_definitions(parallax_turbojpeg INTERFACE PARALLAX_WITH_TURBOJPEG=1)
  message(STATUS "Parallax: libjpeg-turbo at ${TURBOJPEG_LIBRARY}")
else()
  message(STATUS "Parallax: libjpeg-turbo not found: JPEG image shards (--image-codec jpeg) are not built. "
                 "Install libturbojpeg0-dev, or pass -DTURBOJPEG_ROOT=<prefix>")
endif()

# nlohmann-json (Debian: nlohmann-json3-dev), optional: the nuScenes converter and
# `datagen --layout nuscenes` (data/nuscenes.cpp) read and write the nuScenes JSON tables with it.
set(PARALLAX_WITH_NUSCENES OFF)
find_package(nlohmann_json 3.2 QUIET)
add_library(parallax_json INTERFACE)
if(nlohmann_json_FOUND)
  set(PARALLAX_WITH_NUSCENES ON)
  target_link_libraries(parallax_json INTERFACE nlohmann_json::nlohmann_json)
  target_compile_definitions(parallax_json INTERFACE PARALLAX_WITH_NUSCENES=1)
else()
  message(STATUS "Parallax: nlohmann-json not found: `parallax convert nuscenes` is not built. Install nlohmann-json3-dev")
endif()

message(STATUS "Parallax: NCCL=${PARALLAX_WITH_NCCL} ONNX=${PARALLAX_WITH_ONNX} TURBOJPEG=${PARALLAX_WITH_TURBOJPEG} NUSCENES=${PARALLAX_WITH_NUSCENES}")
