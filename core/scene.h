// What a perception model needs to know about the data it is fed: the camera rig's image size,
// the BEV label grid and the class lists. The data layer fills it from dataset.json (or from
// defaults in benchmark mode); the model zoo builds models from it. Conventions (frames, units,
// tensor layouts) are specified in docs/data.md and are part of the contract.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::core {

struct SceneSpec {
  int64_t num_cameras = 6;
  int64_t image_height = 128;
  int64_t image_width = 224;
  // BEV label grid in the ego frame (x forward, y left), metres. Cell (i, j) covers
  // x in [x_min + i*res, x_min + (i+1)*res), y in [y_min + j*res, y_min + (j+1)*res).
  double x_min = -25.0, x_max = 25.0, y_min = -25.0, y_max = 25.0;
  double bev_resolution = 0.5;
  std::vector<std::string> bev_classes = {"background", "road",       "marking",
                                          "vehicle",    "pedestrian", "cyclist"};
  std::vector<std::string> box_classes = {"vehicle", "pedestrian", "cyclist"};
  int64_t max_boxes = 64;  // boxes per sample after padding

  int64_t bev_x_cells() const {
    return static_cast<int64_t>((x_max - x_min) / bev_resolution + 0.5);
  }
  int64_t bev_y_cells() const {
    return static_cast<int64_t>((y_max - y_min) / bev_resolution + 0.5);
  }
};

}  // namespace parallax::core
