// CPU ray caster for SceneLayout: one camera image per call, from the layout's float32-rounded
// cameras, so the stored intrinsics/extrinsics are exactly the geometry that made the pixels.
//
// Per pixel: `samples_per_pixel` rays (1: the pixel centre; 4: a rotated grid) against the ground
// plane z = 0 (procedural asphalt, lane markings, sidewalks, grass), the objects and the buildings
// (oriented boxes; candidates per 16 x 16 pixel tile from their projected corners), else the sky.
// Lambertian shading of box faces under the scene's sun, class-specific colours with per-object
// variation and simple face details (windows, heads, wheels), distance haze, per-camera exposure.
//
// Optionally also returns, from the pixel-centre ray, the instance buffer (index of the object in
// layout.objects, -1 for ground or sky, -2 for a building) and the depth z_cam of the hit (0 for
// sky). Pure function of its inputs; thread-safe (call it from many threads on shared layouts).
#pragma once

#include "data/scene_gen.h"

#include <ATen/core/Tensor.h>

namespace parallax::data {

struct CameraRender {
  at::Tensor image;     // uint8 [H, W, 3]
  at::Tensor instance;  // int32 [H, W] (only with buffers)
  at::Tensor depth;     // float32 [H, W] (only with buffers)
};

CameraRender render_camera(const SceneLayout& layout, int camera, int samples_per_pixel,
                           bool with_buffers);

// The same into caller-owned memory: `image` H*W*3 bytes; `instance` and `depth` H*W each, or null.
// Runs no LibTorch op (so it never starts LibTorch's intra-op threads from a worker thread).
void render_camera_into(const SceneLayout& layout, int camera, int samples_per_pixel,
                        uint8_t* image, int32_t* instance, float* depth);

}  // namespace parallax::data
