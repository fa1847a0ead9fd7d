// Test helper: flips one byte of an HDF5 dataset's stored data in place (checksums must catch it).
#pragma once

#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace parallax::ckpt_test {

// Flips (XOR 0x5a) byte `byte` of dataset `dataset`'s contiguous storage in HDF5 file `file`.
inline void corrupt_dataset_byte(const std::string& file, const std::string& dataset,
                                 int64_t byte) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0) << file;
  hid_t d = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
  if (d < 0) H5Fclose(f);
  ASSERT_GE(d, 0) << dataset;
  const haddr_t off = H5Dget_offset(d);
  H5Dclose(d);
  H5Fclose(f);
  ASSERT_NE(off, HADDR_UNDEF);
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto pos = static_cast<std::streamoff>(off) + static_cast<std::streamoff>(byte);
  io.seekg(pos);
  char c = 0;
  io.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  io.seekp(pos);
  io.write(&c, 1);
}

}  // namespace parallax::ckpt_test
