// Helpers shared by the data layer's tests: temporary folders, small generated datasets and an
// independent projection (written from docs/data.md with LibTorch ops, not with data/geometry.h).
#pragma once

#include "core/error.h"
#include "data/datagen.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <string>

namespace parallax::data::testing {

namespace fs = std::filesystem;

// A fresh folder under the system temp dir, removed on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::random_device rd;
    path_ = fs::temp_directory_path() /
            ("parallax_data_" + tag + "_" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// Small scenes: 4 cameras of 48 x 80 on the default BEV grid (fast to render on 2 cores).
inline DatagenOptions small_options(const std::string& out, int64_t train, int64_t val,
                                    uint64_t seed = 7) {
  DatagenOptions o;
  o.out = out;
  o.train_scenes = train;
  o.val_scenes = val;
  o.gen.cameras = 4;
  o.gen.height = 48;
  o.gen.width = 80;
  o.gen.samples_per_pixel = 1;
  o.seed = seed;
  o.shard_scenes = 5;
  o.threads = 2;
  o.progress_interval_s = 1e9;
  return o;
}

// Expects `f` to throw DataError whose message holds every string of `needles`; returns it.
template <class F>
inline std::string expect_data_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
  } catch (const DataError& e) {
    const std::string msg = e.what();
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    EXPECT_EQ(msg.find("HDF5-DIAG"), std::string::npos) << msg;
    return msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected DataError, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected DataError, nothing thrown";
  return "";
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Projects ego points [P, 3] through K [3, 3] and cam_to_ego [4, 4] (float64 math): returns
// [P, 3] (u, v, depth), following docs/data.md: p_cam = inverse(cam_to_ego) p_ego, [u v 1] ~ K
// p_cam.
inline at::Tensor project(const at::Tensor& points, const at::Tensor& K,
                          const at::Tensor& cam_to_ego) {
  const at::Tensor p = points.to(at::kDouble);
  const at::Tensor ego_to_cam = at::inverse(cam_to_ego.to(at::kDouble));
  const at::Tensor ph = at::cat({p, at::ones({p.size(0), 1}, p.options())}, 1);
  const at::Tensor pc = at::matmul(ph, ego_to_cam.t()).slice(1, 0, 3);
  const at::Tensor uvw = at::matmul(pc, K.to(at::kDouble).t());
  const at::Tensor z = pc.select(1, 2).unsqueeze(1);
  return at::cat({uvw.slice(1, 0, 2) / uvw.slice(1, 2, 3), z}, 1);
}

}  // namespace parallax::data::testing
